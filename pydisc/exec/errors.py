"""Exceptions raised by the exec layer; each message says what the caller can do next."""
from __future__ import annotations

import torch

__all__ = ["CompileError", "ExecutionError", "DeviceOutOfMemoryError", "CacheDirError", "CacheWarning",
           "is_out_of_memory"]

# how a failed allocation reads: torch's CPU allocator raises a plain RuntimeError, IREE reports the status
# RESOURCE_EXHAUSTED (host memory, or CUDA_ERROR_OUT_OF_MEMORY on a GPU)
_OUT_OF_MEMORY_TEXTS = ("DefaultCPUAllocator: can't allocate memory", "RESOURCE_EXHAUSTED")


class CompileError(RuntimeError):
    """IREE could not compile a module. Carries the trimmed diagnostics and, if dumped, the MLIR path."""

    def __init__(self, message: str, *, diagnostics: str = "", dump_path: str | None = None) -> None:
        super().__init__(message)
        self.diagnostics = diagnostics
        self.dump_path = dump_path


class ExecutionError(RuntimeError):
    """IREE failed while running a compiled module (bad arguments or a runtime fault)."""

    def __init__(self, message: str, *, function: str = "main") -> None:
        super().__init__(message)
        self.function = function


class DeviceOutOfMemoryError(torch.OutOfMemoryError):
    """A device ran out of memory while a step ran: in torch's allocator (a compiled cluster's outputs, an
    eager op) or in IREE's (its buffers inside a call). A torch.OutOfMemoryError (the class
    torch.cuda.OutOfMemoryError names), so handlers written for eager PyTorch catch it. `where` names the
    cluster or op, `nbytes` what was being allocated (None when not known)."""

    def __init__(self, message: str, *, where: str = "", nbytes: int | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.nbytes = nbytes


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a failed allocation (of the host or a device), whoever raised it."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(t in text for t in _OUT_OF_MEMORY_TEXTS)


class CacheDirError(RuntimeError):
    """The on-disk compile cache folder is not safe to load executables from (or is not a folder)."""

    def __init__(self, message: str, *, directory: str) -> None:
        super().__init__(message)
        self.directory = directory


class CacheWarning(UserWarning):
    """The on-disk compile cache could not be used (unwritable folder, full disk); compiling continues."""
