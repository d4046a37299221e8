"""Releasing lazy tensors: each live lazy tensor becomes, in place, the plain tensor of its device data.

Once the whole-step choice (pydisc/driver/step_choice.py) has kept eager execution for the rest of the
process, the recorder's pass-through still routes every op that touches a lazy tensor (parameters,
buffers, optimizer state: most of a training step's ops) through the Python wrapper, 15-30 µs each.
Releasing removes that: `torch.utils.swap_tensors` (what torch's own module conversion uses under
`torch.__future__.set_swap_module_params_on_conversion`) gives each lazy tensor object the class and
the data of a plain alias of its device data, keeping the object's identity. Modules, optimizers and
the user's own references hold the same objects as before, now plain tensors, and the step runs in
torch exactly as it would without pydisc.

A tensor that cannot be swapped (something else holds its C++ tensor or a weak reference to it, it
has autograd hooks or history, a value of it is still pending) stays lazy; pass-through keeps it
correct, only not free. `release_all` says how many were released and how many stayed.
"""
from __future__ import annotations

import gc
import weakref

import torch

from .layout import flat_base
from .lazy_tensor import RECORDER, LazyTensor
from .trace import LazyStorage

__all__ = ["release_all", "restore"]

# the wrapper's own attributes (lazy_tensor.LazyTensor, and Parameter's marker for a subclass)
_INTERNAL = frozenset(("_storage", "_mk", "_real", "_vid", "_epoch", "_fake", "_fake_sid", "_concrete",
                       "_is_param"))


def _releasable(t: LazyTensor) -> bool:
    return (RECORDER.is_clean(t) and t.grad_fn is None and not weakref.getweakrefs(t)
            and t._backward_hooks is None and getattr(t, "_post_accumulate_grad_hooks", None) is None)


def _plain(t: LazyTensor) -> torch.Tensor:
    real = t._real.detach()      # a fresh alias of the device data: nothing else holds its C++ tensor
    if isinstance(t, torch.nn.Parameter):
        plain = torch.nn.Parameter(real, requires_grad=t.requires_grad)
    else:
        plain = real.requires_grad_(t.requires_grad)
    for name, value in t.__dict__.items():      # the user's own attributes go with the object
        if name not in _INTERNAL:
            setattr(plain, name, value)
    return plain


def _grads_detached(tensors) -> list[tuple]:
    """A gradient is held by its parameter's C++ tensor, which a swap replaces: detach the gradients of
    `tensors` (leaves only: torch warns when a non-leaf's is read) and return them, to put back after."""
    grads = []
    for t in tensors:
        g = t.grad if t.grad_fn is None else None
        if g is not None:
            grads.append((t, g))
            t.grad = None
    return grads


def _swapped(t: torch.Tensor, new: torch.Tensor) -> bool:
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError:        # held elsewhere: its checks run before anything is swapped
        return False
    return True


def release_all(into: list | None = None, kept_into: list | None = None) -> tuple[int, int]:
    """Swap every live, materialized lazy tensor for a plain one in place. Call with nothing pending
    (right after a mark_step). Returns (released, kept lazy); the released objects are appended to
    `into` if given (`restore` makes them lazy again), weak references to the kept ones to `kept_into`."""
    with RECORDER.lock:
        if RECORDER.trace.entries:
            raise RuntimeError("pydisc: release_all() with ops pending; call pydisc.mark_step() first")
        if RECORDER.in_flight is not None:
            RECORDER.in_flight("release")
        lazies = [o for o in gc.get_objects() if type(o) is LazyTensor]   # (no __class__ lookups)
        grads = _grads_detached(lazies)
        released = kept = 0
        for t in lazies:
            if _releasable(t) and _swapped(t, _plain(t)):
                released += 1
                if into is not None:
                    into.append(t)
            else:
                kept += 1
                if kept_into is not None:
                    kept_into.append(weakref.ref(t))
        for t, g in grads:
            t.grad = g
        return released, kept


def restore(objects: list) -> int:
    """Make the objects that `release_all` released lazy tensors again, in place, with the data they
    hold now (and their gradients, if any): the reverse swap. Tensors over one device storage share one
    lazy storage, as their views would. Call with nothing pending. Returns how many could not be swapped
    back (something holds them: they stay plain)."""
    with RECORDER.lock:
        if RECORDER.trace.entries:
            raise RuntimeError("pydisc: restore() with ops pending; call pydisc.mark_step() first")
        storages: dict = {}

        def lazy_of(t: torch.Tensor) -> LazyTensor:
            real = t.detach()
            where = (real.device, real.untyped_storage().data_ptr(), real.untyped_storage().nbytes())
            if not where[1]:
                where = id(t)    # no memory (numel 0): shares nothing
            storage = storages.get(where)
            if storage is None:
                storage = storages[where] = LazyStorage(real.untyped_storage().nbytes(), flat_base(real))
            return LazyTensor(tuple(real.shape), real.stride(), real.storage_offset(), real.dtype, real.device,
                              storage, real=real)

        plain = [t for t in objects if not isinstance(t, LazyTensor)]
        grads = _grads_detached(plain)
        failed = 0
        for t in plain:
            if t.grad_fn is not None or weakref.getweakrefs(t):
                failed += 1
                continue
            data = lazy_of(t)
            if isinstance(t, torch.nn.Parameter):
                lazy = torch.nn.Parameter(data, requires_grad=t.requires_grad)
            else:
                lazy = data.requires_grad_(t.requires_grad)
            for name, value in t.__dict__.items():
                setattr(lazy, name, value)
            if not _swapped(t, lazy):
                failed += 1
        for t, g in grads:
            # a gradient released with its parameter is lazy again; one made by the plain steps is wrapped
            t.grad = g if isinstance(g, LazyTensor) or not isinstance(t, LazyTensor) else lazy_of(g)
        return failed
