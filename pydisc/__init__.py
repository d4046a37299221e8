"""pydisc: a lazy-tensor compiler for PyTorch built on StableHLO and IREE.

    model = pydisc.lazy(model)          # parameters and buffers become lazy tensors
    ...train step...
    pydisc.mark_step()                  # compile (or reuse) and run everything recorded
"""
from __future__ import annotations

import atexit
import gc

import torch

from .diagnostics import PydiscWarning
from .config import CONFIG
from .driver import background, inflight, step_choice
from .driver.dynamic import mark_dynamic
from .driver.engine import ENGINE
from .driver.step import clear_plans
from .exec import clear_cache
from .frontend import fast
from .frontend.collectives import install_collectives
from .frontend.lazy_tensor import RECORDER, LazyTensor, StrictModeError, is_lazy
from .frontend.lazy_tensor import to_lazy as _to_lazy
from .frontend.random_state import install_random_state
from .frontend.rewrites import install_rewrites
from .frontend.symbolic import release_factory_mode
from .frontend.tensor import install_to_dlpack
from ._version import __version__
from .metrics import METRICS
from .module import lazy
from .driver.optimizer_state import install_optimizer_hook
from .report import metrics_report
from .driver.step import run_pending

__all__ = ["lazy", "mark_step", "mark_dynamic", "is_lazy", "to_lazy", "metrics", "reset_metrics", "metrics_report",
           "LazyTensor", "PydiscWarning", "StrictModeError", "wait_for_compiles", "synchronize", "__version__"]

install_rewrites()
install_collectives()     # after the rewrites: it wraps any rewrite of copy_
fast.set_default(CONFIG.fast_record)     # (the handler is installed at the first forward it records)
install_optimizer_hook()
install_to_dlpack()
install_random_state()


@atexit.register
def _release_compiled() -> None:
    # Free IREE modules and devices before the interpreter tears down the runtime bindings (a step still
    # running on the worker finishes first: clear_plans waits for it, and may raise that step's error).
    try:
        clear_plans()
    finally:
        clear_cache()
        gc.collect()


def mark_step() -> None:
    """Run everything recorded since the last mark. Afterwards every live lazy tensor holds device
    data and the recorded graph is dropped. A no-op when nothing is pending."""
    METRICS.mark_steps += 1
    ENGINE.note_thread()
    if RECORDER.released and not RECORDER.trace.entries and not background.pending() and \
            not step_choice.measuring():
        return      # steps run eagerly now (pydisc/driver/step_choice.py): nothing was recorded
    run_pending(None, "mark_step")
    release_factory_mode()


def synchronize() -> None:
    """Block until the step that `mark_step()` left running on the worker thread (on the CPU, `PYDISC_ASYNC`)
    has run and its results are bound, as `torch.cuda.synchronize()` does for a GPU. Reads of lazy tensors
    wait by themselves; call this before timing steps, or before you hand memory pydisc reads to other
    code. Returns at once if no step is running."""
    inflight.wait("synchronize")


def wait_for_compiles() -> None:
    """Block until the step plans being built in the background (`PYDISC_BACKGROUND_COMPILE`, on CUDA
    by default) are ready; the next step then records and runs compiled. Returns at once if none are."""
    background.join()      # without the recorder's lock: planning may take it
    with RECORDER.lock:
        background.collect()


def to_lazy(t):
    """`t` (a tensor, or a list/tuple/dict of them) as lazy tensors on the same device, without a
    copy: inputs of the step, like the arguments of a `pydisc.lazy` module."""
    ENGINE.note_thread()
    if RECORDER.released:
        return t    # steps run eagerly now (pydisc/driver/step_choice.py): inputs stay plain, as the module's do
    release_factory_mode()
    if isinstance(t, torch.Tensor):
        return _to_lazy(t, step_input=True)
    if isinstance(t, (list, tuple)):
        return type(t)(to_lazy(x) for x in t)
    if isinstance(t, dict):
        return {k: to_lazy(v) for k, v in t.items()}
    return t


def __getattr__(name: str):
    if name == "distributed":     # `pydisc.distributed` (imports torch.distributed when first used)
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError("module 'pydisc' has no attribute %r" % name)


def metrics() -> dict:
    """A snapshot of pydisc's counters (compiles, cache_hits, executions, clusters, fallback_ops, ...), after
    the step still running on the worker thread, if any, has finished (`synchronize`)."""
    synchronize()
    return METRICS.snapshot()


def reset_metrics() -> None:
    METRICS.reset()
