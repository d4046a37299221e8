"""Tensor layouts as pydisc keeps them: a storage as one flat tensor over all its bytes, a tensor as a
(size, stride, offset) view of it, and `LayoutKey`, a layout's interned part of the meta-cache key."""
from __future__ import annotations

import torch

__all__ = ["LayoutKey", "contiguous_strides", "flat_base", "hint", "is_symbolic", "is_whole", "layout_key",
           "gradient_layout", "numel", "view_of_base"]


def is_whole(t: torch.Tensor) -> bool:
    """Is `t` contiguous over all of its storage (its `flat_base` a plain view of it)?"""
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()


def flat_base(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `t` (offset 0), the form in which storages are kept."""
    if is_whole(t):
        return t.detach().reshape(-1)
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.detach().as_strided((n,), (1,), 0)


def view_of_base(base: torch.Tensor, size, stride, offset) -> torch.Tensor:
    if offset == 0 and base.numel() == numel(size) and tuple(stride) == contiguous_strides(size):
        return base.view(size)
    return base.as_strided(size, stride, offset)


def numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def contiguous_strides(size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


class LayoutKey:
    """One per distinct (size, stride, offset, dtype, storage bytes, device): a lazy tensor's part of
    the meta-cache key. It hashes and compares by identity, which is cheaper than the tuple, and it is
    made once per tensor (recorded outputs take it from their op's `Recipe`). Not an int, so that a
    tensor and an int constant in the same argument position never look alike."""

    __slots__ = ("layout",)

    def __init__(self, layout: tuple) -> None:
        self.layout = layout

    def __repr__(self) -> str:
        return "LayoutKey%r" % (self.layout,)


_LAYOUT_KEYS: dict[tuple, LayoutKey] = {}


def layout_key(size: tuple, stride: tuple, offset: int, dtype: torch.dtype, nbytes: int, device) -> LayoutKey:
    layout = (size, stride, offset, dtype, nbytes, device)
    key = _LAYOUT_KEYS.get(layout)
    if key is None:
        key = _LAYOUT_KEYS[layout] = LayoutKey(layout)
    return key


def is_symbolic(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def hint(x):
    """The concrete value of a size in the step being recorded (no guard is added)."""
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    if isinstance(x, torch.SymFloat):
        return float(x.node.hint)
    if isinstance(x, torch.SymBool):
        return bool(x.node.hint)
    return x


_GRADIENT_LAYOUTS: dict[LayoutKey, tuple] = {}


def gradient_layout(mk: LayoutKey) -> tuple:
    """(size, stride, nbytes, dtype, layout key, trace meta) of the gradient a fused step gives a parameter
    of layout `mk`: its strides where it is contiguous from its storage's start, else contiguous ones, in
    a storage of its own (as autograd lays out a leaf's gradient). Worked out once per layout."""
    found = _GRADIENT_LAYOUTS.get(mk)
    if found is None:
        size, stride, offset, dtype, _, device = mk.layout
        if offset != 0 or not torch.empty_strided(size, stride, dtype=dtype, device="meta").is_contiguous():
            stride = contiguous_strides(size)
        stride = tuple(stride)
        nbytes = numel(size) * dtype.itemsize
        found = _GRADIENT_LAYOUTS[mk] = (size, stride, nbytes, dtype, layout_key(size, stride, 0, dtype, nbytes, device),
                                         (size, stride, 0, dtype))
    return found
