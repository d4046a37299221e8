"""What the recorder knows about an ATen op, worked out once from its schema: `OpInfo` (its writes,
views and returns, whether it needs data and runs eagerly, its rewrite, whether any rule or
decomposition covers it) and the rewrite registry; which ops run eagerly is policy.py's."""
from __future__ import annotations

from typing import Callable

import torch

from .decompositions import DECOMPOSITIONS
from .lowering.registry import LOWERINGS
from .policy import EAGER_OPS

__all__ = ["HIDDEN_WRITES", "OpInfo", "REWRITES", "arg", "opinfo", "draws", "dropout_p"]

aten = torch.ops.aten

# Ops that write arguments their schemas do not mark as written, and whose writes bump no version
# counter: op -> (the position of its `training` flag, the positions it writes while that is true). The
# dispatcher records them as ops whose schemas declare the writes (frontend/rewrites.py); the fast
# recorder's meta run looks them up here (frontend/call_meta.py).
HIDDEN_WRITES: dict[object, tuple[int, tuple[int, ...]]] = {
    op: (5, (3, 4)) for op in (aten.native_batch_norm.default, aten.cudnn_batch_norm.default,
                               aten.miopen_batch_norm.default)}

# Rewrites recorded instead of the op (frontend/rewrites.py, foreach.py, collectives.py), installed at
# import: by op, by "_foreach_" for every foreach op (aten's namespace loads them lazily), by namespace.
REWRITES: dict[object, Callable] = {}


class OpInfo:
    __slots__ = ("name", "returns", "written_args", "needs_eager", "is_view", "rewrite", "unruled", "seeded")

    def __init__(self, func) -> None:
        # OpOverload hashes in Python: everything per op is looked up once by id() and kept here.
        self.name = str(func)
        self.seeded = _SEEDED in func.tags     # it may draw random numbers (`draws` says whether it does)
        self.rewrite = REWRITES.get(func)
        if self.rewrite is None and func.__name__.startswith("_foreach_"):
            self.rewrite = REWRITES.get("_foreach_")
        if self.rewrite is None:   # whole namespaces: torch.distributed's (frontend/collectives.py)
            self.rewrite = REWRITES.get(func.namespace)
        schema = func._schema
        sets: dict[str, tuple[int, str]] = {}
        written = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    sets[s] = (i, a.name)
                if a.alias_info.is_write:
                    written.append((i, a.name))
        returns = []
        for r in schema.returns:
            ai = r.alias_info
            if ai is not None and ai.before_set:
                i, name = sets[next(iter(ai.before_set))]
                returns.append(("write" if ai.is_write else "view", i, name))
            elif ai is not None and func.is_view:
                # `Tensor(a)[]` (split, unbind, chunk): the alias set sits on the list's elements, and
                # every element views the aliased argument
                i, name = next((i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None)
                returns.append(("view", i, name))
            else:
                returns.append(None)
        self.returns = returns
        self.written_args = tuple(written)
        self.is_view = any(r is not None and r[0] == "view" for r in returns)
        self.needs_eager = func in EAGER_OPS or (not schema.returns and not written) \
            or any(str(r.type) not in _TENSOR_RETURN_TYPES for r in schema.returns)
        # neither a StableHLO rule nor a decomposition: a likely fallback, whose source line the ledger
        # wants even in steps recorded without source lines
        functional = func
        if schema.is_mutable and func._opname.endswith("_"):   # add_ is recorded, add is lowered
            packet = getattr(torch.ops.aten, func._opname[:-1], None)
            functional = getattr(packet, func._overloadname, func) if packet is not None else func
        # (composite ops, such as `linear` recorded whole in steps without grad, are split by torch)
        self.unruled = functional not in LOWERINGS and functional not in DECOMPOSITIONS and \
            not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


_TENSOR_RETURN_TYPES = {"Tensor", "List[Tensor]", "Tensor[]", "Optional[Tensor]", "Tensor?"}
OPINFOS: dict[int, OpInfo] = {}    # id(OpOverload) -> facts; overloads live as long as the process


def opinfo(func) -> OpInfo:
    info = OPINFOS.get(id(func))
    if info is None:
        info = OPINFOS[id(func)] = OpInfo(func)
    return info


_SEEDED = torch.Tag.nondeterministic_seeded


def dropout_p(func, args, kwargs):
    """The `dropout_p` argument of an op that has one (attention kernels are tagged as seeded, and draw
    only with dropout), else None."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            if kwargs and "dropout_p" in kwargs:
                return kwargs["dropout_p"]
            return args[i] if i < len(args) else a.default_value
    return None


def draws(func, args, kwargs) -> bool:
    """Whether an ATen op draws random numbers: tagged `nondeterministic_seeded`, and with a nonzero
    `dropout_p` where it has one (arguments as called or as recorded: `dropout_p` is a constant)."""
    return _SEEDED in getattr(func, "tags", ()) and dropout_p(func, args, kwargs) != 0.0


def arg(args, kwargs, index: int, name: str):
    return args[index] if index < len(args) else kwargs.get(name)


