"""Exceptions raised by the exec layer; each message says what the caller can do next."""
from __future__ import annotations

__all__ = ["CompileError", "ExecutionError", "CacheDirError", "CacheWarning"]


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


class CacheDirError(RuntimeError):
    """The on-disk compile cache folder is not safe to load executables from (or is not a folder)."""

    def __init__(self, message: str, *, directory: str) -> None:
        super().__init__(message)
        self.directory = directory


class CacheWarning(UserWarning):
    """The on-disk compile cache could not be used (unwritable folder, full disk); compiling continues."""
