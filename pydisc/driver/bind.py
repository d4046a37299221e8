"""Binding the results of a run: written inputs are written in place and every live lazy tensor of
the run gets a view of its new device data (`bind`); the tensors of a symbolic step get concrete sizes
(`concretize`). User tensors are written only here, after all results exist.
"""
from __future__ import annotations

import torch

from ..diagnostics import log
from ..frontend.layout import flat_base, view_of_base
from ..frontend.lazy_tensor import RECORDER, LazyTensor
from ..frontend.tensor import concrete_layout
from ..frontend.trace import LazyStorage, Trace
from .slices import size_only_storages

__all__ = ["bind", "concretize", "input_versions", "own_writes"]


def _as_layout(val: torch.Tensor, size, stride) -> torch.Tensor:
    """`val` with exactly the recorded strides, so views of its storage land where eager's would."""
    if tuple(val.shape) == tuple(size) and val.storage_offset() == 0 and \
            (tuple(val.stride()) == tuple(stride) or val.numel() <= 1):
        return val
    out = torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)
    if val.numel() == 0 and out.numel() != 0:
        # A CPU kernel that returns an empty tensor where its meta kernel promises data (the saved
        # statistics of _native_batch_norm_legit_no_training): values eager never defines.
        return out.zero_()
    out.copy_(val.reshape(size))
    return out


def bind(trace: Trace, outputs: tuple, results: list[torch.Tensor], executed: list[int],
          remaining: list[int], fresh_trace: bool = True) -> None:
    """`fresh_trace`: the recorder starts a new trace after a whole step is bound; False where it started
    one already, the step having run on the worker while the next recorded (inflight.py)."""
    touched: list[LazyStorage] = []
    for (kind, index), val in zip(outputs, results):
        if kind == "base":
            storage = trace.input_storages[index]
            real = storage.real
            if val.data_ptr() != real.data_ptr():
                real.copy_(val if val.shape == real.shape else val.reshape(real.shape))
            trace.storage_versions[index] = real._version   # our own write, not the user's
        else:
            storage = trace.storages[index]
            size, stride, offset, dtype = trace.metas[index]
            storage.real = flat_base(_as_layout(val, size, stride))
        touched.append(storage)
    if not remaining:
        # everything ran: every tensor made in this trace views its storage's new data (the storages
        # of the step's inputs were written in place, so their tensors' views stay valid)
        values = trace.values
        symbolic = []
        for vid, ref in trace.tensors.items():
            t = ref()
            if t is None:
                continue
            if (values[vid][0] == "out" or t._real is None) and t._storage.real is not None:
                t._real = view_of_base(t._storage.real, *concrete_layout(t))
            if t._concrete is not None and trace.symbolic is not None and t._real is not None:
                symbolic.append(t)
        trace.release()
        if fresh_trace:
            RECORDER.new_trace()
        if symbolic:
            concretize(symbolic)
        return
    executed_vids = set()
    for i in executed:
        executed_vids.update(v for v in trace.entries[i].out_vids if v is not None)
    for vid, ref in list(trace.tensors.items()):
        t = ref()
        if t is None:
            del trace.tensors[vid]
            continue
        if vid in executed_vids or t._real is None:
            if t._storage.real is not None:
                t._real = view_of_base(t._storage.real, *concrete_layout(t))
    # Keep the rest pending: values made by the executed entries become inputs of what remains.
    size_only = size_only_storages(trace, executed) if trace.symbolic is not None else set()
    for vid in executed_vids:
        storage = trace.storages[vid]
        if storage.real is None:
            continue
        if storage.input_index < 0:
            storage.input_index = len(trace.storage_inputs)
            trace.storage_inputs.append(storage.real)
            trace.input_storages.append(storage)
            trace.storage_versions.append(storage.real._version)
        trace.values[vid] = ("in", storage.input_index, trace.metas[vid][:3])
        if id(storage) in size_only:
            trace.size_only_inputs.add(storage.input_index)
        storage.creator = None
    for s in touched:
        s.written = False
    trace.entries = [trace.entries[i] for i in remaining]
    trace.partly_run = True
    for e in trace.entries:
        for s in e.writes:
            s.written = True


def input_versions(trace: Trace) -> tuple[list[int], list[int]]:
    """The versions of `trace`'s inputs now, for `own_writes`."""
    return [t._version for t in trace.storage_inputs], [t._version for t in trace.real_inputs]


def own_writes(trace: Trace, before: tuple[list[int], list[int]]) -> None:
    """`trace` (the next step, recorded while the one before ran on the worker thread: inflight.py) noted
    the versions of the tensors it reads; pydisc's own writes since `before` (binding that step, or its
    ops run by torch) are not the user's, and move those notes along."""
    for tensors, noted, seen_before in ((trace.storage_inputs, trace.storage_versions, before[0]),
                                        (trace.real_inputs, trace.real_versions, before[1])):
        for i, (t, seen) in enumerate(zip(tensors, seen_before)):
            if t._version != seen and noted[i] == seen:
                noted[i] = t._version


def concretize(tensors: list[LazyTensor]) -> None:
    """Tensors a symbolic step made hold sizes of its ShapeEnv (`s41 + 1`), which later steps' Python
    code would compute with (HF Llama's positions: `torch.arange(1) + cache.get_seq_length()` gave
    garbage from such a size): each becomes, in place (`torch.utils.swap_tensors`), the same tensor
    with this step's sizes. One that autograd knows (it requires grad or has one: swapping would drop
    its gradient) or that is still referenced from C++ (an argument of the op under way) keeps its
    symbolic sizes."""
    for t in tensors:
        if all(type(x) is int for x in t.shape) or t.requires_grad or t.grad is not None:
            continue
        size, stride, offset = t._concrete
        twin = LazyTensor(size, stride, offset, t.dtype, t.device, t._storage, real=t._real,
                          requires_grad=t.requires_grad)
        try:
            torch.utils.swap_tensors(t, twin)
        except RuntimeError:
            log("recompiles", "a tensor of shape %s keeps its symbolic sizes (referenced from C++)", size)
