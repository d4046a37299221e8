"""Following the calls of a module's last segment (frontend/segment.py).

A training loop's forwards make the same calls step after step. The calls of a module's last
segment that closed are kept (`Segment.log`, `FAST.scripts`), each with its encoded arguments, signature,
recipe and the layouts of its inputs; a call that matches the next one kept takes them as they are,
without encoding its arguments, building its key and looking it up (`follow`). The two come to the
same: a kept call's key was made of its function, grad mode, autocast dtype, constants, which values
of the segment and which inputs it took, and their layouts. The layouts of the segment's values
follow from the calls before (the same calls with the same recipes give the same metadata); the
inputs' are compared. The first call that differs ends the following for the rest of the segment.
A read (a call no meta kernel describes: `bool(mask.all())`) is kept with why, in its recipe's place, and
computed again each time it is followed (`Segment.read_call`): its value decides the calls after it,
which are compared as any.
"""
from __future__ import annotations

import torch

from .fused import FV, XV
from .lazy_tensor import LazyTensor

__all__ = ["Following", "Script"]

_Tensor = torch.Tensor
# Constants a call follows its kept call with where they are equal and of the same type (`Following._same`):
# those whose encoding is themselves, or follows from their value alone (a string naming a device or not).
_FOLLOWED_CONSTANTS = frozenset({int, bool, torch.dtype, torch.Size, torch.memory_format, torch.layout,
                                 type(None), type(Ellipsis), str, torch.device})


class Following:
    """`Segment`'s part that follows the kept calls: uses its `script`, `cursor`, `ext_index`, `externals`,
    `external` and `layout_of`."""

    script: "Script | None"
    cursor: int

    def follow(self, func, grad: bool, amp, args, kwargs, slots: list):
        """The kept call this one matches, with `slots` filled; or None, and the following ends."""
        script, i = self.script, self.cursor
        if i < len(script):
            call = script[i]
            if call[0] is func and call[1] is grad and call[2] == amp and self._same_args(args, kwargs, call, slots):
                layout_of = self.layout_of
                for k, lay in call[7]:
                    if layout_of(slots[k]) != lay:
                        break
                else:
                    self.cursor = i + 1
                    return call
        self.script = None
        slots.clear()
        return None

    def _same_args(self, args, kwargs, call, slots: list) -> bool:
        kept_args, kept_kwargs = call[3], call[4]
        if len(args) != len(kept_args) or len(kwargs or ()) != len(kept_kwargs):
            return False
        same = self._same
        for a, e in zip(args, kept_args):
            if not same(a, e, slots):
                return False
        if kwargs:
            for (k, a), (kept, e) in zip(kwargs.items(), kept_kwargs.items()):
                if k != kept or not same(a, e, slots):
                    return False
        return True

    def _same(self, a, e, slots: list) -> bool:
        """Whether argument `a` encodes as `e` did in the kept call: the same value of the segment, the same
        input (a new one where the kept call met a new one), an equal constant of the same type. Notes
        its tensor slots."""
        te = type(e)
        if te is FV:
            if type(a) is LazyTensor and a._fid == e.fid and a._fseg is self:
                slots.append(e)
                return True
            return False
        if te is XV:
            if type(a) is LazyTensor:
                if a._fid is not None:
                    return False
            elif not isinstance(a, _Tensor):
                return False
            index = self.ext_index.get(id(a))
            if index is None:
                if e.index != len(self.externals):
                    return False
                self.external(a)
            elif index != e.index:
                return False
            slots.append(e)
            return True
        if type(a) is not te:
            return False
        if te is tuple or te is list:
            if len(a) != len(e):
                return False
            for x, y in zip(a, e):
                if not self._same(x, y, slots):
                    return False
            return True
        if te is float:
            return a == e and (a != 0.0 or repr(a) == repr(e))      # (-0.0 == 0.0; nan != nan: not the same)
        if te is slice:     # (of ints: a tensor in a slice demotes, `encode`)
            return all(type(x) is int or x is None for x in (a.start, a.stop, a.step)) and a == e
        return te in _FOLLOWED_CONSTANTS and a == e


class Script(list):
    """The calls of a module's last segment that closed, as `Segment.follow` takes them; with the tuple of
    their signatures, the value `backward()` was called on and what `Segment.leaves` found for it."""

    __slots__ = ("calls", "loss", "leaves")

    def __init__(self, log: list, calls: tuple, loss: int | None, leaves: tuple) -> None:
        super().__init__(log)
        self.calls = calls
        self.loss = loss
        self.leaves = leaves
