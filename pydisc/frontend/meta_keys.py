"""The meta cache's keys and recipes: how an op's output metadata is looked up without running its meta
kernel again. A key is the op, each argument's `key_part` (a lazy tensor's `LayoutKey`, constants as
themselves) and `KWARGS` between positional and keyword arguments; the `Recipe` it finds says where
each output's storage comes from and its layout."""
from __future__ import annotations

import torch

from .layout import layout_key
from .op_facts import OpInfo, arg
from .symbolic import hint
from .tensor import LazyTensor, LiftedScalar

__all__ = ["KWARGS", "Recipe", "constant", "constant_part", "device_of", "key_part", "symbolic_args"]


class Recipe:
    """How to record an op for one meta-cache key (op, input layouts, constants), worked out once:
    the output container, per output where its storage comes from and its layout, the device, and
    the encoding of each positional argument that is a constant (equal constants have equal keys)."""

    __slots__ = ("kind", "outputs", "device", "reinterprets", "constants")

    def __init__(self, info: OpInfo, args, kwargs, kind, descs, symbolic: bool = False) -> None:
        self.kind = kind
        self.constants = tuple(map(constant, args))
        self.device = device = device_of(args, kwargs, symbolic)
        self.reinterprets = False
        plans = info.returns
        outputs = []
        for j, d in enumerate(descs):
            if d is None:
                outputs.append(None)
                continue
            plan = plans[j] if j < len(plans) else (plans[0] if plans else None)
            size, stride, offset, dtype, nbytes = d
            if plan is not None and plan[0] == "view":
                src = arg(args, kwargs, plan[1], plan[2])
                if dtype != src.dtype:
                    # a view that reinterprets the bytes (view(dtype), view_as_real): storages here
                    # hold one dtype, so the view is taken of the device data, as an eager op
                    self.reinterprets = True
                nbytes = src._storage.nbytes
            meta = (size, stride, offset, dtype)
            lkey = None
            if all(type(x) is int for x in size) and all(type(x) is int for x in stride) and \
                    type(offset) is int and type(nbytes) is int:
                lkey = layout_key(size, tuple(stride), offset, dtype, nbytes, device)
            outputs.append((plan, size, tuple(stride), offset, dtype, nbytes, meta, lkey))
        self.outputs = tuple(outputs)


KWARGS = object()              # separates positional and keyword arguments in a meta-cache key
_TRUE, _FALSE = ("bool", True), ("bool", False)     # True == 1: a bool constant is tagged


def constant_part(a):
    """A constant's part of a key (meta cache, structural signature): floats that vary per step are
    lifted by a rewrite, the others are constants, and output sizes may depend on them."""
    t = type(a)
    if t is float:
        return ("f", a) if a == a and a != 0.0 else ("f", repr(a))   # -0.0 == 0.0, nan != nan
    if t is bool:
        return _TRUE if a else _FALSE       # True == 1
    return a


def constant(a) -> tuple | None:
    """(encoded argument, its signature parts) of an argument with no tensor, lifted scalar or size
    symbol in it; None for the others. Entries share the encoded lists: nothing writes into them."""
    t = type(a)
    if t is list or t is tuple or t is torch.Size:
        parts: list = [("list", len(a))]
        items = []
        for x in a:
            c = constant(x)
            if c is None:
                return None
            items.append(c[0])
            parts += c[1]
        return items, tuple(parts)
    if t is LazyTensor or t is LiftedScalar or t is torch.SymInt or t is torch.SymFloat or \
            t is torch.SymBool or isinstance(a, torch.Tensor):
        return None
    return a, (constant_part(a),)


def key_part(a):
    """The part of an op's meta-cache key for one argument: what its output metadata depends on."""
    t = type(a)
    if t is LazyTensor:
        return a._mk
    if t is list or t is tuple:
        if a and type(a[0]) is LazyTensor:
            try:
                return (t, *[x._mk for x in a])     # all lazy: a foreach op's list (else no `_mk`)
            except AttributeError:
                pass
        parts = [t]
        for x in a:
            tx = type(x)
            if tx is LazyTensor:
                parts.append(x._mk)
            elif tx is int:
                parts.append(x)
            else:
                parts.append(key_part(x))
        return tuple(parts)
    if t is LiftedScalar:
        return float          # a 0-d float32 tensor whatever its value
    if t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
        return hint(a)        # a size kept from an earlier symbolic step, recorded as its value
    if isinstance(a, torch.Tensor):
        return ("r", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device)
    return constant_part(a)


def device_of(args, kwargs, symbolic: bool = False) -> torch.device:
    for a in args:
        if isinstance(a, LazyTensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, LazyTensor):
                    return x.device
    for a in kwargs.values():
        if isinstance(a, LazyTensor):
            return a.device
    for a in args:      # rewrites record ops on eager operands of a lazy computation
        if isinstance(a, torch.Tensor):
            return a.device
    if "device" in kwargs:   # a factory op of a symbolic step
        return torch.device(kwargs["device"]) if kwargs["device"] is not None else torch.device("cpu")
    if symbolic:
        return torch.device("cpu")
    raise RuntimeError("pydisc: an op reached the lazy dispatcher without a lazy tensor argument")


def symbolic_args(args, kwargs) -> bool:
    """Does an op of a symbolic step involve a symbolic size (a tensor or an int argument)?"""
    for a in args:
        t = type(a)
        if t is LazyTensor:
            if a._concrete is not None:
                return True
        elif t is list or t is tuple or t is torch.Size:
            if symbolic_args(a, {}):
                return True
        elif t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
            return True
    if kwargs:
        return symbolic_args(tuple(kwargs.values()), {})
    return False
