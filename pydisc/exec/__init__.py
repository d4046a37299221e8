"""pydisc.exec: everything IREE. Compile StableHLO text for a torch device, cache it, and run it on
torch tensors where they live (zero-copy through DLPack; results written into caller-allocated outputs).
"""
from __future__ import annotations

from .compiler import clear_cache, compile_module
from .disk_cache import CacheInfo, DiskCache, configured_disk_cache
from .errors import CacheDirError, CacheWarning, CompileError, DeviceOutOfMemoryError, ExecutionError
from .compiled import CompiledModule
from .target import Target, target_for

__all__ = [
    "compile_module",
    "clear_cache",
    "configured_disk_cache",
    "DiskCache",
    "CacheInfo",
    "CacheDirError",
    "CacheWarning",
    "CompiledModule",
    "CompileError",
    "DeviceOutOfMemoryError",
    "ExecutionError",
    "Target",
    "target_for",
]
