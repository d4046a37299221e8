"""Torch <-> IREE tensor exchange, without copies where IREE allows it.

IREE imports a DLPack tensor as a dense, offset-0 buffer view, so anything else (non-contiguous, a view
with a storage offset, a data pointer not 64-byte aligned) is copied first. Imported buffers allow
READ|WRITE but not DISCARD_WRITE, which IREE needs when a result is an input or a constant (it fills or
copies instead of dispatching); a module that needs it gets its outputs imported as host allocations
on the CPU (compiled.py) and staged through IREE-allocated buffers (`StagedOutput`) elsewhere.
"""
from __future__ import annotations

import iree.runtime as ireert
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from .session import DeviceSession

__all__ = ["ALIGNMENT", "is_dense", "dense_copy", "import_tensor", "StagedOutput"]

ALIGNMENT = 64  # bytes; IREE's kernels assume aligned base pointers (misalignment is a sticky CUDA fault)


def is_dense(t: torch.Tensor) -> bool:
    """True if IREE may use the tensor's memory as is."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.data_ptr() % ALIGNMENT == 0


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous, offset-0 copy (torch allocations are at least 64-byte aligned)."""
    return t.clone(memory_format=torch.contiguous_format)


def import_tensor(session: DeviceSession, t: torch.Tensor) -> ireert.HalBufferView:
    """Zero-copy import of a dense tensor; the buffer view keeps the tensor alive."""
    return session.hal_device.from_dlpack_capsule(to_dlpack(t))


class StagedOutput:
    """An IREE-allocated buffer standing in for a torch output; `copy_back` writes it into the tensor."""

    __slots__ = ("target", "view", "_session")

    def __init__(self, session: DeviceSession, target: torch.Tensor) -> None:
        # The element type IREE uses for this dtype is read from a throwaway import of the target.
        element_type = import_tensor(session, target).element_type
        nbytes = max(target.numel() * target.element_size(), 1)
        buffer = session.hal_device.allocator.allocate_buffer(
            memory_type=ireert.MemoryType.DEVICE_LOCAL,
            allowed_usage=ireert.BufferUsage.DEFAULT,
            allocation_size=nbytes,
        )
        self.target = target
        self.view = ireert.HalBufferView(buffer, list(target.shape), element_type)
        self._session = session

    def copy_back(self) -> None:
        s = self._session
        result = from_dlpack(s.hal_device.create_dlpack_capsule(self.view, s.dlpack_device_type, s.dlpack_device_id))
        self.target.copy_(result.view(self.target.shape))
