"""Runtime sessions: one IREE VM instance per process, one HAL device per torch device.

cuda:0 and cuda:1 are different IREE devices; IREE's CUDA driver uses the primary context (the one torch
uses), so tensors imported from torch are directly addressable by IREE's kernels.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import iree.runtime as ireert
import torch

from .target import target_for

__all__ = ["DeviceSession", "session_for", "vm_instance", "cuda_context"]

_LOCK = threading.Lock()
_INSTANCE: ireert.VmInstance | None = None
_SESSIONS: dict[torch.device, "DeviceSession"] = {}
_CUDA_FLAGS_SET = False

# DLPack device type codes used when exporting IREE buffers back to torch.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2


@dataclass(frozen=True)
class DeviceSession:
    """The IREE objects that serve one torch device."""

    device: torch.device
    hal_device: ireert.HalDevice
    hal_module: ireert.VmModule
    dlpack_device_type: int
    dlpack_device_id: int

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def vm_instance() -> ireert.VmInstance:
    global _INSTANCE
    with _LOCK:
        if _INSTANCE is None:
            _INSTANCE = ireert.VmInstance()
        return _INSTANCE


@contextlib.contextmanager
def cuda_context(device: torch.device) -> Iterator[None]:
    """Make `device`'s primary context current for IREE work, then restore torch's current device.

    IREE's CUDA driver loads executables and launches kernels in the thread's current context and
    leaves the last one it used current; without this, cuda:0 work after cuda:1 work fails with
    CUDA_ERROR_INVALID_HANDLE and torch's notion of the current device silently changes.
    """
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.current_device()
    torch.cuda.set_device(device.index)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        device = torch.device("cpu")
    return device


def _set_cuda_flags_once() -> None:
    # Must run before the first CUDA device is made: lets IREE export the buffers it allocates (the
    # staged-output path in tensors.py) and keeps allocations ordered without stream-ordered pools.
    global _CUDA_FLAGS_SET
    if not _CUDA_FLAGS_SET:
        ireert.flags.parse_flags("--cuda_async_allocations=false")
        _CUDA_FLAGS_SET = True


def _create_hal_device(device: torch.device) -> ireert.HalDevice:
    target = target_for(device)
    try:
        driver = ireert.get_driver(target.driver)
        if device.type == "cuda":
            _set_cuda_flags_once()
            # "cuda://N" is cuDeviceGet(N): the same ordinal torch uses under CUDA_VISIBLE_DEVICES.
            return driver.create_device_by_uri(f"cuda://{device.index}")
        return driver.create_default_device()
    except Exception as e:  # noqa: BLE001 - IREE raises plain RuntimeError/ValueError
        raise RuntimeError(
            f"pydisc could not create the IREE {target.driver!r} device for {device}: {e}. "
            "Check that the device is visible to this process, or disable pydisc (PYDISC_DISABLE=1)."
        ) from e


def session_for(device: torch.device | str) -> DeviceSession:
    """The (cached) session for a torch device; created on first use."""
    device = _normalize(device)
    session = _SESSIONS.get(device)
    if session is not None:
        return session
    instance = vm_instance()
    with _LOCK:
        session = _SESSIONS.get(device)
        if session is None:
            with cuda_context(device):
                hal_device = _create_hal_device(device)
            session = DeviceSession(
                device=device,
                hal_device=hal_device,
                hal_module=ireert.create_hal_module(instance, hal_device),
                dlpack_device_type=_DLPACK_CUDA if device.type == "cuda" else _DLPACK_CPU,
                dlpack_device_id=device.index or 0,
            )
            _SESSIONS[device] = session
        return session
