"""Optimizer state that lives outside the step, put back when a step is abandoned.

torch's optimizers keep their step counters as eager CPU tensors (unless `capturable`), so that bias
corrections are Python numbers rather than device reads, and increment them in place when `step()`
runs, i.e. while pydisc records. When the step is then abandoned (it ran out of memory at
`mark_step`, an op failed), the recorded updates of parameters and lazy state never happen, but those
counters have moved on: Adam would correct its next step's bias for one step too many.

So before each `optimizer.step()` of an optimizer of lazy parameters, the eager tensors of its state
are noted (a 0-d one by its value) once per step; `abandoned()` writes the notes back and
`completed()` (at each `mark_step`) drops them.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..frontend.lazy_tensor import LazyTensor

__all__ = ["install_optimizer_hook", "completed", "abandoned", "taken", "restore"]

_NOTES: dict[int, tuple[torch.Tensor, object]] = {}    # id -> (eager state tensor, value before the step)
_installed = False


def install_optimizer_hook() -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_before_step)
        _installed = True


def _before_step(optimizer, args, kwargs) -> None:
    # lazy() converts whole modules: the first parameter of a group says whether it is pydisc's
    if not any(group["params"] and isinstance(group["params"][0], LazyTensor) for group in optimizer.param_groups):
        return
    notes = _NOTES
    for state in optimizer.state.values():
        for value in state.values():
            if type(value) is torch.Tensor and id(value) not in notes:
                notes[id(value)] = (value, value.item() if value.dim() == 0 else value.clone())


def completed() -> None:
    _NOTES.clear()


def abandoned() -> None:
    restore(_NOTES)
    _NOTES.clear()


def taken() -> dict:
    """The notes of the step being marked, handed to a run that finishes later (driver/inflight.py);
    the next step's notes start empty."""
    notes = dict(_NOTES)
    _NOTES.clear()
    return notes


def restore(notes: dict) -> None:
    """Write `notes` back: that step was abandoned."""
    with torch.no_grad():
        for tensor, before in notes.values():
            if isinstance(before, torch.Tensor):
                tensor.copy_(before)
            else:
                tensor.fill_(before)
