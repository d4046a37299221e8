"""Compiling in the background: a new step graph's plan is built in a thread while the steps run eagerly.

A new step graph of a 12-layer model takes tens of seconds to partition, emit and compile (92 distinct
IREE modules for BERT-base, 33-60 s on the H200 host with 8 compile processes). With
`PYDISC_BACKGROUND_COMPILE` on for the step's device (default: `cuda`), `mark_step()` does not wait for
that: the step that asked for the plan runs eagerly (its recorded ops, in torch), the plan is built
in a thread (`plan.build_plan`: tracing with fake tensors, partitioning, the iree-compile processes,
loading), and until it is ready the recorder is in pass-through: every op of the following steps runs
in torch at once, nothing is recorded. The first `mark_step()` (or value read) after the plan is
ready puts it where the synchronous path would have (the plan cache, or the dynamic-shape template)
and turns recording back on; the next step records and runs compiled.

So no step waits for a compile, and a training loop whose sizes change (each new size, or the first
steps of an optimizer) runs eagerly until its plans exist (slowed by the planning thread: `SWITCH_INTERVAL`).
`pydisc.wait_for_compiles()` blocks until the plans being built are ready (benchmarks, tests). A plan that fails to build: a step
graph's runs eagerly from then on (warned once), a template's error is raised at the next
`mark_step()`, as it would have been synchronously.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from ..config import CONFIG, applies
from ..metrics import METRICS
from . import step_choice
from .engine import ENGINE
from .plan import build_plan

__all__ = ["enabled", "start", "collect", "join", "pending", "note_step"]


class _Job:
    def __init__(self, program, inputs: list, device: torch.device, sources: list,
                 done: Callable, failed: Callable, multiples: dict | None) -> None:
        self.done, self.failed = done, failed
        self.result: list = []
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._work, args=(program, inputs, device, sources, multiples),
                                       name="pydisc-background-plan", daemon=True)

    def _work(self, program, inputs, device, sources, multiples) -> None:
        try:
            self.result.append(build_plan(program, inputs, device, sources, multiples))
        except BaseException as exc:    # handed to the main thread by `collect`
            self.result.append(exc)


# While a plan is built, its thread (tracing, partitioning, emitting: Python) and the steps running in
# the main thread share the GIL. A thread that waits for it gets it after the switch interval (5 ms by
# default), and a step's torch ops give it up and take it back many times: on the H200 host, steps
# that take 36 ms eagerly took 400-900 ms while BERT-base's plan was traced. A shorter interval while
# jobs run cuts those waits, in part (2-core VM: a loop of small torch ops next to a Python thread, 3.7x
# slower than alone at 5 ms, 1.7x at 0.2 ms; a tiny BERT's steps while its template was planned, median
# 253-328 ms at 0.2 ms against 316-824 ms at 5 ms, 28-40 ms eager); the process's own interval is put
# back when they are done. Planning in another process would remove the contention.
SWITCH_INTERVAL = 0.0002


def enabled(device: torch.device) -> bool:
    """On for `device`, and not in a torch.distributed process group: ranks whose plans became ready at
    different steps would run the same step, and its collectives, in different modes."""
    return applies(CONFIG.background_compile, device) and not step_choice.distributed()


def pending() -> bool:
    return bool(ENGINE.jobs)


def start(program, inputs: list, device: torch.device, sources: list, done: Callable,
          failed: Callable, multiples: dict | None = None) -> None:
    """Build `program`'s plan in a thread; `done(plan)` or `failed(exc)` run on the main thread when it is
    ready (`collect`). Steps pass through meanwhile. Call after the step that asked has run. `multiples`:
    a dynamic-shape template's (plan.build_plan)."""
    job = _Job(program, inputs, device, sources, done, failed, multiples)
    ENGINE.shorten_interval("background", SWITCH_INTERVAL)
    ENGINE.jobs.append(job)
    METRICS.background_compiles += 1
    ENGINE.set_passthrough(True)
    job.thread.start()


def collect() -> None:
    """Apply the plans that are ready. Main thread, recorder lock held."""
    failure = None
    for job in list(ENGINE.jobs):
        if job.thread.is_alive():
            continue
        ENGINE.jobs.remove(job)
        METRICS.background_seconds += time.perf_counter() - job.started
        result = job.result[0]
        if isinstance(result, BaseException):
            try:
                job.failed(result)
            except BaseException as exc:     # raised once every finished job has been applied
                failure = failure or exc
        else:
            job.done(result)
    if not ENGINE.jobs:
        ENGINE.restore_interval("background")
        if ENGINE.passthrough and not step_choice.holds_passthrough():
            ENGINE.set_passthrough(False)
    if failure is not None:
        raise failure


def join() -> None:
    """Wait for the plans being built (not applied: `collect` does that)."""
    for job in list(ENGINE.jobs):
        job.thread.join()


def note_step() -> None:
    """At each mark_step: count the steps run eagerly while plans were being built."""
    if ENGINE.jobs:
        METRICS.steps_while_compiling += 1
