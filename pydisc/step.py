"""Running the pending trace: plan (once per graph structure), execute, bind results to lazy tensors.

record (frontend) -> functional graph (frontend/replay) -> partition (cluster) -> emit (frontend/emit)
-> compile (exec) -> run. Plans are cached by the trace's structural key, so a repeated step costs one
dict lookup plus the executable calls. Anything that fails while planning or compiling falls back to
eager execution of the same ops, warns once and is counted; user tensors are only written after the
step's results exist, so a failure never leaves them half-updated.
"""
from __future__ import annotations

from collections import Counter

import torch

from .config import CONFIG
from .diagnostics import explain_recompile, log, warn_once
from .frontend.lazy_tensor import RECORDER, LazyTensor, _flat_base, _view_of_base, set_executor
from .frontend.replay import Program, program_from_trace
from .frontend.trace import LazyStorage, Trace
from .metrics import METRICS
from .plan import StepPlan, build_plan

__all__ = ["run_pending", "clear_plans"]


_PLANS: dict[tuple, StepPlan] = {}
_SEEN_OPS: dict[tuple, tuple] = {}   # op sequence -> last structural key planned for it (recompile explainer)


def clear_plans() -> None:
    _PLANS.clear()
    _SEEN_OPS.clear()


def _step_device(trace: Trace) -> torch.device:
    for t in trace.storage_inputs:
        return t.device
    for t in trace.real_inputs:
        if t.dim() > 0:
            return t.device
    return torch.device("cpu")


def _needed_entries(trace: Trace, storage: LazyStorage) -> list[int]:
    """Entries that the current data of `storage` depends on, in program order.

    One backward pass tracks which storages' state is still needed at each point. An entry left out
    that touches a storage which a kept entry later writes (it would read the new value, or overwrite
    it, when run afterwards) is forced in, and the pass repeats until nothing changes.
    """
    entries = trace.entries
    n = len(entries)
    produced = [{id(trace.storages[v]) for v in e.out_vids if v is not None} | {id(s) for s in e.writes}
                for e in entries]
    reads = [{id(s) for s in e.reads} for e in entries]
    writes = [{id(s) for s in e.writes} for e in entries]
    forced: set[int] = set()
    while True:
        needed = {id(storage)}
        include = [False] * n
        for i in range(n - 1, -1, -1):
            if i in forced or produced[i] & needed:
                include[i] = True
                needed |= reads[i]
        later_writes: set[int] = set()
        new_forced = set()
        for i in range(n - 1, -1, -1):
            if include[i]:
                later_writes |= writes[i]
            elif (reads[i] | writes[i]) & later_writes:
                new_forced.add(i)
        if not new_forced:
            return [i for i in range(n) if include[i]]
        forced |= new_forced


def _select_outputs(trace: Trace, executed: list[int], remaining: list[int]) -> tuple:
    """Storages whose data must exist after running `executed`: inputs they write (written back), and
    storages they create that a live tensor or a remaining entry still uses."""
    remaining_reads = set()
    for i in remaining:
        remaining_reads |= {id(s) for s in trace.entries[i].reads}
    alive_storages = set()
    for vid, ref in trace.tensors.items():
        t = ref()
        if t is not None:
            alive_storages.add(id(t._storage))
    outputs = []
    written_inputs = set()
    for i in executed:
        e = trace.entries[i]
        for s in e.writes:
            if s.input_index >= 0 and s.epoch == trace.epoch:
                written_inputs.add(s.input_index)
        for vid in e.out_vids:
            if vid is None:
                continue
            s = trace.storages[vid]
            if s.creator == vid and (id(s) in alive_storages or id(s) in remaining_reads):
                outputs.append(("value", vid))
    return tuple(("base", i) for i in sorted(written_inputs)) + tuple(outputs)


def run_pending(target: LazyTensor | None = None, reason: str = "mark_step") -> None:
    """Run the pending trace (all of it, or what `target` needs) and bind the results.

    If that fails (an error in the user's own op, an eager input changed under the step, an
    interrupt), the pending step is abandoned: lazy tensors keep the values of the last completed step,
    results of the abandoned one can no longer be read, and the next step starts clean."""
    with RECORDER.lock:
        if not RECORDER.trace.entries:
            return
        try:
            _run(RECORDER.trace, target)
        except BaseException:
            RECORDER.new_trace()
            raise


def _run(trace: Trace, target: LazyTensor | None) -> None:
    n = len(trace.entries)
    if target is None:
        executed = list(range(n))
    else:
        executed = _needed_entries(trace, target._storage)
    trace.check_real_inputs(executed)
    executed_set = set(executed)
    remaining = [i for i in range(n) if i not in executed_set]
    outputs = _select_outputs(trace, executed, remaining)
    key = (
        tuple((t.numel(), t.dtype, t.device) for t in trace.storage_inputs),
        tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in trace.real_inputs),
        tuple(v for v in trace.values if v[0] == "in"),
        tuple(trace.entries[i].sig for i in executed),
        len(trace.scalars),
        outputs,
    )
    device = _step_device(trace)
    inputs = list(trace.storage_inputs) + list(trace.real_inputs)
    if trace.scalars:
        inputs.append(torch.tensor(trace.scalars, dtype=torch.float32, device=device))
    plan = _PLANS.get(key)
    if plan is None:
        sources = [trace.entries[i].source for i in executed]
        ops = tuple(sig[0] for sig in key[3])
        seen = _SEEN_OPS.get(ops)
        if seen is not None:
            # the same ops as a graph planned before: say what else changed
            reason = explain_recompile(seen, key, sources)
            METRICS.recompiles.append(reason)
            log("recompiles", "planning again: %s", reason)
        _SEEN_OPS[ops] = key
        METRICS.graph_cache_misses += 1
        program = program_from_trace(trace, executed, outputs)
        try:
            plan = build_plan(program, inputs, device, sources)
        except KeyboardInterrupt:
            # Ctrl-C during a long compile: finish this step eagerly, so that everything it made
            # (optimizer state included) holds data, then stop as asked.
            _bind(trace, outputs, program(*inputs), executed, remaining)
            raise
        _PLANS[key] = plan
        RECORDER.capture_sources = True
    else:
        METRICS.graph_cache_hits += 1
        RECORDER.capture_sources = CONFIG.strict
    try:
        results = plan.runner(*inputs)
    except Exception as exc:
        if isinstance(plan.runner, Program):
            raise  # eager execution failed: the user's own op raised, as it would without pydisc
        warn_once("run:" + type(exc).__name__,
                  "pydisc: running a compiled step failed (%s: %s); this graph runs eagerly from "
                  "now on" % (type(exc).__name__, exc))
        METRICS.compile_failures["runtime:" + type(exc).__name__] += 1
        program = program_from_trace(trace, executed, outputs)
        plan = _PLANS[key] = StepPlan(program, Counter(str(e[0]) for e in program.entries))
        results = program(*inputs)
    METRICS.steps += 1
    for op, count in plan.eager_ops.items():
        METRICS.note_fallback(op, count, plan.eager_dtypes.get(op, ()), plan.eager_sources.get(op))
    _bind(trace, outputs, results, executed, remaining)


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


def _bind(trace: Trace, outputs: tuple, results: list[torch.Tensor], executed: list[int],
          remaining: list[int]) -> None:
    touched: list[LazyStorage] = []
    for (kind, index), val in zip(outputs, results):
        if kind == "base":
            storage = trace.input_storages[index]
            if val.data_ptr() != storage.real.data_ptr():
                storage.real.copy_(val.reshape(storage.real.shape))
            trace.storage_versions[index] = storage.real._version   # our own write, not the user's
        else:
            storage = trace.storages[index]
            size, stride, offset, dtype = trace.metas[index]
            storage.real = _flat_base(_as_layout(val, size, stride))
        touched.append(storage)
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
                t._real = _view_of_base(t._storage.real, tuple(t.shape), t.stride(), t.storage_offset())
    if not remaining:
        RECORDER.new_trace()
        return
    # Keep the rest pending: values made by the executed entries become inputs of what remains.
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
        storage.creator = None
    for s in touched:
        s.written = False
    trace.entries = [trace.entries[i] for i in remaining]
    for e in trace.entries:
        for s in e.writes:
            s.written = True


set_executor(lambda t, reason: run_pending(t, reason))
