"""pydisc: a lazy-tensor compiler for PyTorch built on StableHLO and IREE.

    model = pydisc.lazy(model)          # parameters and buffers become lazy tensors
    ...train step...
    pydisc.mark_step()                  # compile (or reuse) and run everything recorded
"""
from __future__ import annotations

import atexit
import gc

from .diagnostics import PydiscWarning
from .frontend.lazy_tensor import LazyTensor, StrictModeError, is_lazy, to_lazy
from .frontend.rewrites import install_rewrites
from .metrics import METRICS
from .module import lazy
from .report import metrics_report
from .step import run_pending

__all__ = ["lazy", "mark_step", "is_lazy", "to_lazy", "metrics", "reset_metrics", "metrics_report",
           "LazyTensor", "PydiscWarning", "StrictModeError", "__version__"]
__version__ = "0.1.0"

install_rewrites()


@atexit.register
def _release_compiled() -> None:
    # Free IREE modules and devices before the interpreter tears down the runtime bindings.
    from .exec import clear_cache
    from .step import clear_plans
    clear_plans()
    clear_cache()
    gc.collect()


def mark_step() -> None:
    """Run everything recorded since the last mark. Afterwards every live lazy tensor holds device
    data and the recorded graph is dropped. A no-op when nothing is pending."""
    run_pending(None, "mark_step")


def metrics() -> dict:
    """A snapshot of pydisc's counters (compiles, cache_hits, executions, clusters, fallback_ops, ...)."""
    return METRICS.snapshot()


def reset_metrics() -> None:
    METRICS.reset()
