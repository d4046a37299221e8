"""A compiled module bound to one device: VM context and function built once, called many times.

`run` is the hot path of every step, so it does only what each call needs: import each tensor
(zero-copy), one `invoke`, and a counter. Anything unusual (a non-dense tensor, an output that aliases
an input, a module whose results must be staged) takes a slower branch without slowing the common one.
"""
from __future__ import annotations

from collections.abc import Sequence

import iree.runtime as ireert
import torch
from torch.utils.dlpack import to_dlpack

from ..metrics import METRICS
from .errors import CompileError, DeviceOutOfMemoryError, ExecutionError, is_out_of_memory
from .session import DeviceSession, cuda_context, vm_instance
from .tensors import ALIGNMENT, StagedOutput, dense_copy, is_dense

__all__ = ["CompiledModule"]

_ENTRY = "main"
# torch's raw current-device calls (~0.2 us; torch.cuda.current_device adds a Python wrapper). Absent in
# CPU-only builds, where no module has a CUDA index and they are never called.
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)


class CompiledModule:
    """A `.vmfb` loaded for one device. `run(inputs, outputs)` calls its `main` function."""

    __slots__ = (
        "name", "device", "vmfb", "staged",
        "_session", "_context", "_function", "_import", "_cuda_index",
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
        with cuda_context(session.device):  # executables are loaded into the current CUDA context
            self._context = ireert.VmContext(instance, modules=[session.hal_module, vm_module])
        self._function = function
        self._import = session.hal_device.from_dlpack_capsule
        # The outputs IREE cannot write in place when imported (a result that is an input, a constant,
        # or a copy IREE makes rather than a dispatch): they go through IREE-allocated buffers and are
        # copied back. Found on the first call that fails for that reason (`_find_staged`).
        self.staged: frozenset = frozenset()

    def __repr__(self) -> str:
        return f"CompiledModule({self.name}, device={self.device}, staged={sorted(self.staged)})"

    @property
    def staged_outputs(self) -> bool:
        """True when some outputs go through IREE-allocated buffers."""
        return bool(self.staged)

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Run `main(*inputs, *outputs)`; IREE writes result N into outputs[N]. Inputs are never written."""
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
                self._invoke(inputs, outputs, self.staged)
            except Exception as e:
                if self.staged or not _needs_staging(e):
                    raise
                self.staged = self._find_staged(inputs, outputs)
        except Exception as e:  # IREE raises RuntimeError or ValueError; torch may raise too
            raise self._execution_error(e, inputs, outputs) from e
        finally:
            if cuda_index is not None and _get_device() != previous:
                _set_device(previous)
        METRICS.executions += 1

    def _find_staged(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> frozenset:
        """The outputs that must be staged, by group testing: a call with a group of outputs imported
        and all others staged tells whether the whole group can be written in place. A few calls on
        first use (about staged x log2(outputs)); each is safe to repeat (inputs are read-only, outputs
        are overwritten), and the last one, with the answer, leaves the right values in the outputs."""
        every = frozenset(range(len(outputs)))
        need: set = set()

        def search(group: list) -> None:
            try:
                self._invoke(inputs, outputs, every - frozenset(group))
                return
            except Exception as e:
                if not _needs_staging(e):
                    raise
            if len(group) == 1:
                need.add(group[0])
                return
            half = len(group) // 2
            search(group[:half])
            search(group[half:])

        search(sorted(every))
        staged = frozenset(need)
        self._invoke(inputs, outputs, staged)
        return staged

    def _invoke(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], staged: frozenset) -> None:
        imp = self._import
        args = ireert.VmVariantList(len(inputs) + len(outputs))
        out_ptrs = {o.untyped_storage().data_ptr() for o in outputs if o.numel()}
        for t in inputs:
            if type(t) is int:          # an `index` argument (a dynamic size)
                args.push_int(t)
                continue
            # is_dense inlined (hot path); for a dense input data_ptr is its storage's base pointer.
            if not (t.is_contiguous() and t.storage_offset() == 0 and (ptr := t.data_ptr()) % ALIGNMENT == 0) or (
                ptr in out_ptrs and t.numel()
            ):
                t = dense_copy(t)  # IREE needs dense memory, and an input must not share an output's memory
            args.push_ref(imp(to_dlpack(t)))
        copy_back: list = []
        for i, o in enumerate(outputs):
            if staged and i in staged:
                view = StagedOutput(self._session, o)
                args.push_ref(view.view)
                copy_back.append(view)
                continue
            if not is_dense(o):
                dense = dense_copy(o)
                copy_back.append(_DenseOutput(o, dense))
                o = dense
            args.push_ref(imp(to_dlpack(o)))
        self._context.invoke(self._function, args, ireert.VmVariantList(len(outputs)))
        for c in copy_back:
            c.copy_back()

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


def _needs_staging(error: Exception) -> bool:
    """IREE refused an imported output: it writes that result by a fill or copy (DISCARD_WRITE)."""
    return "DISCARD_WRITE" in str(error)


class _DenseOutput:
    """A dense stand-in for a non-dense output tensor; copied into the real output after the call."""

    __slots__ = ("target", "dense")

    def __init__(self, target: torch.Tensor, dense: torch.Tensor) -> None:
        self.target = target
        self.dense = dense

    def copy_back(self) -> None:
        self.target.copy_(self.dense)

