"""Binding the results of a run: written inputs are written in place and every live lazy tensor of
the run gets a view of its new device data (`bind`); the tensors of a symbolic step get concrete sizes
(`concretize`). User tensors are written only here, after all results exist.
"""
from __future__ import annotations

import weakref
from collections import Counter
from operator import is_

import torch
from torch.autograd.graph import increment_version

from ..diagnostics import log
from ..exec.tensors import ALIGNMENT
from ..frontend.layout import flat_base, is_whole, view_of_base
from ..frontend.lazy_tensor import RECORDER, LazyTensor
from ..frontend.tensor import concrete_layout
from ..frontend.trace import LazyStorage, Trace
from .slices import size_only_storages

__all__ = ["bind", "concretize", "handovers", "input_versions", "own_writes", "worker_copies"]

# Exchanges the memory of two torch storages of the same size, with every tensor that views either
# (torch's `UntypedStorage._swap_data_ptr_`; None where this torch has none: the new values are copied).
_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)


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
          remaining: list[int], fresh_trace: bool = True, copied: bool = False, plan=None,
          swaps: tuple | None = None) -> None:
    """`fresh_trace`: the recorder starts a new trace after a whole step is bound; False where it started
    one already, the step having run on the worker while the next recorded (inflight.py). `copied`: the
    worker copied the written inputs' new values already (`worker_copies`), except those of `swaps`.
    `plan`: the plan whose run gave `results`, whose kept outputs (`plan.flat_outputs`) become the
    memory of the inputs they are new values of where they can (`handovers`); `swaps`: which, worked out
    before the run (a run on the worker)."""
    touched: list[LazyStorage] = []     # (where some entries remain)
    written: list[int] = []             # input storages the step wrote: copied into, all at once
    vals: list[torch.Tensor] = []       # ... and their new values
    # storage -> the result that is all of its data in the recorded layout: a tensor of that layout
    # binds to it as is, rather than to a new view
    whole: dict[int, torch.Tensor] = {}
    # Where all ran, a result is given to its storage only when a live tensor of the step views it (below):
    # most of a training step's (the gradients, once `zero_grad` dropped them; a loss nobody kept) are dead
    # by the time a step run on the worker is bound. id(storage) -> (storage, value index, result).
    later: dict[int, tuple] = {}
    storages = trace.storages
    for (kind, index), val in zip(outputs, results):
        if kind == "base":
            written.append(index)
            vals.append(val)
            if remaining:
                touched.append(trace.input_storages[index])
        else:
            storage = storages[index]
            if remaining:
                _give_result(storage, trace.metas[index], val, whole)
                touched.append(storage)
            else:
                later[id(storage)] = (storage, index, val)
    if written:
        if swaps is None:
            swaps = handovers(trace, written, vals, plan)
        _write_inputs(trace, written, vals, copied, swaps)
    if not remaining:
        # everything ran: every tensor made in this trace views its storage's new data (the storages
        # of the step's inputs were written in place, so their tensors' views stay valid)
        values = trace.values
        metas = trace.metas
        symbolic = []
        for vid, ref in trace.tensors.items():
            t = ref()
            if t is None:
                continue
            if values[vid][0] == "out" or t._real is None:
                storage = t._storage
                found = later.pop(id(storage), None) if later else None
                if found is not None:
                    _give_result(storage, metas[found[1]], found[2], whole)
                if storage.real is not None:
                    t._real = _bound(t, whole)
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
                t._real = _bound(t, whole)
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


def _give_result(storage: LazyStorage, meta: tuple, val: torch.Tensor, whole: dict) -> None:
    """`storage` holds `val` (a result of the run, of the recorded (size, stride, offset, dtype) `meta`) as
    its flat device data from now on; noted in `whole` where `val` is all of it in the recorded layout."""
    size, stride = meta[0], meta[1]
    if val.is_contiguous() and val.storage_offset() == 0 and val.stride() == stride and \
            val.shape == size and val.untyped_storage().nbytes() == val.numel() * val.element_size():
        # (the common case, `_as_layout` and `is_whole` inlined: a result of the recorded layout that is
        # all of its storage)
        storage.real = val.detach().view(-1)
        whole[id(storage)] = val
        return
    laid = _as_layout(val, size, stride)
    if is_whole(laid):
        storage.real = laid.detach().view(-1)     # (flat_base, known whole)
        if laid is val:
            whole[id(storage)] = val
    else:
        storage.real = flat_base(laid)


def _bound(t: LazyTensor, whole: dict) -> torch.Tensor:
    """The device data of lazy tensor `t`: a view of its storage's new data in `t`'s layout."""
    size, stride, offset = concrete_layout(t)
    val = whole.get(id(t._storage))
    if val is not None and offset == 0 and val.shape == size and val.stride() == tuple(stride):
        return val
    return view_of_base(t._storage.real, size, stride, offset)


def _write_inputs(trace: Trace, indices: list[int], vals: list[torch.Tensor], copied: bool = False,
                  swaps: tuple = ()) -> None:
    """Write the step's new values of the input storages `indices` into their device data: copied (one
    foreach copy), or, where `swaps[k]`, handed over (the memory of `vals[k]` becomes the storage's, and
    the storage's old memory `vals[k]`'s: `handovers`). Their versions are noted as the step's own
    writes, not the user's. A value that is another written input's data (a step that swaps two buffers,
    run by torch) is read before any is written. `copied`: the worker copied those not handed over
    (`worker_copies`), leaving the version counters alone; they move here, as the copy would have moved
    them (eager code holding the data sees a write)."""
    reals = [trace.input_storages[i].real for i in indices]
    if copied or (swaps and all(swaps)):
        increment_version(reals)
    else:
        written = {r.untyped_storage().data_ptr() for r in reals}
        dsts, srcs = [], []
        for k, (real, val) in enumerate(zip(reals, vals)):
            if swaps and swaps[k]:
                continue
            if val.data_ptr() == real.data_ptr():
                continue                    # written in place already
            if val.untyped_storage().data_ptr() in written:
                val = val.clone()
            dsts.append(real)
            srcs.append(val if val.dim() == 1 else val.reshape(-1))     # (an input storage's data is flat)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if swaps:
            increment_version([real for real, swap in zip(reals, swaps) if swap])
    if swaps:
        # (after the copies, which may read an input's old data)
        for real, val, swap in zip(reals, vals, swaps):
            if swap:
                _SWAP(real.untyped_storage(), val.untyped_storage())
    for i, real in zip(indices, reals):
        trace.storage_versions[i] = real._version


def handovers(trace: Trace, indices: list[int], vals: list[torch.Tensor], plan) -> tuple:
    """Per written input storage `indices[k]` of a CPU step, whether its new value `vals[k]` is handed over
    rather than copied: the value was written into memory `plan` keeps for it from step to step
    (`plan.keep_base_outputs`), which becomes the storage's memory, and the storage's old memory becomes
    the kept output that the next run writes into. Every tensor that views the storage (the parameter,
    its views, `.data` aliases, the user's plain aliases) sees the new memory, as the copy would have
    shown them the new values; the copies cost the MLP and the transformer block of
    bench/record_overhead.py 0.09-0.12 ms a step. Not where the memory's address was handed out
    (`LazyStorage.exported`: NumPy, DLPack, `data_ptr`), for a step input (memory the user passed in), or
    where sizes or dtypes differ, the memory is not aligned as IREE needs, or two values share memory.
    () where none is. The checks that depend only on the plan's tensors are made once per plan
    (`plan.handovers`)."""
    if _SWAP is None or plan is None or not plan.flat_outputs:
        return ()
    storages = [trace.input_storages[i] for i in indices]
    reals = [s.real for s in storages]
    memo = plan.handovers
    if memo is None or len(memo[0]) != len(vals) or not all(map(is_, vals, memo[0])) or \
            not all(ref() is real for ref, real in zip(memo[1], reals)):
        kept = plan.flat_outputs
        # memory two written inputs share (two storages of one tensor's memory, each given its own value:
        # the last copy wins) and a value two inputs get are copied
        shared = Counter(real.untyped_storage().data_ptr() for real in reals)
        given = Counter(map(id, vals))
        fits = []
        for real, val in zip(reals, vals):
            found = kept.get(id(val))
            # (the memory handed to the kept output is written by IREE at the next run: aligned as its own)
            fits.append(found is not None and found[0] is val and given[id(val)] == 1 and real.device.type == "cpu"
                        and real.dtype == val.dtype and real.storage_offset() == 0
                        and shared[real.untyped_storage().data_ptr()] == 1 and real.data_ptr() % ALIGNMENT == 0
                        and real.untyped_storage().nbytes() == val.untyped_storage().nbytes()
                        == val.numel() * val.element_size())
        # (the inputs' tensors by weak reference: a plan kept in the cache does not keep a model's parameters)
        memo = plan.handovers = (tuple(vals), tuple(weakref.ref(r) for r in reals), tuple(fits))
    swaps = tuple(fit and not s.exported and s.ordinal < 0 for fit, s in zip(memo[2], storages))
    return swaps if any(swaps) else ()


def worker_copies(trace: Trace, outputs: tuple, results: list[torch.Tensor], perm, plan) -> tuple:
    """For a step run on the worker (inflight.py): the copies of its new values of the input storages it
    writes (parameters, optimizer state) into their device data, which the worker makes once the step's
    calls have run, rather than the main thread at the wait (`bind(copied=True)`). `results`: the
    runner's output tensors, not filled yet; `perm`, a template's order of them. (destinations,
    sources), through `.data` aliases, whose version counters are their own: the recording thread
    notes the inputs' versions meanwhile; with the values `bind` hands over instead (`handovers`, worked
    out here, before the run: `bind`'s `swaps`), which are not copied: (copies, swaps). The copies are None
    where some copy is not plain (a value that is an input's memory or not dense: `bind` makes them) or
    none is left.

    `plan.flat_outputs`: the flat tensors that the outputs the plan keeps view (`plan.keep_base_outputs`),
    by id: {id(output): (output, flat)}. Where every source is one of them, the same kept outputs are the
    sources at the plan's next steps: their checks and flat tensors are worked out once, kept in
    `plan.copies` (which the plan lets go of with its kept outputs; it holds nothing of the parameters)."""
    indices = [index for kind, index in outputs if kind == "base"]
    if not indices:
        return None, ()
    reals = [trace.input_storages[index].real for index in indices]
    vals = [results[perm[k] if perm is not None else k] for k, (kind, _) in enumerate(outputs) if kind == "base"]
    swaps = handovers(trace, indices, vals, plan)
    if swaps and all(swaps):
        return None, swaps      # (every value handed over: the common case, nothing for the worker)
    memo = plan.copies
    if memo is not None and len(memo[0]) == len(vals) and all(map(is_, vals, memo[0])):
        # (the plan's key holds its input storages' sizes: each still has its source's size; and a kept
        # output is memory of the plan's own, never an input's)
        dsts, srcs = [real.data for real in reals], memo[1]
    else:
        ptrs = {real.data_ptr() for real in reals}      # (an input storage's data: a flat tensor at offset 0)
        flat = plan.flat_outputs
        dsts, srcs = [], []
        kept = 0
        for real, val in zip(reals, vals):
            if val.untyped_storage().data_ptr() in ptrs or not val.is_contiguous() or val.numel() != real.numel():
                return None, swaps
            dsts.append(real.data)
            found = flat.get(id(val))
            if found is not None and found[0] is val:
                srcs.append(found[1])
                kept += 1
            else:
                srcs.append(val if val.dim() == 1 else val.view(-1))      # (an input storage's data is flat)
        if kept == len(vals):
            plan.copies = (vals, srcs)
    if swaps:
        # (handed over by `bind` instead: `handovers`)
        dsts = [d for d, swap in zip(dsts, swaps) if not swap]
        srcs = [s for s, swap in zip(srcs, swaps) if not swap]
    return ((dsts, srcs) if dsts else None), swaps


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
