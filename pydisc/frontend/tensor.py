"""`LazyTensor`, the torch tensor subclass whose ops are recorded, and the small types around it.

A lazy tensor is either device data (`_real`) or a value of the pending trace. Every ATen op on one
reaches `__torch_dispatch__`, which hands it to the recorder (frontend/lazy_tensor.py, bound here by
`bind` at its import); reads that bypass the dispatcher (`repr`, `tolist`, `numpy`, pickling) are
overridden to materialize the value first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .layout import LayoutKey, hint, layout_key
from .trace import LazyStorage

__all__ = ["LazyTensor", "LiftedScalar", "StrictModeError", "bind", "concrete_layout", "install_to_dlpack", "is_lazy",
           "liftable"]

_make_wrapper = torch.Tensor._make_wrapper_subclass
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass
_DATA = torch._C.TensorBase.data      # torch's `.data`: the getter records a detached alias of the value


class StrictModeError(RuntimeError):
    """PYDISC_STRICT=1 and a step fell back to eager or read a value before mark_step."""


class LiftedScalar:
    """A Python number that becomes a scalar input of the step instead of a compile-time constant."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


_LIFTABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def liftable(t, value) -> bool:
    """Can the Python float `value`, an operand of an arithmetic op on `t`, become a `LiftedScalar`?"""
    # a 0-d half tensor times a 0-d float32 tensor would promote to float32, unlike times a Python float
    return isinstance(t, LazyTensor) and type(value) is float and \
        (t.dtype is torch.float32 or (t.dtype in _LIFTABLE_DTYPES and t.dim() > 0))


class LazyTensor(torch.Tensor):
    """A tensor whose value is either device data (`_real`) or a value of the pending trace."""

    _storage: LazyStorage
    _mk: LayoutKey          # this step's concrete layout, as a meta-cache key part
    # Defaults, set on the instance only where they differ (recorded outputs set the fewest attributes).
    _real: torch.Tensor | None = None
    _vid: int = -1
    _epoch: int = -1
    _fake = None            # fake tensor of a symbolic step (`frontend/symbolic.py`)
    _fake_sid: int = 0      # ... and which step it belongs to
    _concrete: tuple | None = None   # this step's concrete (size, stride, offset) when sizes are symbolic
    # A fast value (frontend/fast.py): its id in the open segment, and the segment; or, once that
    # segment was demoted, the ATen-level tensor it stands for.
    _fid: int | None = None
    _fseg = None
    _redirect = None
    # Bound by frontend/lazy_tensor.py at import (`bind`): the recorder every op is dispatched to, and
    # the functions that read a value (`materialize`) and wrap device data (`to_lazy`).
    _recorder = None
    _read = None
    _wrap = None

    @staticmethod
    def __new__(cls, size, stride, offset, dtype, device, storage: LazyStorage, real=None, requires_grad=False):
        t = _make_wrapper(cls, size, strides=stride, storage_offset=offset, dtype=dtype, device=device,
                          requires_grad=requires_grad)
        t._storage = storage
        if real is not None:
            t._real = real
        if cls._recorder.symbolic is not None and (  # only a symbolic step makes symbolic sizes
                any(type(x) is not int for x in size) or any(type(x) is not int for x in stride)
                or type(offset) is not int or type(storage.nbytes) is not int):
            # sizes of a symbolic step: keep this step's concrete layout for everything concrete
            t._concrete = concrete = (tuple(map(hint, size)), tuple(map(hint, stride)), hint(offset))
            t._mk = layout_key(*concrete, dtype, hint(storage.nbytes), t.device)
        else:
            nbytes = storage.nbytes       # symbolic in a storage made by an earlier symbolic step
            if type(device) is not torch.device or device.index is None and device.type != "cpu":
                # (the wrapper's own, as tensors name it: `cuda:0` for "cuda"; read with the handler
                # off, which sits on the class while a forward records, ~2 us a read)
                with _NO_TORCH_FUNCTION():
                    device = t.device
            t._mk = layout_key(tuple(size), tuple(stride), offset, dtype,
                               nbytes if type(nbytes) is int else hint(nbytes), device)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return cls._recorder.dispatch(func, args, kwargs or {})

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's setter changes the wrapper's sizes, strides and dtype but not the value it stands for:
        # the assignment would be lost (Recorder.set_data)
        self._recorder.set_data(self, value)

    # Reading a value runs what it needs. These bypass the dispatcher, so they are overridden here.
    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self._read(self, reason="repr"))

    def __format__(self, spec: str) -> str:
        return format(self._read(self, reason="format"), spec)

    def _exported(self, reason: str) -> torch.Tensor:
        """The device data, whose address user code takes (NumPy, DLPack, `data_ptr`, the storage): the
        steps after this one write their new values of it into this memory (`LazyStorage.exported`)."""
        real = self._read(self, reason=reason)
        t = self
        while t is not None:
            storage = getattr(t, "_storage", None)     # (a value of an open fast segment has none yet)
            if storage is not None:
                storage.exported = True
            t = t._redirect
        return real

    def data_ptr(self) -> int:
        return self._exported("data_ptr").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        # the wrapper's own storage has no data (torch: "data is not allocated yet"): the device data's
        return self._exported("untyped_storage").untyped_storage()

    def __dlpack__(self, *args, **kwargs):
        # (torch's own reads the wrapper, which has no data: the process crashed)
        return self._exported("dlpack").__dlpack__(*args, **kwargs)

    def apply_(self, callable):
        # (torch's own calls `callable` on each element of the wrapper, which has no data: the process crashed)
        raise RuntimeError("pydisc: apply_ calls Python on each element of a tensor's data, which a lazy tensor "
                           "only has once its step has run; use elementwise torch ops, or apply_ to an eager "
                           "copy (t.cpu()) and make it lazy again (pydisc.to_lazy)")

    def tolist(self):
        return self._read(self, reason="tolist").tolist()

    def numpy(self, *, force: bool = False):
        return self._exported("numpy").detach().cpu().numpy(force=force)

    def cpu(self, memory_format=torch.preserve_format):
        return self._read(self, reason="cpu").cpu(memory_format=memory_format).clone() \
            if self.device.type == "cpu" else self._read(self, reason="cpu").cpu(memory_format=memory_format)

    def __array__(self, dtype=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __reduce_ex__(self, proto):
        # torch.save / pickle / deepcopy store the device data as a plain tensor.
        real = self._read(self, reason="pickle").detach()
        if isinstance(self, torch.nn.Parameter):
            return (torch.nn.Parameter, (real.clone(), self.requires_grad))
        return real.clone().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        real = self._read(self, reason="deepcopy").detach().clone()
        out = self._wrap(real)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out


def is_lazy(t: Any) -> bool:
    """True if `t` is a pydisc lazy tensor."""
    return isinstance(t, LazyTensor)


def concrete_layout(t: LazyTensor) -> tuple:
    """(size, stride, offset) of `t` in this step's concrete numbers."""
    c = t._concrete
    return c if c is not None else (tuple(t.shape), t.stride(), t.storage_offset())


def bind(recorder, read: Callable, wrap: Callable) -> None:
    """Give `LazyTensor` its recorder and the read and wrap functions (frontend/lazy_tensor.py, once)."""
    LazyTensor._recorder = recorder
    LazyTensor._read = staticmethod(read)
    LazyTensor._wrap = staticmethod(wrap)


_TO_DLPACK = torch.utils.dlpack.to_dlpack


def _to_dlpack(tensor: torch.Tensor):
    if isinstance(tensor, LazyTensor):
        tensor = tensor._exported("dlpack")
    return _TO_DLPACK(tensor)


def install_to_dlpack() -> None:
    """`torch.utils.dlpack.to_dlpack` (also `torch.to_dlpack`) reads a tensor's data pointer in C, with no
    way for a subclass to step in: given a lazy tensor, whose wrapper has no data, its consumer crashed
    the process. Installed at import, they hand over the device data (what `__dlpack__` does)."""
    torch.utils.dlpack.to_dlpack = torch.to_dlpack = _to_dlpack
