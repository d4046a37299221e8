"""The CUDA kernels inside a `.vmfb`: PTX and, per kernel, block size, dynamic shared memory, counts.

IREE 3.13 embeds a CUDA executable as a 64-byte header (magic `CDA1`, version, payload size) followed by
a flatbuffer (file identifier `CDA1`) of `iree.hal.cuda.ExecutableDef`:

    ExecutableDef { exports: [ExportDef]; modules: [ModuleDef]; ... }
    ExportDef { module_ordinal: u32; kernel_name: string; block_dims: {x, y, z: u32};
                block_shared_memory_size: u32; constant_count: u32; binding_flags: [u32]; ... }
    ModuleDef { ptx_image: string }

Only the fields above are read, with a flatbuffer reader of a few lines (no dependency). Anything that
does not have this shape raises `LaunchUnsupported`: the cluster then runs through IREE's runtime.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import LaunchUnsupported

__all__ = ["Kernel", "CudaExecutable", "read_executables"]

_MAGIC = b"CDA1"
_HEADER = 64


@dataclass(frozen=True)
class Kernel:
    name: str
    module: int                   # index into CudaExecutable.ptx
    block: tuple[int, int, int]
    shared_memory: int            # dynamic shared memory, bytes
    constants: int                # 32-bit push constants
    bindings: int                 # buffer pointers


@dataclass(frozen=True)
class CudaExecutable:
    ptx: tuple[bytes, ...]
    kernels: dict[str, Kernel]


class _Table:
    """A flatbuffer table: fields by index, read lazily."""

    __slots__ = ("buf", "pos", "slots")

    def __init__(self, buf: bytes, pos: int) -> None:
        vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        size = struct.unpack_from("<H", buf, vtable)[0]
        self.buf, self.pos = buf, pos
        self.slots = struct.unpack_from("<%dH" % ((size - 4) // 2), buf, vtable + 4)

    def _at(self, field: int) -> int | None:
        if field >= len(self.slots) or self.slots[field] == 0:
            return None
        return self.pos + self.slots[field]

    def u32(self, field: int, default: int = 0) -> int:
        at = self._at(field)
        return default if at is None else struct.unpack_from("<I", self.buf, at)[0]

    def struct_u32(self, field: int, count: int) -> tuple[int, ...]:
        at = self._at(field)
        if at is None:
            raise LaunchUnsupported("CUDA executable: a required struct field is missing")
        return struct.unpack_from("<%dI" % count, self.buf, at)

    def _target(self, field: int) -> int | None:
        at = self._at(field)
        return None if at is None else at + struct.unpack_from("<I", self.buf, at)[0]

    def string(self, field: int) -> bytes:
        at = self._target(field)
        if at is None:
            return b""
        n = struct.unpack_from("<I", self.buf, at)[0]
        return self.buf[at + 4: at + 4 + n]

    def vector(self, field: int) -> tuple[int, int]:
        """(position of the first element, length)."""
        at = self._target(field)
        if at is None:
            return 0, 0
        return at + 4, struct.unpack_from("<I", self.buf, at)[0]

    def tables(self, field: int) -> list["_Table"]:
        first, n = self.vector(field)
        out = []
        for k in range(n):
            at = first + 4 * k
            out.append(_Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0]))
        return out


def _parse(payload: bytes) -> CudaExecutable:
    if payload[4:8] != _MAGIC:
        raise LaunchUnsupported("CUDA executable: unexpected flatbuffer identifier %r" % payload[4:8])
    root = _Table(payload, struct.unpack_from("<I", payload, 0)[0])
    ptx = tuple(m.string(0) for m in root.tables(1))
    kernels = {}
    for export in root.tables(0):
        name = export.string(1).decode()
        module = export.u32(0)
        if not name or module >= len(ptx) or not ptx[module]:
            raise LaunchUnsupported("CUDA executable: export %r has no PTX" % name)
        _, bindings = export.vector(5)
        kernels[name] = Kernel(name, module, export.struct_u32(2, 3), export.u32(3), export.u32(4), bindings)
    return CudaExecutable(ptx, kernels)


def read_executables(vmfb: bytes) -> CudaExecutable:
    """Every CUDA kernel embedded in the module, merged (kernel names are unique within a module); none
    for a module that only copies or fills."""
    ptx: list[bytes] = []
    kernels: dict[str, Kernel] = {}
    at = vmfb.find(_MAGIC)
    while at != -1:
        version, size = struct.unpack_from("<IQ", vmfb, at + 4)
        payload = vmfb[at + _HEADER: at + _HEADER + size]
        if version != 0 or len(payload) != size or payload[4:8] != _MAGIC:
            at = vmfb.find(_MAGIC, at + 1)   # the bytes `CDA1` elsewhere (e.g. the identifier itself)
            continue
        executable = _parse(payload)
        for kernel in executable.kernels.values():
            if kernel.name in kernels:
                raise LaunchUnsupported("CUDA executable: kernel %s is defined twice" % kernel.name)
            kernels[kernel.name] = Kernel(kernel.name, kernel.module + len(ptx), kernel.block,
                                          kernel.shared_memory, kernel.constants, kernel.bindings)
        ptx.extend(executable.ptx)
        at = vmfb.find(_MAGIC, at + _HEADER + size)
    return CudaExecutable(tuple(ptx), kernels)   # empty for a module of copies and fills only
