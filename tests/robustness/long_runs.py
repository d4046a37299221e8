"""What a long run holds on to: host memory and every structure of pydisc that could grow per step.

`footprint()` takes one reading; `train_mnist_mlp` trains the MLP of examples/mnist.py (scikit-learn's
8x8 digits, SGD with momentum, one `mark_step` per step) and takes readings at the steps asked for.
Used by tests/robustness/test_long_runs.py and by scripts/long_run.py, which prints the figures.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import pydisc
import pydisc.step as pstep
from pydisc.exec import compiler
from pydisc.frontend import lazy_tensor
from pydisc.frontend.lazy_tensor import RECORDER, LazyTensor
from pydisc.metrics import METRICS

REPO = Path(__file__).resolve().parents[2]
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Footprint:
    step: int
    rss_mb: float               # resident set size now (/proc/self/statm)
    max_rss_mb: float           # peak resident set size of the process so far (getrusage)
    lazy_tensors: int           # live LazyTensor objects
    pending_entries: int        # recorded ops of the pending trace
    trace_tensors: int          # weak references the pending trace keeps
    plans: int                  # pydisc.step._PLANS
    seen_ops: int               # pydisc.step._SEEN_OPS (recompile explanations)
    vmfb_cache: int             # compiled executables kept in memory
    module_cache: int           # loaded modules kept in memory
    meta_cache: int             # output metadata per (op, input layouts)
    op_infos: int               # schema facts per ATen op
    metric_entries: int         # list/dict entries of the metrics (recompiles, sources, ...)
    gc_objects: int             # objects the cyclic GC tracks

    def row(self) -> str:
        return " | ".join(str(v) if not isinstance(v, float) else "%.1f" % v for v in asdict(self).values())

    @staticmethod
    def header() -> str:
        names = list(Footprint.__dataclass_fields__)
        return " | ".join(names) + "\n" + " | ".join("---" for _ in names)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def footprint(step: int) -> Footprint:
    gc.collect()
    objects = gc.get_objects()
    lazy = sum(1 for o in objects if type(o) is LazyTensor)   # parameters too: their class is LazyTensor
    metric_entries = sum(len(v) for v in vars(METRICS).values() if isinstance(v, (list, dict, set)))
    return Footprint(
        step=step,
        rss_mb=rss_mb(),
        max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        lazy_tensors=lazy,
        pending_entries=len(RECORDER.trace.entries),
        trace_tensors=len(RECORDER.trace.tensors),
        plans=len(pstep._PLANS),
        seen_ops=len(pstep._SEEN_OPS),
        vmfb_cache=len(compiler._VMFB_CACHE),
        module_cache=len(compiler._MODULE_CACHE),
        meta_cache=len(RECORDER.meta_cache),
        op_infos=len(lazy_tensor._OPINFO),
        metric_entries=metric_entries,
        gc_objects=len(objects),
    )


def mnist_example():
    """examples/mnist.py, imported once (not a package; dataclasses need it in sys.modules)."""
    name = "pydisc_example_mnist"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "mnist.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def train_mnist_mlp(steps: int, readings: set[int], batch_size: int = 64) -> tuple[list[Footprint], list[float]]:
    """Train the example's MLP for `steps` steps with pydisc; a footprint after each step in `readings`.
    Returns the footprints and the losses."""
    mnist = mnist_example()
    data = mnist.load_digits()
    torch.manual_seed(0)
    model = pydisc.lazy(mnist.MLP(data.train_x.shape[-1]))
    optimizer = mnist.OPTIMIZERS["sgd"](model.parameters())
    losses, prints = [], []
    for step, idx in enumerate(mnist.fixed_batches(len(data.train_y), batch_size, steps), start=1):
        losses.append(mnist.train_step(model, optimizer, data.train_x[idx], data.train_y[idx], lazy=True))
        if step in readings:
            prints.append(footprint(step))
    return prints, losses
