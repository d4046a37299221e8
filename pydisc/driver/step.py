"""Running the pending trace: plan (once per graph structure), execute, bind results to lazy tensors.

record (frontend) -> functional graph (frontend/replay) -> partition (cluster) -> emit (frontend/emit)
-> compile (exec) -> run. Plans are cached by the trace's structural key, so a repeated step costs one
dict lookup plus the executable calls. Anything that fails while planning or compiling falls back to
eager execution of the same ops, warns once and is counted; user tensors are only written after the
step's results exist, so a failure never leaves them half-updated.
"""
from __future__ import annotations

import gc
import time
from collections import Counter

import torch

from ..config import CONFIG
from ..diagnostics import warn_once
from ..exec import graphs
from ..exec.compiled import collecting_calls
from ..frontend import fast, random_state
from ..frontend.fused import FusedStep
from ..frontend.lazy_tensor import PRUNE_FIRST_AT, RECORDER, LazyTensor, materialize
from ..frontend.replay import Program, concrete_program, program_from_trace
from ..frontend.trace import Trace
from ..metrics import METRICS
from . import background, dynamic, inflight, optimizer_state, planning, step_choice
from .dynamic import Binding
from .bind import bind, input_versions, own_writes, worker_copies
from .engine import ENGINE
from .oom import out_of_memory_error, out_of_memory_in
from .plan import StepPlan, keep_base_outputs
from .slices import concrete_key, needed_entries, observable_entries, select_outputs, step_device
from .step_check import StepCheck

__all__ = ["run_pending", "prune_pending", "clear_plans"]


# A read mid-step whose value needs at most this many recorded ops runs them in torch (`_run`).
SMALL_READ_OPS = 16


def _small(trace: Trace, entries: list[int]) -> bool:
    """Whether `entries` are a few ops, for torch to run: at most `SMALL_READ_OPS`, none a fast-recorded
    forward (`FusedStep`: a forward and its backward, what a plan is for)."""
    return len(entries) <= SMALL_READ_OPS and not any(type(trace.entries[i].fn) is FusedStep for i in entries)


def clear_plans() -> None:
    """Forget every plan, template and measurement (`Engine.reset`), after the run in flight is bound."""
    inflight.wait("clear_plans")
    ENGINE.reset()


def prune_pending() -> None:
    """Drop the pending entries nobody can observe any more (`observable_entries`): the trace is rebuilt
    from the others (`Trace.compacted`), or started afresh if none is left, which releases whatever the
    dropped ones held (eager tensors they captured, inputs of the step only they used).

    The recorder calls this whenever a trace that is never marked has doubled in length, so that code
    which records and drops lazy tensors in a loop without `mark_step` runs in bounded memory."""
    with RECORDER.lock:
        if RECORDER.gc_paused:
            # a trace this long is no ordinary step: let the cyclic GC free what only cycles hold
            # (so that those tensors count as dead here), and run as usual from now on
            RECORDER.gc_paused = False
            gc.enable()
            gc.collect()
        trace = RECORDER.trace
        if trace.symbolic is None and trace.entries:
            kept = observable_entries(trace)
            if not kept:
                RECORDER.new_trace()
            elif len(kept) < len(trace.entries):
                RECORDER.trace = trace.compacted(kept)
        RECORDER.prune_at = max(PRUNE_FIRST_AT, 2 * len(RECORDER.trace.entries))


def run_pending(target: LazyTensor | None = None, reason: str = "mark_step") -> None:
    """Run the pending trace (all of it, or what `target` needs) and bind the results.

    If that fails (an error in the user's own op, an eager input changed under the step, out of memory,
    an interrupt), the pending step is abandoned: lazy tensors keep the values of the last completed
    step (and optimizers their eager step counters, `optimizer_state`), results of the abandoned one can
    no longer be read, and the next step starts clean."""
    with RECORDER.lock:
        # (flush: a forward recorded at __torch_function__ with no backward)
        demoted = fast.flush() if reason == "mark_step" else False
        inflight.wait(reason)   # the step before, where it still runs on the worker: its results are inputs
        if background.pending():
            background.collect()
        trace = RECORDER.trace
        # seconds this step spent recording, less the meta kernels of ops not seen before (step_choice.py);
        # none for a step recorded symbolically, once per dynamic-shape template: what later steps cost is
        # not that (a symbolic BERT step recorded in seconds)
        recorded = time.perf_counter() - RECORDER.trace_started - RECORDER.meta_seconds \
            if trace.entries and trace.symbolic is None else 0.0
        fused = trace.fused > 0         # recorded by the fast recorder
        ran = None
        note = trace.rng_note
        try:
            if trace.entries:
                random_state.check_order(trace)
                ran = _run(trace, target, defer=reason == "mark_step")
                random_state.renote(RECORDER.trace, note)
        except BaseException as exc:
            RECORDER.new_trace()
            RECORDER.end_step()
            RECORDER.grad_inputs = []
            optimizer_state.abandoned()
            dynamic.took_new_sizes()        # (the step's note, read and cleared)
            if out_of_memory_in(exc):
                raise out_of_memory_error(exc, trace) from exc
            raise
        if reason == "mark_step":
            off_path = dynamic.took_new_sizes()
            dynamic.note_shapes()
            RECORDER.end_step()
        elif (ran is None or ran[3]) and not RECORDER.trace.entries and not torch.is_grad_enabled() and \
                torch._C._current_graph_task_id() == -1:
            # a read without grad that needed everything pending: the step ends as at mark_step (HF
            # generate() reads each token's result, then calls the model again, with no mark_step
            # between); not a read that ran the rest of a training step along with it (an accuracy
            # logged under no_grad before opt.step()). Not inside a backward (a gradient hook's read):
            # autograd restores the thread's dispatch state when its graph task ends, which would undo
            # the end of a symbolic step
            RECORDER.end_step()
        if reason == "mark_step" or not RECORDER.trace.entries:    # nothing left that could be abandoned
            optimizer_state.completed()
        if reason == "mark_step" and target is None:
            background.note_step()
            step_choice.after_mark_step(*(ran[:3] if ran else (None, False, None)), recorded, fused,
                                        off_path or demoted)
        elif ran is not None:
            step_choice.note_read_run(*ran[:3], recorded, fused)
        pairs = RECORDER.grad_inputs if reason == "mark_step" else []
        if pairs:
            RECORDER.grad_inputs = []
    if pairs:
        _pass_on_input_grads(pairs)


def _pass_on_input_grads(pairs: list) -> None:
    """Hand the gradients the step's lazy leaves got on to the inputs they stand for, as eager's
    backward would have: accumulated into a leaf's `.grad`, or on through the graph that made it."""
    tensors, grads = [], []
    for real, leaf in pairs:
        g = leaf.grad
        if g is not None:
            tensors.append(real)
            grads.append((materialize(g, reason="input grad") if type(g) is LazyTensor else g).detach())
    if tensors:
        torch.autograd.backward(tensors, grads)


def _run(trace: Trace, target: LazyTensor | None, defer: bool = False) -> tuple:
    """Returns (which plan ran: its id, None where it is not reusable; whether it came from the plan
    cache; the device), for `step_choice.after_mark_step`, and whether a read needed all it ran (what it
    left out nobody can observe). (The id, not the cache key: a key is hashed anew at each lookup, and the
    steps of a dynamic-shape template share its plan.) `defer`: at a mark_step, the run may go to the
    worker thread (`_deferrable`)."""
    n = len(trace.entries)
    cached = graphed = False
    binding = None
    small = False
    if target is None:
        executed = list(range(n))
    else:
        executed = needed_entries(trace, target._storage)
        small = _small(trace, executed)
    # the value read needed all that is recorded, or all that can still be observed (a token of `generate()`)
    whole = len(executed) == n
    observable = None
    if target is not None and not whole and not torch.is_grad_enabled():
        needed, observable = set(executed), set(observable_entries(trace))
        whole = not any(i in observable for i in range(n) if i not in needed)
    if target is not None and not small:
        # A read that needs a step's worth of ops (`loss.item()` to log it) runs all that is recorded, not
        # just what it needs: a step that logs its loss after `opt.step()` is then one plan as without
        # the read, and the step's parts, each planned on its own, would not match a dynamic-shape
        # template (they planned per shape). The step goes on (`whole` says whether it ends, run_pending).
        executed = list(range(n))
    trace.check_real_inputs(executed)
    executed_set = set(executed)
    remaining = [i for i in range(n) if i not in executed_set]
    if remaining:
        # what a read leaves pending and nobody can observe any more is dropped, not kept to the mark
        if observable is None:
            observable = set(observable_entries(trace))
        remaining = [i for i in remaining if i in observable]
    outputs = select_outputs(trace, executed, remaining)
    device = step_device(trace)
    scalars = _scalars(trace.scalars, device) if trace.scalars else None
    inputs = list(trace.storage_inputs) + list(trace.real_inputs) + ([scalars] if scalars is not None else [])
    if small and remaining:
        # a value read mid-step that needs a few ops (HF's `padding_mask.all()`, a size): torch runs
        # them, as eager would, rather than a plan of their own; the rest of the step stays pending
        program = concrete_program(trace, executed, outputs) if trace.symbolic is not None else \
            program_from_trace(trace, executed, outputs)
        METRICS.reads_run_eagerly += 1
        bind(trace, outputs, program(*inputs), executed, remaining)
        return None, False, device, whole
    if trace.symbolic is not None:
        plan, call_inputs, perm = planning.plan_symbolic(trace, executed, outputs, inputs, scalars, device)
        key = None
    else:
        started = time.perf_counter()
        key = concrete_key(trace, executed, outputs)
        plan = ENGINE.plans.get(key)
        if plan is None and RECORDER.gc_paused and gc.collect(0):
            # The cyclic GC is paused while a step records: a lazy tensor held only by a reference
            # cycle (frames of an exception caught inside a meta kernel, a module imported by one)
            # looks alive and would become an output of the new plan, and the next step, without
            # it, would plan again. Collected here, before planning, rather than on every step.
            outputs = select_outputs(trace, executed, remaining)
            key = concrete_key(trace, executed, outputs)
            plan = ENGINE.plans.get(key)
        METRICS.lookup_seconds += time.perf_counter() - started
        if plan is None:
            plan = planning.plan_concrete(trace, key, executed, outputs, inputs, device, remaining)
            if plan is None:
                return None, False, device, whole   # ran eagerly and bound (a shape change: dynamic dims from now on)
        else:
            cached = True
            METRICS.graph_cache_hits += 1
            RECORDER.capture_sources = CONFIG.strict
        if type(plan) is Binding:
            binding = plan
            if binding.template.plan is None:
                if background.enabled(device):
                    # built in a thread (once, after this step); until it is ready, steps run eagerly
                    if not binding.template.building:
                        METRICS.steps += 1
                        bind(trace, outputs, program_from_trace(trace, executed, outputs)(*inputs), executed,
                              remaining)
                        planning.start_template(binding.template, device)
                        return None, False, device, whole
                    binding = None
                elif not planning.build_template(binding, device):
                    ENGINE.plans.pop(key, None)   # this step's sizes break a guard that planning added
                    binding = None
            if binding is not None:
                if binding.scalar_map is not None:     # a fast-recorded step's (fast_match.py)
                    scalars = _scalars(binding.scalar_values(trace), device) if binding.scalar_map else None
                try:
                    call_inputs = binding.inputs(trace, scalars)
                except Exception as exc:     # noqa: BLE001 - an eager input made again by torch (dynamic.Recomputed)
                    # torch refused this step what it made for an earlier one: the step runs eagerly (where
                    # torch raises again if the user's own op does), and its structure is matched anew
                    warn_once("binding:" + type(exc).__name__,
                              "pydisc: passing a step's inputs to its dynamic-shape plan failed (%s: %s); the "
                              "step runs eagerly" % (type(exc).__name__, exc))
                    METRICS.compile_failures["binding:" + type(exc).__name__] += 1
                    ENGINE.plans.pop(key, None)
                    binding = None
            if binding is not None:
                perm = binding.perm
                binding.template.steps += 1
                plan = binding.template.plan
                # one CUDA graph per shape the template runs at (a binding), as for a concrete plan
                graphed = graphs.enabled(device)
            else:   # eagerly, this once
                plan = StepPlan(program_from_trace(trace, executed, outputs))
                call_inputs, perm = inputs, None
        else:
            call_inputs, perm = inputs, None
            graphed = graphs.enabled(device)    # a plan for these shapes: replayed from a CUDA graph
            if not graphed and device.type == "cpu":
                keep_base_outputs(plan, outputs)
    check = None
    if CONFIG.check_every and not isinstance(plan.runner, Program):
        plan.runs += 1
        if plan.runs % CONFIG.check_every == 0:
            check = StepCheck(trace, inputs, device)
    plan.calls += 1
    if defer and target is None and _deferrable(plan, trace, outputs, device, remaining, key, graphed, check) and \
            _defer(plan, trace, executed, outputs, inputs, call_inputs, perm, key, device):
        return id(plan), cached, device, whole

    def produce():
        if not graphed:
            return plan.runner(*call_inputs)
        if binding is None:
            return graphs.run_plan(plan, plan.runner, call_inputs, lambda: _written_inputs(outputs), device)
        return graphs.run_plan(binding, plan.runner, call_inputs, lambda: _written_inputs(outputs, binding), device,
                               shape=True)

    results, plan = _outcome(plan, produce, trace, executed, outputs, inputs, perm, key, device, check)
    _count_step(plan)
    bind(trace, outputs, results, executed, remaining, plan=plan)
    return (id(plan) if key is not None else None), cached, device, whole


def _written_inputs(outputs: tuple, binding: Binding | None = None) -> dict[int, int]:
    """For `graphs.run_plan`: the plan's outputs that are new values of its inputs (parameters, optimizer
    state), as {output position: input position}, in the terms of the runner (a template's for a binding)."""
    written = {k: index for k, (kind, index) in enumerate(outputs) if kind == "base"}
    if binding is None:
        return written
    position = {j: i for i, j in enumerate(binding.storage_order) if type(j) is int}
    return {binding.perm[k]: position[index] for k, index in written.items() if index in position}


def _outcome(plan: StepPlan, produce, trace: Trace, executed: list[int], outputs: tuple, inputs: list, perm,
             key: tuple | None, device: torch.device, check: StepCheck | None) -> tuple[list, StepPlan]:
    """The step's results and the plan that made them: `produce()`'s (the plan's run), or, where that
    fails, the same ops run by torch (the plan is given up for eager, with a warning); eager's error where a
    value check says eager raises. Shared by the steps run at once and those run on the worker (`_defer`)."""
    refused = False
    try:
        results = produce()
        if plan.value_check:
            *results, flag = results
            refused = bool(flag)    # an index out of range, a division by zero (cluster/value_checks.py)
        if perm is not None:
            results = [results[k] for k in perm]
    except Exception as exc:
        if device.type == "cuda":
            # kernels of the plan queued before the failure may still read buffers that this frame's
            # unwinding frees: they finish first. If one faulted, the process's CUDA context is lost and
            # nothing can run eagerly instead: the failure goes to the user.
            try:
                torch.cuda.synchronize(device)
            except Exception:
                raise exc from None
        if out_of_memory_in(exc):
            # not a fault of the plan: neither given up for eager (which would need the same memory) nor
            # counted as a failure; the step is abandoned and the error says where and why (run_pending)
            raise
        if isinstance(plan.runner, Program) and perm is None and key is not None:
            raise  # eager execution failed: the user's own op raised, as it would without pydisc
        warn_once("run:" + type(exc).__name__,
                  "pydisc: running a compiled step failed (%s: %s); this graph runs eagerly from "
                  "now on" % (type(exc).__name__, exc))
        METRICS.compile_failures["runtime:" + type(exc).__name__] += 1
        program = concrete_program(trace, executed, outputs)
        plan = StepPlan(program, Counter(str(e[0]) for e in program.entries))
        if key is not None:
            ENGINE.plans[key] = plan
        results = program(*inputs)
        check, refused = None, False
    if refused:
        # eager raises here, with its own exception and message; nothing of the step is bound
        results = concrete_program(trace, executed, outputs)(*inputs)
        check = None
    if check is not None:
        check.compare(program_from_trace(trace, executed, outputs), trace, outputs, results)
    return results, plan


def _count_step(plan: StepPlan) -> None:
    METRICS.steps += 1
    _count_ops(plan)


def _count_ops(plan: StepPlan) -> None:
    for op, count in plan.eager_ops.items():
        METRICS.note_fallback(op, count, plan.eager_dtypes.get(op, ()), plan.eager_sources.get(op))
    for op, count in plan.library_ops.items():
        METRICS.library_ops[op] += count


# A cached plan's first runs stay on the main thread: its clusters time themselves on their second call
# where PYDISC_MEASURE asks (exec/clusters.py), which a step recording next to them would disturb.
DEFER_AFTER_CALLS = 2


def _deferrable(plan: StepPlan, trace: Trace, outputs: tuple, device: torch.device, remaining: list[int],
                key: tuple | None, graphed: bool, check: StepCheck | None) -> bool:
    """Whether this step's run goes to the worker thread (inflight.py): a whole step on the CPU (not a read,
    which needs its value now), from a cached plan of compiled clusters that has run before, neither
    checked nor timed."""
    return (CONFIG.async_cpu and device.type == "cpu" and key is not None and not remaining
            and not graphed and check is None and plan.calls > DEFER_AFTER_CALLS
            and not isinstance(plan.runner, Program) and inflight.deferrable(plan, trace, outputs))


def _defer(plan: StepPlan, trace: Trace, executed: list[int], outputs: tuple, inputs: list, call_inputs: list,
           perm, key: tuple, device: torch.device) -> bool:
    """Prepare the step's compiled calls here, start them on the worker and return True; its results are
    bound at the next wait (inflight.py), and the recorder starts the next step's trace now. False (nothing
    started) where preparing them failed: the step then runs at once, as any other."""
    shared = inflight.user_memory(trace)
    if shared:
        # what the user can write without pydisc is read from copies (inflight.py), here and by a fallback;
        # by memory, not by object: a step matched to a dynamic-shape template gets views of its inputs
        copies: dict[int, torch.Tensor] = {}

        def own(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in shared:
                copy = copies.get(id(t))
                if copy is None:
                    copy = copies[id(t)] = t.clone()
                return copy
            return t

        if call_inputs is inputs:       # (a concrete plan's)
            # storage inputs first, by their data's address (a flat tensor at offset 0: no storage object
            # made for each of a step's parameters), then the eager inputs and the lifted scalars
            n = len(trace.storage_inputs)
            inputs = call_inputs = [own(t) if t.data_ptr() in shared else t for t in inputs[:n]] + \
                [own(t) for t in inputs[n:]]
        else:
            call_inputs = [own(t) for t in call_inputs]
            inputs = [own(t) for t in inputs]
    calls: list = []
    try:
        with collecting_calls(calls):
            pending = plan.runner(*call_inputs)     # the results' tensors, filled by the calls
    except Exception:
        return False
    notes = optimizer_state.taken()
    copies, swaps = worker_copies(trace, outputs, pending, perm, plan)
    copied = []

    def job():
        for call in calls:
            call.run()
        # (a value check's flag, the last result, refuses the step: it writes nothing, eager raises)
        if copies is not None and not (plan.value_check and bool(pending[-1])):
            torch._foreach_copy_(*copies)
            copied.append(True)
        return pending

    def finish(results, error):
        with RECORDER.lock:
            def produce():
                if error is not None:
                    raise error
                return results
            current = RECORDER.trace
            versions = input_versions(current)
            try:
                if error is None and not (plan.value_check and bool(results[-1])):
                    # (no torch op runs: the results are the plan's; a value check's flag is 0)
                    out, ran = _outcome(plan, produce, trace, executed, outputs, inputs, perm, key, device, None)
                else:
                    # torch may run the step's ops here (a failed run, a refused value): as at its mark_step,
                    # not under the autocast or inference mode of the code that happens to wait
                    with torch.autocast(device.type, enabled=False), torch.inference_mode(False):
                        out, ran = _outcome(plan, produce, trace, executed, outputs, inputs, perm, key, device,
                                            None)
            except BaseException:
                # the step failed (eager's error): it is abandoned, and so is what was recorded after it
                RECORDER.new_trace()
                RECORDER.end_step()
                RECORDER.grad_inputs = []
                optimizer_state.abandoned()
                optimizer_state.restore(notes)
                raise
            if ran is not plan:       # given up for eager: its ops count as fallbacks, as for a step run at once
                _count_ops(ran)
            bind(trace, outputs, out, executed, [], fresh_trace=False, copied=bool(copied) and ran is plan,
                 plan=ran, swaps=swaps if ran is plan else None)
            own_writes(current, versions)

    def writes() -> tuple:
        # the memory of the input storages the step writes (its parameters and optimizer state), (start, end):
        # the worker copies into it, or `bind` hands it over at the wait; a read of other memory need not wait
        spans = []
        for kind, index in outputs:
            if kind == "base":
                memory = trace.input_storages[index].real.untyped_storage()
                spans.append((memory.data_ptr(), memory.data_ptr() + memory.nbytes()))
        return tuple(spans)

    _count_step(plan)
    RECORDER.new_trace()
    inflight.start(job, finish, writes)
    return True


def _scalars(values: list, device: torch.device) -> torch.Tensor:
    """The step's lifted Python scalars as one float32 tensor on `device`: the last step's tensor where the
    values are the same (an SGD step's learning rate and momentum; no step writes it, the plans only read
    it), else a new one. To a GPU through pinned memory without waiting: a copy from pageable memory
    would synchronise the stream, and the next step's recording would no longer overlap this one's kernels."""
    last = ENGINE.scalars
    # (a zero is made anew: 0.0 == -0.0, and the sign of a zero can reach a result)
    if last is not None and last[0] == values and last[1] == device and 0 not in values:
        return last[2]
    host = torch.tensor(values, dtype=torch.float32)
    if device.type == "cpu":
        out = host
    elif device.type != "cuda":
        out = host.to(device)
    else:
        out = host.pin_memory().to(device, non_blocking=True)
    ENGINE.scalars = (list(values), device, out)
    return out
