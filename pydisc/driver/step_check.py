"""`PYDISC_CHECK=N`: every Nth run of each compiled step plan, the recorded step is also replayed in
plain PyTorch (its recorded ops on torch's own kernels, on copies of the step's inputs) and every result
the step binds is compared: values read later, parameters and buffers written in place, gradients,
optimizer state. A wrong value anywhere in the plan shows up here, whether a compiled cluster, a
decomposition, an eager op fed by compiled results or the binding made it; the per-cluster check
(`CompiledCluster.check`) then says which cluster, where the mismatch is inside one.

The replay starts from the random generators' state the plan started from, so that dropout masks are
the same, and leaves them where the plan left them.
"""
from __future__ import annotations

import torch

from ..diagnostics import warn_once
from ..exec.compare import mismatch
from ..frontend.random_state import get_rng_state, set_rng_state
from ..frontend.replay import Program
from ..frontend.trace import Trace
from ..metrics import METRICS

__all__ = ["StepCheck"]


class _RandomState:
    """The random generators a step may draw from (the CPU's and, on a GPU, its device's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = get_rng_state()
        self.cuda = get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        set_rng_state(self.cpu)
        if self.cuda is not None:
            set_rng_state(self.cuda, self.device)


class StepCheck:
    """Made before a plan runs (a compiled plan may write the step's inputs in place): copies of the
    inputs and the random generators' state; `compare` then replays the step on them."""

    def __init__(self, trace: Trace, inputs: list, device: torch.device) -> None:
        n_storages = len(trace.storage_inputs)
        self.inputs = [t.clone() if k < n_storages else t for k, t in enumerate(inputs)]
        self.random = _RandomState(device)

    def compare(self, program: Program, trace: Trace, outputs: tuple, results: list) -> None:
        """Compare `results` (one per `outputs` entry) with `program` run eagerly."""
        METRICS.numerics_checks += 1
        ended = _RandomState(self.random.device)
        self.random.restore()
        try:
            expected = program(*self.inputs)
        finally:
            ended.restore()
        for (kind, index), got, want in zip(outputs, results, expected):
            message = mismatch(got, want)
            if message is None:
                continue
            what = _describe(trace, kind, index)
            text = "the step's %s diverges from eager: %s" % (what, message)
            METRICS.numerics_mismatches.append(text)
            warn_once("check-step:" + what, "pydisc numerics check: " + text)


def _describe(trace: Trace, kind: str, index: int) -> str:
    """Which result: the value an op made, or an input written in place, with the op and its line."""
    if kind == "value":
        for e in trace.entries:
            if index in e.out_vids:
                return "value made by %s%s" % (e.fn, " at " + e.source if e.source else "")
        return "value v%d" % index
    storage = trace.input_storages[index]
    writer = next((e for e in reversed(trace.entries) if any(s is storage for s in e.writes)), None)
    if writer is None:
        return "input %d" % index
    return "input %d written by %s%s (a parameter, buffer, gradient or optimizer state)" % (
        index, writer.fn, " at " + writer.source if writer.source else "")
