"""torch's random generators read or set while a step holds random draws not yet made.

A lazy random op (dropout's mask, `rand_like` of a lazy tensor) draws its numbers when the step runs,
from torch's generator, in program order: the numbers eager draws, as long as nothing else uses the
generator between the op and the run. Code that reads or sets a generator's state in between expects
the draws before it to have been made:
- `torch.utils.checkpoint` saves the state before a checkpointed forward and puts it back to recompute
  that forward in the backward, so that the recomputation draws the forward's dropout masks. Drawn at the
  run, the recomputation's masks came after the forward's, different from them: the gradients were
  those of other masks (silently);
- `torch.random.fork_rng`, `torch.manual_seed` or `torch.set_rng_state` between a forward and
  `mark_step`: the draws made at the run came from the state set later.

So while a step holds draws not yet made, torch's functions that read or set a generator's state
(`torch.get_rng_state`, `set_rng_state`, `manual_seed`, `seed`, and their `torch.cuda` forms, which
`fork_rng` and `checkpoint` call) first run what is pending, as a read of a value would (counted in
`metrics()["random_state_runs"]`); a forward recorded at `__torch_function__` that drew is re-recorded
by the dispatcher first (`fast_demotions`). They are installed at import, as `to_dlpack` is. A step
that draws nothing pays one check per call. Not covered: a generator's own methods
(`torch.default_generator.set_state`, a `torch.Generator` passed to an op), and random numbers drawn
eagerly (into eager tensors) between a lazy random op and the run, which come before the lazy op's
instead of after. Those cannot be put right when the step runs, but they are not silent: a trace notes
the generators' states at its first random op (`Trace.rng_note`), and `check_order` warns before the
run where they moved (`metrics()["random_order_changes"]`, docs/robustness.md).
"""
from __future__ import annotations

import functools
import threading

import torch

from .. import metrics as _metrics
from ..diagnostics import warn_once
from .fused import FusedStep
from .lazy_tensor import RECORDER
from .op_facts import draws as _op_draws
from .fast_state import FAST

__all__ = ["install_random_state", "pending_draws", "entry_draws", "get_rng_state", "set_rng_state", "check_order",
           "renote"]

METRICS = _metrics.METRICS
_thread = threading.get_ident
# the functions that read or set a generator's state, by the module that holds them (torch re-exports
# torch.random's, torch.cuda torch.cuda.random's: both names are replaced)
_READ_OR_SET = ("get_rng_state", "set_rng_state", "manual_seed", "seed")
_CUDA_READ_OR_SET = _READ_OR_SET + ("get_rng_state_all", "set_rng_state_all", "manual_seed_all", "seed_all")


def entry_draws(entry) -> bool:
    """Whether a trace entry draws random numbers when the step runs."""
    fn = entry.fn
    if type(fn) is FusedStep:
        return fn.draws > 0
    return _op_draws(fn, entry.args, entry.kwargs)


def pending_draws() -> bool:
    """Whether this thread's step holds random draws not yet made."""
    seg = FAST.segment
    if seg is not None and seg.draws and FAST.owner == _thread():
        return True
    entries = RECORDER.trace.entries
    return bool(entries) and any(entry_draws(e) for e in entries)


def _make_pending_draws() -> None:
    with RECORDER.lock:
        seg = FAST.segment
        if seg is not None and seg.draws and FAST.owner == _thread():
            with torch._C.DisableTorchFunctionSubclass():
                seg.demote("the random generator's state read or set")     # its calls, draws included, join the trace
        if any(entry_draws(e) for e in RECORDER.trace.entries):
            METRICS.random_state_runs += 1
            RECORDER.run(None, "random state")


def _guarded(original):
    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if pending_draws():
            _make_pending_draws()
        return original(*args, **kwargs)

    guarded.pydisc_original = original
    return guarded


def install_random_state() -> None:
    """Replace torch's functions that read or set a generator's state with guarded ones (once)."""
    for module, names in ((torch, _READ_OR_SET), (torch.random, _READ_OR_SET), (torch.cuda, _CUDA_READ_OR_SET),
                          (torch.cuda.random, _CUDA_READ_OR_SET)):
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None and not hasattr(fn, "pydisc_original"):
                setattr(module, name, _guarded(fn))


def _unguarded(fn):
    return getattr(fn, "pydisc_original", fn)


def get_rng_state(device: torch.device | None = None) -> torch.Tensor:
    """The state of the CPU's generator, or of `device`'s, read without the guard (pydisc's own saves)."""
    if device is None or device.type == "cpu":
        return _unguarded(torch.random.get_rng_state)()
    return _unguarded(torch.cuda.random.get_rng_state)(device)


def set_rng_state(state: torch.Tensor, device: torch.device | None = None) -> None:
    """Put back a state `get_rng_state` read, without the guard."""
    if device is None or device.type == "cpu":
        _unguarded(torch.random.set_rng_state)(state)
    else:
        _unguarded(torch.cuda.random.set_rng_state)(state, device)


ORDER_CHANGED = (
    "pydisc: torch's random generator was used outside the step (random numbers drawn into eager tensors, "
    "or a torch.Generator's own methods) after the step recorded random ops (dropout, randn_like of a lazy "
    "tensor), which draw when the step runs: their numbers and the others come in another order than in "
    "eager, so both differ from eager's (with the same distribution). For eager's numbers, draw the eager "
    "ones before the step's random ops, or from lazy tensors (pydisc.to_lazy). Counted in "
    "metrics()['random_order_changes']; docs/robustness.md#determinism.")


def _state(index):
    return torch.default_generator.get_state() if index is None else torch.cuda.default_generators[index].get_state()


def check_order(trace) -> None:
    """Before `trace` runs: warn where torch's generators are not where its first random op found them
    (`Trace.rng_note`), so that its draws are not eager's. A read of the generator's state through
    torch's functions runs the step first (the guard above): what is left is drawing, or a generator's
    own methods, between the op and the run."""
    note = trace.rng_note
    if note is None:
        return
    for index, state in note:
        if not torch.equal(_state(index), state):
            METRICS.random_order_changes += 1
            warn_once("random order", ORDER_CHANGED)
            break


def renote(trace, before: list | None) -> None:
    """After a run that left part of `trace` pending (a read): its random ops left draw from here on."""
    if before is not None and trace.entries and any(entry_draws(e) for e in trace.entries):
        trace.rng_note = [(index, _state(index)) for index, _ in before]
    else:
        trace.rng_note = None
