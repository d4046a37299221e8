"""A compiled CPU step that runs on a worker thread while the next step records (`PYDISC_ASYNC`).

On the CPU a compiled step runs on the calling thread (IREE's `local-sync` driver). Recording is Python
on the main thread, IREE's kernels are native code that runs without the GIL, so the two can overlap on
two cores: `mark_step` starts the step's plan on a worker thread and returns, the next step records
meanwhile, and the step's results are bound when something needs them. This is what PyTorch/XLA does
with its devices, and what a CUDA stream gives a GPU for free.

What waits for the run (`wait`), on the main thread:
- the next `mark_step` or any run of pending ops (its inputs are this run's results);
- a read of device data of a lazy tensor (`.item()`, printing, an op that runs eagerly, a lazy tensor
  made plain) that this run computes or whose memory it writes (parameters, optimizer state:
  `Recorder.waits_for`; the loss of the step before is read at once), any eager op that writes one, a
  collective; a value only this run computes, used by the next step;
- `pydisc.synchronize()`, `pydisc.metrics()`, `os.fork()` and the interpreter's exit.
Each wait is counted by its reason in `metrics()["async_waits"]`; the time the main thread spent
waiting in `async_wait_seconds`.

Only the IREE calls run on the worker, and after them one foreach copy of the step's new parameters and
optimizer state into their device data (`bind.worker_copies`: 0.1-0.14 ms a step of the MLP and the
transformer block of bench/record_overhead.py that the main thread no longer spends). The plan's graph
runs on the main thread as at any step, but each compiled cluster's call is prepared there (its outputs
allocated, its arguments imported) and collected rather than invoked (`exec.compiled.collecting_calls`);
the worker then only invokes them in order, which needs the GIL once per call (a worker that ran Python
next to the recording main thread waited for the GIL more than it ran: 2-core VM, transformer block,
3.5 ms per run instead of 2.0).
So the ops torch runs in a plan (dropout's random masks), and the clusters whose results they read, run
on the main thread while the calls are prepared, where a synchronous run runs them (they draw the random
numbers they would draw without the worker); a plan is deferred where some cluster is left that none of
them reads, and no cluster times or checks itself (`PYDISC_MEASURE`, `PYDISC_CHECK`).

What else a deferred run may not do:
- write memory the user can reach without pydisc: inputs of the step (module inputs, `to_lazy`) that it
  writes in place (parameters and optimizer state are reached only through lazy tensors, which wait);
- read memory the user can write without pydisc: step inputs and eager tensors captured by reference
  are copied before the run starts (a training loop that refills its input buffer right after
  `mark_step` would otherwise race with the run).

A run that fails is handled at the wait as `mark_step` handles it: the plan is given up for eager and
the step's ops run in torch; a value eager raises on (`cluster/value_checks.py`) raises eager's error
there, and the optimizers' eager counters of the step are put back (`optimizer_state`).

Memory: a deferred plan's outputs, intermediates between its clusters included, are allocated when its
calls are prepared, and each call's buffers are let go once it has run; a synchronous run allocates
them as it goes. Today's CPU plans are mostly one cluster, where the two are the same.
"""
from __future__ import annotations

import operator
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from ..exec.clusters import CompiledCluster
from ..frontend.lazy_tensor import RECORDER
from ..metrics import METRICS
from .engine import ENGINE

__all__ = ["InFlight", "Worker", "deferrable", "user_memory", "start", "wait"]

# While a run is in flight the main thread records (Python, holding the GIL) and the worker needs the GIL
# around each IREE call it makes (to call it, and when it returns). A thread that waits for the GIL gets
# it after the switch interval (5 ms by default), longer than a small CPU step: it is shortened while
# runs are in flight (2-core VM, transformer block: 2.74 ms per step at 5 ms, 2.53 at 0.5 ms, 2.50 at
# 0.02 ms. Eager and intervals of 0.2, 0.05 and 0.02 ms taking turns in one process, steps against eager's:
# MLP 1.57-1.65x, 1.42-1.44x, 1.38-1.41x; the block 1.18x, 1.08-1.15x, 1.09-1.13x; HF GPT-2 tiny with
# dropout 1.64x, 1.61x, 1.67x, where without the worker 1.65x).
SWITCH_INTERVAL = 0.00005
# how long `start` waits for the worker to take a job, in seconds
_START_TIMEOUT = 0.5


class InFlight:
    """One plan run on the worker: `job()` there; `finish(results, error)` on the main thread at `wait`."""

    __slots__ = ("job", "finish", "done", "started", "results", "error")

    def __init__(self, job: Callable[[], list], finish: Callable[[list | None, BaseException | None], None]):
        self.job = job
        self.finish = finish
        self.done = threading.Lock()    # held until the job has run (a lock costs 0.5 us to make, an Event 5)
        self.done.acquire()
        self.started = threading.Lock()     # held until the worker has taken the job (`start`)
        self.started.acquire()
        self.results: list | None = None
        self.error: BaseException | None = None


class Worker:
    """One daemon thread that runs the jobs handed to it, one at a time."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="pydisc-run", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            run = self.jobs.get()
            run.started.release()
            try:
                run.results = run.job()
            except BaseException as exc:    # handed to the main thread, raised or handled there
                run.error = exc
            run.job = None
            run.done.release()
            run = None      # nothing of the step stays alive in this frame (the interpreter's exit frees it)


def deferrable(plan, trace, outputs: tuple) -> bool:
    """Whether `plan` may run on the worker for this step (the module docstring says what may not): its
    runner is compiled clusters only, whose calls are prepared on the main thread and invoked on the
    worker (`exec.compiled.collecting_calls`), and it writes no step input in place."""
    clusters = _clusters(plan)
    if clusters is None or not all(c.can_defer() for c in clusters):
        return False
    for kind, index in outputs:
        if kind == "base" and trace.input_storages[index].ordinal >= 0:
            return False        # a write into a step input: the user's own tensor
    return True


def _clusters(plan) -> list | None:
    """The compiled clusters of `plan` whose calls go to the worker, where its graph allows it; found once
    per plan. Ops torch runs (the random masks of dropout) and the clusters they read (the one that makes
    the tensors dropout draws into) run on the main thread while the calls are prepared, at the point of
    `mark_step` where a synchronous run would run them, so they draw the same random numbers; torch must
    read no result of a cluster that runs on the worker. None where nothing can go to the worker."""
    found = plan.deferred_clusters
    if found is False:
        return None
    if found is not None:
        return found
    runner = plan.runner
    found = False
    if isinstance(runner, torch.fx.GraphModule):
        def is_cluster(node) -> bool:
            return node.op == "call_module" and isinstance(getattr(runner, node.target), CompiledCluster)

        nodes = list(runner.graph.nodes)
        now: set = set()        # what torch's ops read, transitively: run on the main thread
        for node in reversed(nodes):
            if node in now or not (node.op in ("placeholder", "output") or is_cluster(node) or (
                    node.op == "call_function" and node.target is operator.getitem)):
                now.update(node.all_input_nodes)
                now.add(node)
        clusters = [node for node in nodes if is_cluster(node)]
        deferred = [getattr(runner, node.target) for node in clusters if node not in now]
        if deferred:
            for node in clusters:
                getattr(runner, node.target).run_at_once = node in now
            found = deferred
    plan.deferred_clusters = found
    return found or None


def user_memory(trace) -> set[int]:
    """The memory of the step's inputs that the user can write without pydisc (step inputs: module
    inputs and `to_lazy`; eager tensors the step read), by storage address."""
    ptrs = {t.untyped_storage().data_ptr() for t in trace.real_inputs}
    for storage, t in zip(trace.input_storages, trace.storage_inputs):
        if storage.ordinal >= 0:
            ptrs.add(t.untyped_storage().data_ptr())
    ptrs.discard(0)     # (empty tensors)
    return ptrs


def start(job: Callable[[], list], finish: Callable[[list | None, BaseException | None], None],
          writes: Callable[[], tuple]) -> None:
    """Run `job` on the worker; `finish` binds its results at the next `wait`; `writes()`: the memory of
    lazy tensors that `job` writes, as (start, end) addresses (`Recorder.waits_for`). Call with none in
    flight."""
    assert ENGINE.in_flight is None, "a run is already in flight"
    if ENGINE.worker is None:
        ENGINE.worker = Worker()
    ENGINE.shorten_interval("in flight", SWITCH_INTERVAL)
    run = InFlight(job, finish)
    ENGINE.in_flight = run
    RECORDER.note_in_flight(wait, writes)
    METRICS.async_runs += 1
    ENGINE.worker.jobs.put(run)
    # Wait (without the GIL) until the worker has taken the job. The worker needs the GIL to take it, and
    # a thread that waits for the GIL while this one runs Python gets it only after a switch interval and
    # two thread wake-ups: a job started 0.12-0.18 ms after it was handed over (at times 0.5 ms, 2-core
    # VM), late for a step of the MLP of bench/record_overhead.py, whose run (0.38 ms) then outlasted the
    # next step's recording. Waiting costs this thread about one wake-up of each (~0.05 ms); the worker
    # lets the GIL go as its first IREE call begins. (Steps of the MLP 1.04-1.10 -> 0.74-0.86 ms, of the
    # transformer block 2.0-2.3 -> 1.78-1.85 ms.) Not for ever: a job the worker has not taken by then is
    # waited for at `wait`, as any. Polling instead, letting the GIL go between tries (`time.sleep(0)`),
    # here or in `wait`, was no faster: MLP steps 0.93-0.99x of eager's blocking, 0.95-0.99x polling here,
    # 0.93-0.96x polling in `wait` (fastest blocks of 10, the settings taking turns in shuffled order in one
    # process; a fixed order had shown polling ahead). (Counted in `async_wait_seconds`, not as a wait of
    # its own in `async_waits`.)
    started = time.perf_counter()
    interrupted = None
    while True:
        try:
            run.started.acquire(timeout=_START_TIMEOUT)
            break
        except BaseException as exc:    # KeyboardInterrupt: raised once the worker has the job
            interrupted = exc
    METRICS.async_wait_seconds += time.perf_counter() - started
    if interrupted is not None:
        raise interrupted


def wait(reason: str = "wait") -> None:
    """Wait for the run in flight, if any, and bind its results (or handle its failure). An interrupt
    (Ctrl-C) while waiting is raised once the run is bound: the run writes memory the step's tensors
    will read, and the optimizers' counters say it happened."""
    with RECORDER.lock:
        run = ENGINE.in_flight
        if run is None:
            return
        interrupted = None
        if run.done.locked():
            started = time.perf_counter()
            while True:
                try:
                    run.done.acquire()
                    break
                except BaseException as exc:    # KeyboardInterrupt: the run finishes all the same
                    interrupted = exc
            METRICS.async_wait_seconds += time.perf_counter() - started
        ENGINE.in_flight = None
        RECORDER.note_in_flight(None, None)
        METRICS.async_waits[reason] += 1
        ENGINE.restore_interval("in flight")
        finish, results, error = run.finish, run.results, run.error
        run.finish = run.results = run.error = None
        finish(results, error)
        if interrupted is not None:
            raise interrupted


def _before_fork() -> None:
    # Parent and child get the step's results bound (the child has no worker thread to finish it). An
    # error of the step cannot be raised into the fork: Python prints it, and the step is abandoned.
    wait("fork")


def _forget_in_child() -> None:
    # A process forked while a worker existed has no such thread (fork copies only the calling one): its
    # steps would queue for nobody. It starts its own worker at its first deferred step.
    ENGINE.worker = None
    ENGINE.in_flight = None
    RECORDER.note_in_flight(None, None)


os.register_at_fork(before=_before_fork, after_in_child=_forget_in_child)
