"""A compiled module bound to one device: VM context and function built once, called many times.

`run` is the hot path of every step, so it does only what each call needs: import each tensor
(zero-copy), one `invoke`, and a counter. Anything unusual (a non-dense tensor, an output that aliases
an input, a module whose results must be staged) takes a slower branch without slowing the common one.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import iree.runtime as ireert
import torch
from torch.utils.dlpack import to_dlpack

from ..metrics import METRICS
from .errors import CompileError, DeviceOutOfMemoryError, ExecutionError, is_out_of_memory
from .session import DeviceSession, cuda_context, vm_instance
from .tensors import ALIGNMENT, StagedOutput, dense_copy, is_dense

__all__ = ["CompiledModule", "PreparedCall", "collecting_calls", "running_calls"]

_ENTRY = "main"
# torch's raw current-device calls (~0.2 us; torch.cuda.current_device adds a Python wrapper). Absent in
# CPU-only builds, where no module has a CUDA index and they are never called.
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)


class CompiledModule:
    """A `.vmfb` loaded for one device. `run(inputs, outputs)` calls its `main` function."""

    __slots__ = (
        "name", "device", "vmfb", "staged_outputs",
        "_session", "_context", "_function", "_import", "_import_output", "_cuda_index", "_on_cuda", "_imported",
        "_import_input",
    )

    def __init__(self, vmfb: bytes, session: DeviceSession, name: str) -> None:
        instance = vm_instance()
        vm_module = ireert.VmModule.copy_buffer(instance, vmfb)
        function = vm_module.lookup_function(_ENTRY)
        if function is None:
            raise CompileError(
                f"module {name} has no public function @{_ENTRY} (it has {vm_module.function_names}); "
                f"emit the cluster as `func.func @{_ENTRY}`"
            )
        self.name = name
        self.device = session.device
        self.vmfb = vmfb
        self._session = session
        self._cuda_index = session.device.index if session.is_cuda else None
        self._on_cuda = session.is_cuda
        with cuda_context(session.device):  # executables are loaded into the current CUDA context
            self._context = ireert.VmContext(instance, modules=[session.hal_module, vm_module])
        self._function = function
        self._import = session.hal_device.from_dlpack_capsule
        self._import_output = _HostImport(session) if not session.is_cuda else None   # see staged_outputs
        # On the CPU, per input position, the imports of the last memories it was given: {address: (shape,
        # dtype, import)}, at most two (a parameter's memory alternates between two blocks from step to step:
        # driver/bind.py `handovers`). They are host imports, which hold no tensor: one made for memory at an
        # address, with its shape and dtype, is the import of whatever tensor of that shape and dtype is
        # there at a later call. (The transformer block of bench/record_overhead.py: its step's call, 31 inputs
        # and 44 outputs, prepared in 36 us rather than 43.)
        self._imported: list[dict] = []
        self._import_input = _HostImport(session) if not session.is_cuda else None
        # Set on the first call that finds IREE cannot write a DLPack-imported output: it fills or copies
        # into some outputs (a result that is an input, a constant, or a copy IREE makes rather than a
        # dispatch), which needs DISCARD_WRITE access. From then on the outputs are imported as host
        # allocations on the CPU (zero-copy, ~2 us more per output than DLPack) and go through
        # IREE-allocated buffers, copied back, elsewhere.
        self.staged_outputs = False

    def __repr__(self) -> str:
        return f"CompiledModule({self.name}, device={self.device}, staged_outputs={self.staged_outputs})"

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], fresh: bool = False,
            views: Sequence | None = None) -> None:
        """Run `main(*inputs, *outputs)`; IREE writes result N into outputs[N]. Inputs are never written.
        `fresh`: the outputs are dense tensors no input shares memory with (the caller allocated them, or
        kept them from its last call and nothing else holds them), which needs no checking. `views`: per
        output, its memory as `import_output` gave it at an earlier call (the same memory), or None."""
        cuda_index = self._cuda_index
        if cuda_index is not None:
            # IREE's CUDA driver switches the thread's current context (to the last device it used) and
            # launches in whatever context is current: select ours, and give torch back its device after.
            previous = _get_device()
            if previous != cuda_index:
                _set_device(cuda_index)
        try:
            if cuda_index is not None:
                # IREE runs on its own stream and cannot wait on torch's: finish torch's pending writes
                # (inputs) and reads (the memory handed out as outputs) first.
                torch.cuda.current_stream(cuda_index).synchronize()
            try:
                self._invoke(inputs, outputs, fresh, views)
            except Exception as e:
                if self.staged_outputs or "DISCARD_WRITE" not in str(e):
                    raise
                self.staged_outputs = True
                self._invoke(inputs, outputs, fresh, None)  # safe to repeat: inputs are read-only, outputs overwritten
        except Exception as e:  # IREE raises RuntimeError or ValueError; torch may raise too
            raise self._execution_error(e, inputs, outputs) from e
        finally:
            if cuda_index is not None and _get_device() != previous:
                _set_device(previous)
        METRICS.executions += 1

    def import_output(self, t: torch.Tensor):
        """`t`'s memory as this module's calls take an output (`run`'s `views`), where a dense CPU tensor
        can be handed over as it is; None where each call must stage it (`staged_outputs`)."""
        if self.staged_outputs or self._on_cuda or not is_dense(t):
            return None
        return self._import(to_dlpack(t))

    def _invoke(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], fresh: bool,
                views: Sequence | None = None) -> None:
        call = self._prepare(inputs, outputs, fresh, views)
        if _COLLECTING.calls is not None:
            _COLLECTING.calls.append(call)
            return
        call.invoke()

    def _prepare(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 fresh: bool = False, views: Sequence | None = None) -> PreparedCall:
        imp = self._import
        held: list = []     # what the imported buffers point into, alive until the call has run
        args = ireert.VmVariantList(len(inputs) + len(outputs))
        out_ptrs = {o.untyped_storage().data_ptr() for o in outputs if o.numel()} if not fresh else ()
        on_cuda = self._on_cuda
        copied = False
        imported, host = self._imported, self._import_input
        if len(imported) < len(inputs):
            imported += [{} for _ in range(len(inputs) - len(imported))]
        for i, t in enumerate(inputs):
            if type(t) is int:          # an `index` argument (a dynamic size)
                args.push_int(t)
                continue
            if t.is_cuda is not on_cuda:
                # a host tensor in a CUDA module (a 0-d CPU tensor, which torch's CUDA ops read as a
                # scalar): imported as is, IREE's kernels would dereference a host address
                t = t.to(self.device)
                copied = True
                held.append(t)
            # is_dense inlined (hot path); for a dense input data_ptr is its storage's base pointer.
            if not (t.is_contiguous() and t.storage_offset() == 0 and (ptr := t.data_ptr()) % ALIGNMENT == 0) or (
                ptr in out_ptrs and t.numel()
            ):
                t = dense_copy(t)  # IREE needs dense memory, and an input must not share an output's memory
                copied = True
                held.append(t)
            elif host is not None and t.numel():
                seen = imported[i]
                found = seen.get(ptr)
                if found is None or found[0] != t.shape or found[1] is not t.dtype:
                    if len(seen) > 1:
                        seen.clear()
                    found = seen[ptr] = (t.shape, t.dtype, host(t))
                args.push_ref(found[2])
                continue
            args.push_ref(imp(to_dlpack(t)))
        copy_back: list = []
        staged = self.staged_outputs
        if views is not None and not staged:     # (fresh outputs, some imported before)
            for o, view in zip(outputs, views):
                args.push_ref(view if view is not None else imp(to_dlpack(o)))
        else:
            for o in outputs:
                if not fresh and not is_dense(o):
                    dense = dense_copy(o)
                    copy_back.append(_DenseOutput(o, dense))
                    o = dense
                    held.append(o)
                if staged and o.numel():
                    if self._import_output is not None:
                        args.push_ref(self._import_output(o))
                        continue
                    view = StagedOutput(self._session, o)
                    args.push_ref(view.view)
                    copy_back.append(view)
                    continue
                args.push_ref(imp(to_dlpack(o)))
        if copied and self._cuda_index is not None:
            # the copies above are queued on torch's stream, which IREE's own stream does not wait for
            # (`run` synchronised before they were made): without this IREE can read them unfinished
            torch.cuda.current_stream(self._cuda_index).synchronize()
        return PreparedCall(self, args, len(outputs), copy_back, (inputs, outputs, held))

    def _execution_error(
        self, error: Exception, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> ExecutionError | DeviceOutOfMemoryError:
        detail = str(error).strip().splitlines()
        detail_text = "\n".join(detail[:12])
        if is_out_of_memory(error):
            # not a fault of the module: the caller must not give up on it (nor run it eagerly instead)
            return DeviceOutOfMemoryError(f"out of memory on {self.device} in {self.name}: {detail_text}",
                                          where=self.name)
        wrong = [
            f"{kind}[{i}] on {t.device}"
            for kind, ts in (("inputs", inputs), ("outputs", outputs))
            for i, t in enumerate(ts)
            if t.device != self.device
        ]
        hint = (
            f"tensors on the wrong device ({', '.join(wrong)}): move them to {self.device}"
            if wrong
            else "check that inputs and outputs match the function's signature (count, shapes, dtypes), "
            "or run this cluster eagerly"
        )
        return ExecutionError(
            f"IREE failed running @{_ENTRY} of {self.name} on {self.device} with {len(inputs)} inputs and "
            f"{len(outputs)} outputs: {hint}.\nIREE said: {detail_text}",
            function=f"{self.name}.{_ENTRY}",
        )


class PreparedCall:
    """One call of a module with its arguments imported, ready to invoke (`invoke`), on any thread: IREE's
    invoke runs without the GIL. Holds the tensors the arguments point into until then."""

    __slots__ = ("module", "args", "n_outputs", "copy_back", "held")

    def __init__(self, module: CompiledModule, args, n_outputs: int, copy_back: list, held: tuple) -> None:
        self.module = module
        self.args = args
        self.n_outputs = n_outputs
        self.copy_back = copy_back
        self.held = held

    def invoke(self) -> None:
        m = self.module
        m._context.invoke(m._function, self.args, ireert.VmVariantList(self.n_outputs))
        for c in self.copy_back:
            c.copy_back()

    def run(self) -> None:
        """`invoke`, with the errors `CompiledModule.run` gives (for a call prepared while collecting);
        then lets go of its arguments, so that a buffer only later calls read is freed after the last."""
        try:
            self.invoke()
        except Exception as e:
            raise self.module._execution_error(e, *self.held[:2]) from e
        finally:
            self.args = self.held = self.copy_back = None


class _Collecting(threading.local):
    calls: list | None = None


_COLLECTING = _Collecting()     # per thread: a background thread's modules run as usual


@contextmanager
def collecting_calls(calls: list) -> Iterator[list]:
    """Within it, on this thread, `CompiledModule.run` prepares its call (imports, outputs) and appends it
    to `calls` rather than invoking it; whoever collected runs them later, in order (`PreparedCall.run`):
    a step run on a worker thread (driver/inflight.py). For CPU modules whose callers read no results
    before then."""
    _COLLECTING.calls = calls
    try:
        yield calls
    finally:
        _COLLECTING.calls = None


class _HostImport:
    """Zero-copy import of a dense CPU tensor as an IREE host allocation, with the element type a
    DLPack import gives its dtype. The memory is handed over as a ctypes array (any dtype, 0.7 us; a
    numpy view costs 2-4 us and has no bfloat16), which does not keep the tensor alive: the caller
    holds it for the duration of the call."""

    __slots__ = ("_allocator", "_session", "_types", "_memory", "_usage")

    def __init__(self, session: DeviceSession) -> None:
        self._allocator = session.hal_device.allocator
        self._session = session
        self._types: dict = {}
        self._memory = ireert.MemoryType.HOST_LOCAL | ireert.MemoryType.DEVICE_VISIBLE
        self._usage = ireert.BufferUsage.DEFAULT

    def __call__(self, t: torch.Tensor) -> ireert.HalBufferView:
        element_type = self._types.get(t.dtype)
        if element_type is None:
            element_type = self._types[t.dtype] = self._session.hal_device.from_dlpack_capsule(
                to_dlpack(t)).element_type
        data = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
        buffer = self._allocator.import_host_allocation(data, self._memory, self._usage)
        return ireert.HalBufferView(buffer, list(t.shape), element_type)


class _DenseOutput:
    """A dense stand-in for a non-dense output tensor; copied into the real output after the call."""

    __slots__ = ("target", "dense")

    def __init__(self, target: torch.Tensor, dense: torch.Tensor) -> None:
        self.target = target
        self.dense = dense

    def copy_back(self) -> None:
        self.target.copy_(self.dense)


@contextmanager
def running_calls() -> Iterator[None]:
    """Within `collecting_calls`, the calls made here run at once: a cluster whose results torch reads while
    the plan's graph runs (the tensors dropout draws its masks into)."""
    calls = _COLLECTING.calls
    _COLLECTING.calls = None
    try:
        yield
    finally:
        _COLLECTING.calls = calls
