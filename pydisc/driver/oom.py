"""Out of memory during a step: the error raised names what was running (a compiled cluster, an eager
op, the binding) and how much memory it asked for.
"""
from __future__ import annotations

import traceback

import torch

from ..exec.errors import DeviceOutOfMemoryError, is_out_of_memory
from ..frontend.replay import Program
from ..frontend.trace import Trace
from .slices import step_device

__all__ = ["out_of_memory_error", "out_of_memory_in"]


def out_of_memory_in(exc: BaseException) -> bool:
    return is_out_of_memory(exc)


def out_of_memory_error(exc: BaseException, trace: Trace) -> RuntimeError:
    """The error a step that ran out of memory raises: what ran out (the cluster or eager op, how much it
    asked for, what the device has left), what became of the user's tensors, and what to do."""
    device = step_device(trace)
    where = getattr(exc, "where", "") or _eager_op_of(exc)
    nbytes = getattr(exc, "nbytes", None)
    lines = ["pydisc: out of memory on %s running %s%s." % (
        device, where or "the step", " (asking for %s)" % _size(nbytes) if nbytes else "")]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        lines.append("%s has %s free of %s; torch holds %s in tensors and has %s reserved." % (
            device, _size(free), _size(total), _size(torch.cuda.memory_allocated(device)),
            _size(torch.cuda.memory_reserved(device))))
    lines.append("The step was abandoned: parameters, buffers and optimizer state keep the values of the "
                 "last completed step, and what this step computed has no data.")
    orphans = sum(1 for ref in trace.tensors.values() if (t := ref()) is not None and t._real is None)
    if orphans:
        lines.append("%d tensor%s that this step made %s still referenced and %s no data (the loss, "
                     "gradients, the state an optimizer creates in its first step): let go of them before "
                     "the next step (optimizer.zero_grad() drops the gradients; after an optimizer's first "
                     "step, optimizer.state.clear() drops its state)."
                     % (orphans, "s" if orphans > 1 else "", "are" if orphans > 1 else "is",
                        "have" if orphans > 1 else "has"))
    advice = "Lower the batch size (or the sequence length), or free tensors kept alive between steps"
    if device.type == "cuda":
        advice += "; if much memory is reserved but not in tensors, PYTORCH_CUDA_ALLOC_CONF=" \
                  "expandable_segments:True reduces fragmentation"
    lines.append(advice + "; then run the step again.")
    lines.append("(%s: %s)" % (type(exc.__cause__ or exc).__name__, str(exc).strip().splitlines()[0][:300]))
    return DeviceOutOfMemoryError("\n".join(lines), where=where, nbytes=nbytes)


def _eager_op_of(exc: BaseException) -> str:
    """The ATen op that raised `exc` in an eager part of a plan: the innermost frame of a replayed
    `Program` (its `fn`) or of a torch.fx graph's generated code (its source line)."""
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        if frame.f_code is Program.__call__.__code__ and "fn" in frame.f_locals:
            return "eager op %s" % frame.f_locals["fn"]
        if frame.f_code.co_filename.startswith("<eval_with_key>"):
            line = traceback.FrameSummary(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                          lookup_line=True, locals=None).line or ""
            call = line.partition("=")[2].strip().partition("(")[0]
            return "eager op %s" % call.removeprefix("torch.ops.") if call else ""
    return ""


def _size(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return ("%d %s" if unit == "bytes" else "%.1f %s") % (nbytes, unit)
        nbytes /= 1024
    return ""
