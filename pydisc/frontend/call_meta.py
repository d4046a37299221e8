"""What one call of a fast-recorded forward does, from one run on meta tensors: `Recipe`, cached in
`RECIPES` by the call's signature and argument layouts (`Segment.record` builds the key).

The run tells the outputs' layouts and which arguments they are or view, the arguments written in
place, the argument slots autograd's graph of the results reaches (a gradient flows only there), and
whether the call draws random numbers (an ATen op tagged `nondeterministic_seeded`, or by name). Where
the run accepted mixed dtypes that eager's kernel refuses, eager's exception is raised at the call.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from ..diagnostics import call_name
from .dtype_checks import EAGER_DTYPE_CHECKS, eager_dtype_error
from .fused import FV, XV, Demote, NoMeta
from .layout import contiguous_strides
from .op_facts import HIDDEN_WRITES, draws

__all__ = ["RECIPES", "Recipe", "call_recipe", "on_device"]

_grad_enabled = torch.is_grad_enabled
_is_alias_of = torch._C._is_alias_of
_Tensor = torch.Tensor

_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "rrelu", "gumbel",
                 "exponential", "geometric", "cauchy", "poisson")

_META_DEVICE = torch.device("meta")    # the segment's device, in a call's arguments


def _random(func) -> bool:
    """Does the call draw random numbers (by its name: over-inclusive is safe)?"""
    name = call_name(func).lower()
    return any(w in name for w in _RANDOM_WORDS)


class _Watch(TorchDispatchMode):
    """Notes, of the ops a call's meta run dispatches:
    - `seen`: whether one draws random numbers;
    - `written`: the tensors they write, as their schemas say, or as `HIDDEN_WRITES` says where the schema
      does not (a training BatchNorm's running statistics, whose writes bump no version counter either);
    - `refused`: the exception eager raises for one whose meta function accepts the mixed dtypes eager's
      kernel refuses (a float64 batch into a float32 Linear; frontend/dtype_checks.py)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.seen = False
        self.refused = None
        self.written: list[torch.Tensor] = []
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if draws(func, args, kwargs):
            self.seen = True
        if self.refused is None and getattr(func, "_opname", None) in EAGER_DTYPE_CHECKS:
            self.refused = eager_dtype_error(func, args, kwargs or {}, self.device)
        hidden = HIDDEN_WRITES.get(func)
        if hidden is not None:
            flag, positions = hidden
            if len(args) > flag and args[flag]:
                self.written += [args[i] for i in positions if isinstance(args[i], _Tensor)]
        elif func._schema.is_mutable:    # (whether or not the op bumps the version counters)
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = args[i] if i < len(args) and not a.kwarg_only else (kwargs or {}).get(a.name)
                    self.written += [x for x in (v if isinstance(v, (list, tuple)) else (v,))
                                     if isinstance(x, _Tensor)]
        return func(*args, **(kwargs or {}))


def _grad_node(m: torch.Tensor):
    """The autograd node a gradient of `m` flows into (its grad_fn, or its AccumulateGrad)."""
    return m.grad_fn if m.grad_fn is not None else torch.autograd.graph.get_gradient_edge(m).node


def _reached(roots) -> set:
    seen, todo = set(), [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return seen


class Recipe:
    """What one call does to arguments of given layouts, from its run on meta tensors."""
    __slots__ = ("spec", "leaves", "outputs", "mutated", "mutated_rg", "connected", "random", "draws")

    def __init__(self, spec, leaves, outputs, mutated, mutated_rg, connected, random, draws) -> None:
        self.spec = spec            # pytree spec of the result (None: a single tensor)
        self.leaves = leaves        # the result's leaves, tensors as None
        # per tensor leaf: (leaf index, size, stride, offset, dtype, nbytes, requires_grad, alias, same,
        # plain); alias: the argument slot it is a view of; same: the argument slot it is; plain:
        # contiguous at offset 0 (its wrapper is made without strides, which costs less)
        self.outputs = outputs
        self.mutated = mutated      # argument slots written in place
        self.mutated_rg = mutated_rg    # ... and whether each requires grad after the write
        self.connected = connected  # argument slots autograd's graph of the results reaches
        self.random = random        # it may draw random numbers (by its ATen ops, or by its name)
        self.draws = draws          # it does: an ATen op of its meta run draws (frontend/random_state.py)


def call_recipe(func, enc_args, enc_kwargs, slots: list, metas: dict, fake, device: torch.device) -> Recipe:
    """Run `func` once on the meta (or, under autocast, `fake`) tensors `metas` stand for (by `id` of each
    of `slots`), and note what it did: its outputs' layouts, what it wrote, views, which arguments
    autograd's graph of the results reaches, whether it draws random numbers. NoMeta where no meta
    kernel can say; Demote for what a segment cannot follow."""
    margs = [_to_meta(a, metas, fake) for a in enc_args]
    mkwargs = {k: _to_meta(v, metas, fake) for k, v in enc_kwargs.items()}
    distinct = list({id(v): metas[id(v)] for v in slots}.items())
    before = [(m._version, m.shape, m.stride(), m.storage_offset()) for _, m in distinct]
    grad = _grad_enabled()
    nodes = {key: _grad_node(m) for key, m in distinct if grad and m.requires_grad}
    watch = _Watch(device)
    try:
        with torch.set_grad_enabled(grad), fake or contextlib.nullcontext(), watch:
            out = func(*margs, **mkwargs)
    except Exception as exc:
        raise NoMeta("no meta kernel: %s" % call_name(func)) from exc
    if watch.refused is not None:
        raise watch.refused.with_traceback(None)    # eager's exception, at the call
    written = set()
    for (key, m), (version, shape, stride, offset) in zip(distinct, before):
        if m.shape != shape or m.stride() != stride or m.storage_offset() != offset:
            raise Demote("an in-place op that changes sizes")
        if m._version != version or any(_is_alias_of(w, m) for w in watch.written):
            written.add(key)
    slot_of = {}
    for i, v in enumerate(slots):
        slot_of.setdefault(id(v), i)
    mutated = tuple(slot_of[key] for key in written)
    mutated_rg = tuple(bool(m.requires_grad) for key, m in distinct if key in written)
    if isinstance(out, _Tensor):
        leaves, spec = [out], None
    else:
        leaves, spec = pytree.tree_flatten(out)
    connected = frozenset()
    if nodes:
        # the arguments a gradient of the results (or of what was written in place) reaches, as
        # autograd's graph connects them: not a size or dtype source (`type_as`), not a no_grad use
        reached = _reached([o.grad_fn for o in leaves if isinstance(o, _Tensor)] +
                           [m.grad_fn for key, m in distinct if key in written])
        connected = frozenset(slot_of[key] for key, node in nodes.items() if node in reached)
    outputs = []
    kept = []
    for j, o in enumerate(leaves):
        if not isinstance(o, _Tensor):
            kept.append(o)
            continue
        kept.append(None)
        if o.device.type != ("meta" if fake is None else device.type):
            raise Demote("a call that makes a tensor on another device")
        same = alias = None
        for key, m in distinct:
            if o is m:
                same = slot_of[key]
                break
            if alias is None and _is_alias_of(o, m):
                alias = slot_of[key]
        size, stride, offset = tuple(o.shape), o.stride(), o.storage_offset()
        outputs.append((j, size, stride, offset, o.dtype, o.untyped_storage().nbytes(), bool(o.requires_grad),
                        alias, same, offset == 0 and stride == contiguous_strides(size)))
    if not outputs:
        if mutated:
            pass        # written in place, returning nothing (`x[i] = v`)
        elif spec is None or all(not isinstance(x, _Tensor) for x in leaves):
            raise Demote("a call returning no tensor")
    return Recipe(spec, kept, tuple(outputs), mutated, mutated_rg, connected,
                  watch.seen or _random(func), watch.seen)


def _to_meta(a, metas: dict, fake):
    """A call's argument on the meta (or fake) tensors `metas` holds for its values, devices made meta's."""
    t = type(a)
    if t is FV or t is XV:
        return metas[id(a)]
    if t is list or t is tuple:
        return t([_to_meta(x, metas, fake) for x in a])
    if t is torch.device or t is str and a[:4] in ("cpu", "cuda", "cuda:"):
        return _META_DEVICE if fake is None else a
    return a


def on_device(mode: FakeTensorMode, m: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor of `device` with meta tensor `m`'s layout and requires_grad (views keep theirs)."""
    with mode:
        base = torch.empty_strided((m.untyped_storage().nbytes() // max(m.dtype.itemsize, 1),), (1,),
                                   dtype=m.dtype, device=device)
        if m.requires_grad and not m.is_leaf:
            base = base.requires_grad_(True).clone()
        out = base.as_strided(m.shape, m.stride(), m.storage_offset())
        if m.requires_grad and m.is_leaf:
            out = out.detach().requires_grad_(True)
    return out


RECIPES: dict[tuple, Recipe | str] = {}     # (a str: why no meta kernel describes the call, a read)
