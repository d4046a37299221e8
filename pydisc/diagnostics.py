"""What pydisc tells the user: warnings, logs, and why a graph was planned again.

`PYDISC_LOG=compiles,recompiles,plans` turns on the `pydisc` logger's lines for each kind of event
(to stderr, unless the application configured logging itself).
"""
from __future__ import annotations

import logging
import sys
import warnings

from .config import CONFIG

__all__ = ["PydiscWarning", "warn_once", "log", "explain_recompile", "call_name", "LOGGER"]

LOGGER = logging.getLogger("pydisc")
if CONFIG.log and not LOGGER.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("pydisc: %(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.setLevel(logging.INFO)


class PydiscWarning(UserWarning):
    """A part of a step that pydisc could not compile and ran eagerly instead."""


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, PydiscWarning, stacklevel=4)


def log(kind: str, message: str, *args) -> None:
    if kind in CONFIG.log:
        LOGGER.info(message, *args)


def _op_of(sig: tuple) -> str:
    return str(sig[0]) if sig else "?"


def explain_recompile(old: tuple, new: tuple, sources: list[str | None]) -> str:
    """Say what differs between the structural keys of two steps (see step.run_pending), naming the
    first differing input or op and, when known, the user code line it came from."""
    names = ("input storage", "eager input", "lazy input view")
    for part, name in zip(range(3), names):
        a, b = old[part], new[part]
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return "%s %d changed: %s -> %s" % (name, i, _short(x), _short(y))
        if len(a) != len(b):
            return "number of %ss changed: %d -> %d" % (name, len(a), len(b))
    old_ops, new_ops = old[3], new[3]
    for i, (x, y) in enumerate(zip(old_ops, new_ops)):
        if x != y:
            where = " at %s" % sources[i] if i < len(sources) and sources[i] else ""
            if x[0] != y[0]:
                return "op #%d changed: %s -> %s%s" % (i, _op_of(x), _op_of(y), where)
            if x[0] == "fused" and x[1] != y[1]:
                return "op #%d (a forward recorded at __torch_function__%s): %s" % (i, where, _call_changed(x[1], y[1]))
            for a, b in zip(x, y):
                if a != b:
                    return "op #%d (%s) argument changed: %s -> %s%s" % (i, _op_of(y), _short(a), _short(b), where)
            return "op #%d (%s) arguments changed%s" % (i, _op_of(y), where)
    if len(old_ops) != len(new_ops):
        i = min(len(old_ops), len(new_ops))
        where = " at %s" % sources[i] if i < len(sources) and sources[i] else ""
        return "step has %d ops instead of %d (first extra or missing op #%d%s)" % (
            len(new_ops), len(old_ops), i, where)
    if old[4] != new[4]:
        return "number of lifted scalars changed: %d -> %d" % (old[4], new[4])
    return "a different set of live tensors is needed after the step (outputs %d -> %d)" % (len(old[5]), len(new[5]))


def call_name(func) -> str:
    """A function's name as user code calls it (`Tensor.view`, `torch.addmm`, `linear`)."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return name.replace("_TensorBase.", "Tensor.").replace("TensorBase.", "Tensor.").replace(
        "_VariableFunctionsClass.", "torch.")


def _call_changed(old: tuple, new: tuple) -> str:
    """What differs between the calls two forwards made (each call: its function, grad mode, autocast
    dtype, then its arguments' encoding and layouts)."""
    for k, (x, y) in enumerate(zip(old, new)):
        if x[0] != y[0]:
            return "call #%d changed: %s -> %s" % (k, call_name(x[0]), call_name(y[0]))
        if x != y:
            for a, b in zip(x[1:], y[1:]):
                if a != b:
                    return "call #%d (%s) argument changed: %s -> %s" % (k, call_name(y[0]), _short(a), _short(b))
            return "call #%d (%s) arguments changed" % (k, call_name(y[0]))
    k = min(len(old), len(new))
    extra = new[k] if len(new) > k else old[k]
    return "it made %d calls instead of %d (first extra or missing call #%d: %s)" % (
        len(new), len(old), k, call_name(extra[0]))


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."
