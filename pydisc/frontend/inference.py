"""Steps without autograd record `F.linear` and `matmul` as one op each.

Both are composite ATen ops: torch splits them into views and a matrix product before a tensor subclass
sees anything, so a step records `linear` on a 3-D input as `view`, `t`, `addmm` and `_unsafe_view`, and
a batched `matmul` as `expand`s, `view`s, `bmm` and `_unsafe_view`: each a full trip through
`__torch_dispatch__` (~15-30 µs of host time). Where no gradient is recorded (under `torch.no_grad()` or
`torch.inference_mode()`), nothing needs those pieces at recording time: the lazy tensor's
`__torch_function__` records `aten.linear` / `aten.matmul` themselves, and torch splits them the same
way when the plan is traced (`frontend/replay.py`), so the compiled graph is the same, from about half
the recorded ops (GPT-2 inference; bench/README.md has the runs).

A Python `__torch_function__` costs ~1 µs on every torch call and attribute read of a lazy tensor, so it
is installed only while the lazy module's forward runs without grad (`use_for_forward`, from the module's
input hook) and removed at the next forward with grad. Where something else must see the composite op
(autograd, autocast's casts, functorch transforms, a dispatch mode other than the one of a step recorded
with symbolic sizes), the call takes torch's usual path. Steps recorded with symbolic sizes and those
recorded with concrete ones record the same ops, so that the latter match the former's template.
"""
from __future__ import annotations

import torch

from .lazy_tensor import RECORDER, LazyTensor
from .symbolic import own_modes

__all__ = ["use_for_forward", "installed"]

aten = torch.ops.aten
_OPS = {
    torch._C._nn.linear: (aten.linear.default, frozenset({"bias"})),   # torch.nn.functional.linear
    torch.matmul: (aten.matmul.default, frozenset()),
    torch.Tensor.matmul: (aten.matmul.default, frozenset()),           # also `a @ b`
}
_DISABLED = LazyTensor.__dict__.get("__torch_function__")
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_autocast = torch._C._is_any_autocast_enabled
_functorch = torch._C._are_functorch_transforms_active
_modes = torch._C._len_torch_dispatch_stack


def _torch_function(cls, func, types, args=(), kwargs=None):
    known = _OPS.get(func)
    # (steps recorded with symbolic sizes push a dispatch mode of pydisc's own, frontend/symbolic.py)
    if known is not None and not _grad_enabled() and (not kwargs or kwargs.keys() <= known[1]) \
            and not _autocast() and not _functorch() and _modes() == own_modes():
        return RECORDER.dispatch(known[0], args, kwargs or {})
    with _NO_SUBCLASS():
        return func(*args, **(kwargs or {}))


_INSTALLED = classmethod(_torch_function)


_PINNED = None     # while the fast recorder owns `__torch_function__`: how to put its handler on the class


def pin(handler_on) -> None:
    """The fast recorder (frontend/fast.py) owns `__torch_function__` while `handler_on` is given (a function
    that puts its handler on the class) and calls this module's handler itself for forwards without
    grad; None gives it back."""
    global _PINNED
    _PINNED = handler_on


def installed() -> bool:
    return LazyTensor.__dict__.get("__torch_function__") is _INSTALLED


def use_for_forward() -> None:
    """Install the composite-op recording for a forward that runs without grad, remove it for one
    with grad (called by the lazy module's input hook)."""
    if _PINNED is not None:
        if not _grad_enabled():
            _PINNED()
        return
    want = not _grad_enabled()
    if want != installed():
        if want:
            LazyTensor.__torch_function__ = _INSTALLED
        elif _DISABLED is None:
            del LazyTensor.__torch_function__
        else:
            LazyTensor.__torch_function__ = _DISABLED
