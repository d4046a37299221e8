"""Running the pending trace: plan (once per graph structure), execute, bind results to lazy tensors.

record (frontend) -> functional graph (frontend/replay) -> partition (cluster) -> emit (frontend/emit)
-> compile (exec) -> run. Plans are cached by the trace's structural key, so a repeated step costs one
dict lookup plus the executable calls. Anything that fails while planning or compiling falls back to
eager execution of the same ops, warns once and is counted; user tensors are only written after the
step's results exist, so a failure never leaves them half-updated.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from .config import CONFIG
from .metrics import METRICS
from .frontend.lazy_tensor import RECORDER, LazyTensor, _flat_base, _view_of_base, set_executor
from .frontend.replay import Program, functional_graph, program_from_trace
from .frontend.trace import LazyStorage, Trace

__all__ = ["run_pending", "StepPlan", "PydiscWarning", "clear_plans"]


class PydiscWarning(UserWarning):
    """A step part that pydisc could not compile and ran eagerly instead."""


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, PydiscWarning, stacklevel=3)


@dataclass
class StepPlan:
    runner: Callable[..., list[torch.Tensor]]
    eager_ops: Counter = field(default_factory=Counter)   # ATen op -> eager runs per execution
    clusters: int = 0
    compiled: bool = False


class CompiledCluster(torch.nn.Module):
    """Stands in for a cluster submodule: allocates its outputs with torch, IREE fills them."""

    def __init__(self, name: str, compiled, emitted, device: torch.device, fallback: torch.nn.Module):
        super().__init__()
        self.name = name
        self.compiled = compiled
        self.specs = [(tuple(s.shape), s.dtype) for s in emitted.outputs]
        self.device = device
        self.fallback = fallback
        out_node = next(n for n in fallback.graph.nodes if n.op == "output")
        self.single = not isinstance(out_node.args[0], (tuple, list))

    def forward(self, *inputs):
        device = self.device
        outs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.specs]
        self.compiled.run(inputs, outs)
        return outs[0] if self.single else tuple(outs)


_PLANS: dict[tuple, StepPlan] = {}


def clear_plans() -> None:
    _PLANS.clear()


def _step_device(trace: Trace) -> torch.device:
    for t in trace.storage_inputs:
        return t.device
    for t in trace.real_inputs:
        if t.dim() > 0:
            return t.device
    return torch.device("cpu")


def _dump(name: str, text: str) -> str | None:
    if not CONFIG.dump_dir:
        return None
    os.makedirs(CONFIG.dump_dir, exist_ok=True)
    path = os.path.join(CONFIG.dump_dir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _build_plan(program: Program, inputs: list[torch.Tensor], device: torch.device) -> StepPlan:
    """Plan in a fresh thread: a read such as `.item()` reaches us from inside `__torch_dispatch__`,
    where the dispatcher's thread-local state (autograd, functionalization excluded) would break
    make_fx. A new thread starts with clean dispatch state and default grad mode."""
    result: list = []

    def work():
        try:
            result.append(_build_plan_here(program, inputs, device))
        except BaseException as exc:   # re-raised in the caller's thread
            result.append(exc)

    worker = threading.Thread(target=work, name="pydisc-plan")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _build_plan_here(program: Program, inputs: list[torch.Tensor], device: torch.device) -> StepPlan:
    from .cluster import partition_graph
    from .frontend.decompositions import DECOMPOSITIONS
    from .frontend.emit import emit_cluster, unsupported_reason
    from .exec import compile_module

    started = time.perf_counter()
    try:
        gm = functional_graph(program, inputs, DECOMPOSITIONS)
    except Exception as exc:  # an op torch's functionalization or fake tensors cannot trace
        warn_once("trace:" + type(exc).__name__ + str(exc)[:80],
                  "pydisc: could not build a functional graph for this step (%s: %s); the step runs "
                  "eagerly. Please report this with the op that failed." % (type(exc).__name__, exc))
        ops = Counter(str(e[0]) for e in program.entries)
        return StepPlan(program, ops)
    if CONFIG.disable:
        return StepPlan(gm, Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    part = partition_graph(gm, device, unsupported_reason, CONFIG.min_cluster_ops)
    fused = part.graph_module
    eager_ops = Counter(part.eager_ops)
    n_compiled = 0
    METRICS.plan_seconds += time.perf_counter() - started
    step_id = METRICS.graph_cache_misses
    summary = ["step %d: %d clusters, %d eager ops" % (step_id, len(part.clusters), len(part.eager_ops))]
    for reason_op, reason in sorted(part.reasons.items()):
        summary.append("  not compiled: %s (%s)" % (reason_op, reason))
    for name in part.clusters:
        sub = getattr(fused, name)
        ops = [str(n.target) for n in sub.graph.nodes if n.op == "call_function"]
        try:
            emitted = emit_cluster(sub)
            _dump("step%d_%s.mlir" % (step_id, name), emitted.text)
            compiled = compile_module(emitted.text, device)
        except Exception as exc:
            path = _dump("step%d_%s.failed.txt" % (step_id, name), "%s\n\n%s" % (exc, sub.code))
            warn_once("cluster:" + type(exc).__name__ + str(exc)[:120],
                      "pydisc: a cluster of %d ops could not be compiled and runs eagerly (%s: %s)%s"
                      % (len(ops), type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                         "; IR dump: " + path if path else "; set PYDISC_DUMP_DIR to keep the IR"))
            METRICS.compile_failures[type(exc).__name__] += 1
            eager_ops.update(ops)
            summary.append("  %s: %d ops, EAGER after failure: %s" % (name, len(ops), exc))
            continue
        setattr(fused, name, CompiledCluster(name, compiled, emitted, device, sub))
        n_compiled += 1
        summary.append("  %s: %d ops compiled: %s" % (name, len(ops), ", ".join(sorted(set(ops)))))
    METRICS.clusters += n_compiled
    if part.eager_ops:
        summary.append("  eager: " + ", ".join("%s x%d" % kv for kv in Counter(part.eager_ops).most_common()))
    _dump("step%d_partition.txt" % step_id, "\n".join(summary) + "\n\n" + fused.code)
    return StepPlan(fused, eager_ops, n_compiled, n_compiled > 0)


# ------------------------------------------------------------------------------------------------

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
    """Run the pending trace (all of it, or what `target` needs) and bind the results."""
    with RECORDER.lock:
        trace = RECORDER.trace
        if not trace.entries:
            return
        trace.check_real_inputs()
        n = len(trace.entries)
        if target is None:
            executed = list(range(n))
        else:
            executed = _needed_entries(trace, target._storage)
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
            METRICS.graph_cache_misses += 1
            program = program_from_trace(trace, executed, outputs)
            plan = _build_plan(program, inputs, device)
            _PLANS[key] = plan
        else:
            METRICS.graph_cache_hits += 1
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
        METRICS.fallback_ops.update(plan.eager_ops)
        _bind(trace, outputs, results, executed, remaining)


def _as_layout(val: torch.Tensor, size, stride) -> torch.Tensor:
    """`val` with exactly the recorded strides, so views of its storage land where eager's would."""
    if tuple(val.shape) == tuple(size) and val.storage_offset() == 0 and \
            (tuple(val.stride()) == tuple(stride) or val.numel() <= 1):
        return val
    out = torch.empty_strided(size, stride, dtype=val.dtype, device=val.device)
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
        trace.values[vid] = ("in", storage.input_index, trace.metas[vid][:3])
        storage.creator = None
    for s in touched:
        s.written = False
    trace.entries = [trace.entries[i] for i in remaining]
    for e in trace.entries:
        for s in e.writes:
            s.written = True


set_executor(lambda t, reason: run_pending(t, reason))
