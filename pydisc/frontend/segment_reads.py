"""A fast recorder's segment's part for values read before `mark_step` (`bool(mask.all())` in a forward).

`Reads` is a base of `segment.Segment`; it uses the segment's `entries`, `links`, `externals`, `written`,
`evaluated` and `read_upto`. A read value is computed now by torch from the segment's inputs, apart from
the step, which computes it again; a call no meta kernel describes runs on such values (`read_call`).
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .. import metrics as _metrics
from ..config import CONFIG
from .fused import FV, Demote, FusedStep, decode
from .lazy_tensor import LazyTensor, materialize
from .source import user_source

__all__ = ["Reads", "holds_tensor"]

METRICS = _metrics.METRICS
_Tensor = torch.Tensor


class Reads:
    def evaluate(self, fids: list[int]) -> dict[int, torch.Tensor]:
        """The values `fids` computed now by torch from the segment's inputs, apart from the step (which
        computes them again): a mask's `.all()` in a forward reads a few ops. Values that depend on random
        numbers cannot be computed apart from the step (they would differ): those demote."""
        if CONFIG.strict:
            raise Demote("a value read before mark_step")
        if self.written:
            # the calls would write the inputs' device data now, and the step again
            raise Demote("a value read before mark_step in a forward that wrote an input")
        needed = set(fids)
        used = set()        # the inputs the picked calls take
        picked = []
        for i in range(len(self.entries) - 1, -1, -1):
            entry = self.entries[i]
            if any(f in needed for f in entry[3]):
                recipe, slots = self.links[i]
                if recipe.random:
                    raise Demote("a value read before mark_step that depends on random numbers")
                picked.append(entry)
                for v in slots:
                    if type(v) is FV:
                        needed.add(v.fid)
                    else:
                        used.add(v.index)
        # only those are read: a parameter the step running on the worker writes would wait for it (HF's
        # attention-mask check reads the mask, not the embeddings computed before it)
        inputs = [(materialize(t).detach() if type(t) is LazyTensor else t) if k in used else None
                  for k, t in enumerate(self.externals)]
        step = FusedStep(tuple(reversed(picked)), len(inputs), (), None, (), self.device.type)
        with torch.no_grad():
            env = step.forward(inputs)
        METRICS.materializations += 1
        METRICS.materialization_sources[user_source(3) or "?"] += 1
        METRICS.fast_reads += 1
        self.evaluated.update(env)
        self.read_upto = len(self.entries)
        return env

    def read_call(self, func, enc_args, enc_kwargs, slots, reason: str):
        """A call no meta kernel describes, on values computed now: its result if it holds no tensor (a
        read: `bool(mask.all())`); otherwise (a data-dependent shape) the segment is demoted."""
        env = self.evaluate([v.fid for v in slots if type(v) is FV])
        reals = _Reals(self.externals)
        args = [decode(a, env, reals) for a in enc_args]
        kwargs = {k: decode(v, env, reals) for k, v in enc_kwargs.items()}
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, _Tensor)]    # (plain containers)
        versions = [x._version for x in tensors]
        try:
            out = func(*args, **kwargs)
        except Exception:
            raise Demote(reason) from None      # eager's error, raised again by the demoted step
        if holds_tensor(out) or \
                any(x._version != v for x, v in zip(tensors, versions)):
            raise Demote(reason)    # a data-dependent shape, or a write (`h[:, n] = 0`, n a tensor)
        return out


class _Reals:
    """The device data of a segment's inputs, by index, read when asked for (`decode`)."""

    __slots__ = ("externals",)

    def __init__(self, externals: list) -> None:
        self.externals = externals

    def __getitem__(self, index: int) -> torch.Tensor:
        x = self.externals[index]
        return materialize(x) if type(x) is LazyTensor else x


def holds_tensor(a) -> bool:
    """Whether `a` is a tensor or holds one in lists, tuples or dicts, of any subclass (pytree does not
    look into a list subclass)."""
    stack = [a]
    while stack:
        x = stack.pop()
        if isinstance(x, _Tensor):
            return True
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return False
