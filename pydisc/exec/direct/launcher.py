"""A compiled cluster whose CUDA kernels pydisc launches itself, on torch's current stream.

IREE's runtime runs its own CUDA stream with host-only semaphores: every call costs ~48 us of host time
and a synchronisation of torch's stream. `DirectModule` takes the kernels out of the `.vmfb`
(`kernels.py`) and the launch sequence out of the host code (`schedule.py`), and launches them with the
CUDA driver (`driver.py`) on `torch.cuda.current_stream()`: no synchronisation, ordered with torch's own
work, capturable by `torch.cuda.graph`, transients allocated by torch's caching allocator.

A module is stored as a bundle: the `.vmfb` and the schedule (JSON), or the reason the schedule could
not be read; then the `.vmfb` runs through IREE's runtime (`CompiledModule`) and the reason is counted
in `metrics()["direct_launch_fallbacks"]`.
"""
from __future__ import annotations

import ctypes
import json
import math
import struct
from collections.abc import Sequence

import torch

from ...diagnostics import warn_once
from ...metrics import METRICS, METRICS_LOCK
from ..errors import ExecutionError
from ..tensors import ALIGNMENT, dense_copy
from .driver import CudaError, driver
from .errors import LaunchUnsupported
from .kernels import read_executables
from .schedule import Schedule, extract_schedule

__all__ = ["DirectModule", "compile_bundle", "load_bundle"]

_BUNDLE_MAGIC = b"PDDL2\0"   # the schedule's format: older bundles fail to load and are compiled again
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_empty = torch.empty
_u8 = torch.uint8


def compile_bundle(compile_str, text: str, input_type: str, flags: Sequence[str]) -> bytes:
    """Compile `text` through the host code (`--compile-to=executable-targets`) and on to the `.vmfb`:
    the same bytes as one compile, for about 5% more time; the schedule is read from the host code."""
    host = compile_str(text, input_type=input_type, extra_args=[*flags, "--compile-to=executable-targets"])
    vmfb = compile_str(host, input_type="none", extra_args=[*flags, "--compile-from=executable-targets"])
    try:
        parsed = extract_schedule(host)
        check_kernels(read_executables(vmfb), parsed)   # the kernels must be readable and match
        schedule = parsed.to_json()
    except LaunchUnsupported as e:
        schedule = json.dumps({"unsupported": str(e)})
    except Exception as e:  # noqa: BLE001 - host code of a shape the extractor did not expect: not launchable
        schedule = json.dumps({"unsupported": "reading the host code failed (%s: %s)" % (type(e).__name__, e)})
    payload = schedule.encode()
    return _BUNDLE_MAGIC + struct.pack("<Q", len(vmfb)) + vmfb + payload


def split_bundle(blob: bytes) -> tuple[bytes, dict | Schedule]:
    if not blob.startswith(_BUNDLE_MAGIC):
        raise ValueError("not a pydisc direct-launch bundle")
    at = len(_BUNDLE_MAGIC)
    (size,) = struct.unpack_from("<Q", blob, at)
    vmfb = blob[at + 8: at + 8 + size]
    text = blob[at + 8 + size:].decode()
    data = json.loads(text)
    return vmfb, (data if "unsupported" in data else Schedule(**data))


def load_bundle(blob: bytes, session, name: str, runtime_module):
    """A `DirectModule`, or `runtime_module(vmfb, session, name)` (IREE's runtime) with the reason
    counted when the schedule could not be read or the kernels not loaded."""
    vmfb, schedule = split_bundle(blob)
    reason = schedule.get("unsupported") if isinstance(schedule, dict) else None
    if reason is None:
        try:
            return DirectModule(vmfb, blob, schedule, session, name)
        except LaunchUnsupported as e:
            reason = str(e)
        except CudaError as e:
            reason = "kernel load: %s" % e
    with METRICS_LOCK:
        METRICS.direct_launch_fallbacks[reason[:120]] += 1
    warn_once("direct:" + reason[:120], "pydisc: %s runs through IREE's runtime instead of direct kernel "
              "launch (%s); it is correct but each call synchronises the GPU" % (name, reason))
    module = runtime_module(vmfb, session, name)
    module.vmfb = blob
    return module


def check_kernels(executable, schedule: Schedule) -> set[str]:
    """The kernels the schedule dispatches, each checked against the executable: present, with as many
    bindings and push constants as the dispatch passes."""
    used = set()
    for command in schedule.commands:
        if command[0] != "dispatch":
            continue
        kernel = executable.kernels.get(command[1])
        if kernel is None:
            raise LaunchUnsupported("kernel %s is not in the executable" % command[1])
        if kernel.bindings != len(command[4]) or kernel.constants != len(command[3]):
            raise LaunchUnsupported("kernel %s: %d bindings/%d constants in the executable, %d/%d dispatched"
                                    % (kernel.name, kernel.bindings, kernel.constants, len(command[4]),
                                       len(command[3])))
        used.add(command[1])
    return used


class _Launch:
    """One kernel launch at one shape: the grid, and a parameter block whose pointer slots are filled
    at each call (the driver copies the parameters when the launch is queued)."""

    __slots__ = ("function", "grid", "block", "shared", "params", "param_array", "param_ptrs", "pointers")

    def __init__(self, function: int, grid, block, shared: int, pointers, constants) -> None:
        n = len(pointers) + len(constants)
        self.function = function
        self.grid = grid
        self.block = block
        self.shared = shared
        self.params = (ctypes.c_uint64 * max(n, 1))()
        for k, value in enumerate(constants):
            self.params[len(pointers) + k] = value & 0xFFFFFFFF
        base = ctypes.addressof(self.params)
        self.param_array = (ctypes.c_void_p * max(n, 1))(*[base + 8 * k for k in range(max(n, 1))])
        self.param_ptrs = ctypes.addressof(self.param_array)
        self.pointers = pointers  # [(buffer index, byte offset)]


class _Plan:
    __slots__ = ("scratch", "offsets", "commands", "shapes")

    def __init__(self, transients, commands, shapes) -> None:
        # all transient buffers of a call in one torch allocation, each at a 256-byte aligned offset
        self.offsets = []
        total = 0
        for n in transients:
            self.offsets.append(total)
            total += -(-n // 256) * 256
        self.scratch = total
        self.commands = commands
        self.shapes = shapes     # per argument: (shape, element bytes), or None


class DirectModule:
    """`run(inputs, outputs)` like `CompiledModule.run`, launching the kernels on torch's stream."""

    on_torch_stream = True   # its work can be captured in a CUDA graph (exec/graphs.py)

    def __init__(self, vmfb: bytes, blob: bytes, schedule: Schedule, session, name: str) -> None:
        self.name = name
        self.device = session.device
        self.vmfb = blob                   # what the compile caches keep
        self.staged_outputs = False
        self.schedule = schedule
        self._index = session.device.index
        self._plans: dict = {}
        self._written = frozenset(schedule.written)   # arguments the module writes (inputs get copied)
        executable = read_executables(vmfb)
        used = check_kernels(executable, schedule)
        cuda = driver()
        self._driver = cuda
        self._context = cuda.primary_context(self._index)
        self._kernels = {}
        for module_index, ptx in enumerate(executable.ptx):
            wanted = [(k.name, k.shared_memory) for k in executable.kernels.values()
                      if k.module == module_index and k.name in used]
            if wanted:
                for kname, handle in cuda.load(self._context, ptx, wanted).items():
                    self._kernels[kname] = (handle, executable.kernels[kname])

    def __repr__(self) -> str:
        return "DirectModule(%s, device=%s, %d kernels)" % (self.name, self.device, len(self._kernels))

    # -- per shape --------------------------------------------------------------------------------------

    def _plan(self, key: tuple, buffers: list) -> _Plan:
        schedule = self.schedule
        values = schedule.evaluate(key)
        arguments = schedule.arguments
        # every range a command touches must lie inside its buffer (a launch out of bounds would corrupt
        # memory or kill the CUDA context): checked once per shape, against the shapes IREE's host code
        # asserts for its arguments, which each call then checks
        transients = [values[v] for v in schedule.transients]
        shapes = [None if spec is None else (tuple(values[v] for v in spec[1]), spec[0])
                  for spec in schedule.shapes]

        def size_of(buffer) -> int:
            kind, index = buffer
            if kind == "transient":
                return transients[index]
            if shapes[index] is not None:
                shape, element = shapes[index]
                return math.prod(shape) * element
            t = buffers[index]
            return t.numel() * t.element_size()

        def index_of(buffer) -> int:
            return buffer[1] if buffer[0] == "arg" else arguments + buffer[1]

        def check(buffer, offset: int, length: int, what: str) -> None:
            if offset + length > size_of(buffer):
                raise LaunchUnsupported("%s: %s reaches byte %d of a %d-byte buffer (%s)" % (
                    self.name, what, offset + length, size_of(buffer), buffer))

        commands = []
        for c in schedule.commands:
            if c[0] == "dispatch":
                handle, kernel = self._kernels[c[1]]
                grid = tuple(values[v] for v in c[2])
                if 0 in grid:
                    continue
                pointers = []
                for buffer, offset, length in c[4]:
                    check(buffer, values[offset], values[length], "kernel " + c[1])
                    pointers.append((index_of(buffer), values[offset]))
                launch = _Launch(handle, grid, kernel.block, kernel.shared_memory, pointers,
                                 [values[v] for v in c[3]])
                commands.append(("k", launch))
            elif c[0] == "copy":
                _, src, src_off, dst, dst_off, length = c
                n = values[length]
                if n:
                    check(src, values[src_off], n, "copy")
                    check(dst, values[dst_off], n, "copy")
                    commands.append(("c", index_of(src), values[src_off], index_of(dst), values[dst_off], n))
            else:  # fill
                _, buffer, offset, length, value, width = c
                n = values[length]
                if n:
                    check(buffer, values[offset], n, "fill")
                    if n % width or values[offset] % width:
                        raise LaunchUnsupported("%s: fill of %d bytes with a %d-byte pattern" % (self.name, n, width))
                    commands.append(("f", index_of(buffer), values[offset], n // width, values[value], width))
        return _Plan(transients, commands, shapes)

    # -- per call ---------------------------------------------------------------------------------------

    def run(self, inputs: Sequence, outputs: Sequence[torch.Tensor], fresh: bool = False,
            views: Sequence | None = None) -> None:
        """As `CompiledModule.run`: `fresh`, the outputs are dense and share no input's memory. (`views`, the
        CPU's imports of outputs made once, `CompiledModule.import_output`: none here.)"""
        buffers = [*inputs, *outputs]
        if len(buffers) != self.schedule.arguments:
            raise ExecutionError("@main of %s takes %d arguments (inputs and outputs), got %d inputs and %d "
                                 "outputs: check that they match the function's signature" % (
                                     self.name, self.schedule.arguments, len(inputs), len(outputs)),
                                 function=self.name + ".main")
        reads = self.schedule.reads
        key = tuple(buffers[p] if d < 0 else buffers[p].shape[d] for p, d in reads) if reads else ()
        out_ptrs = {o.untyped_storage().data_ptr() for o in outputs if o.numel()} if not fresh else ()
        pointers = []
        written = self._written
        for t in inputs:
            if type(t) is int:
                pointers.append(0)
                continue
            if not (t.is_cuda and t.is_contiguous() and (ptr := t.data_ptr()) % ALIGNMENT == 0) or (
                t.numel() and t.untyped_storage().data_ptr() in out_ptrs
            ) or len(pointers) in written:
                # kernels need dense, aligned memory (a misaligned address is a sticky CUDA fault), an
                # input must not share memory with an output, and an input IREE writes in place (a
                # scatter's operand tied to its result) is the module's own copy. A host tensor (a 0-d
                # CPU tensor, which torch's CUDA ops read as a scalar: `ids[:, 0] = start_id` in T5's and
                # BART's shift-right makes one) goes to the device: its address means nothing to a kernel
                t = dense_copy(t) if t.is_cuda else t.to(self.device, memory_format=torch.contiguous_format)
                ptr = t.data_ptr()
                buffers[len(pointers)] = t
            pointers.append(ptr)
        copy_back = []
        for k, o in enumerate(outputs):
            if not (o.is_contiguous() and o.data_ptr() % ALIGNMENT == 0):
                dense = dense_copy(o)
                copy_back.append((o, dense))
                buffers[len(inputs) + k] = dense
                o = dense
            pointers.append(o.data_ptr())
        plan = self._plans.get(key)
        if plan is None:
            try:
                plan = self._plans[key] = self._plan(key, buffers)
            except LaunchUnsupported as e:
                raise ExecutionError("the direct launcher cannot run %s at these sizes (%s); "
                                     "PYDISC_GPU_EXECUTOR=iree runs it through IREE's runtime" % (self.name, e),
                                     function=self.name + ".main") from e
        for t, spec in zip(buffers, plan.shapes):
            if spec is not None and (t.shape != spec[0] or t.element_size() != spec[1]):
                raise ExecutionError("@main of %s takes a tensor of shape %s with %d-byte elements, got %s with "
                                     "%d-byte elements: check that inputs and outputs match the function's "
                                     "signature (count, shapes, dtypes)" % (
                                         self.name, spec[0], spec[1], tuple(t.shape), t.element_size()),
                                     function=self.name + ".main")
        scratch = None
        if plan.offsets:
            # freed when run returns: torch's caching allocator reuses it only for work queued later on
            # this stream, after these kernels
            scratch = _empty(max(plan.scratch, 1), dtype=_u8, device=self.device)
            base = scratch.data_ptr()
            pointers.extend(base + offset for offset in plan.offsets)
        cuda = self._driver
        stream = _raw_stream(self._index)
        current = cuda.current_context()
        if current != self._context:
            cuda.check(cuda.ctx_set_current(self._context), "cuCtxSetCurrent")
        try:
            self._launch(cuda, plan, pointers, stream)
        except CudaError as e:
            raise ExecutionError("%s: %s" % (self.name, e), function=self.name) from e
        finally:
            if current != self._context and current is not None:
                cuda.ctx_set_current(current)
        for target, dense in copy_back:
            target.copy_(dense)
        METRICS.executions += 1
        METRICS.direct_launches += len(plan.commands)

    @staticmethod
    def _launch(cuda, plan: _Plan, pointers: list, stream: int) -> None:
        launch_kernel = cuda.launch_kernel
        for command in plan.commands:
            kind = command[0]
            if kind == "k":
                launch = command[1]
                params = launch.params
                for slot, (buffer, offset) in enumerate(launch.pointers):
                    params[slot] = pointers[buffer] + offset
                gx, gy, gz = launch.grid
                bx, by, bz = launch.block
                code = launch_kernel(launch.function, gx, gy, gz, bx, by, bz, launch.shared, stream,
                                     launch.param_ptrs, None)
                if code:
                    cuda.check(code, "cuLaunchKernel")
            elif kind == "c":
                _, src, src_off, dst, dst_off, n = command
                cuda.check(cuda.memcpy(pointers[dst] + dst_off, pointers[src] + src_off, n, stream),
                           "cuMemcpyDtoDAsync")
            else:
                _, buffer, offset, count, value, width = command
                cuda.check(cuda.memset[width](pointers[buffer] + offset, value, count, stream), "cuMemsetAsync")
