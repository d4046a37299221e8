"""What a long run holds on to: host memory, device memory and every structure of pydisc that could grow
per step.

`footprint()` takes one reading; `train_mnist_mlp` trains the MLP of examples/mnist.py (scikit-learn's
8x8 digits, SGD with momentum, one `mark_step` per step) on the CPU or a GPU and takes readings at the
steps asked for. Used by tests/robustness/test_long_runs.py and by scripts/long_run.py, which prints the
figures.
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
from pydisc.driver.engine import ENGINE
from pydisc.exec import compiler
from pydisc.frontend import op_facts
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
    plans: int                  # ENGINE.plans
    seen_ops: int               # ENGINE.seen_ops (recompile explanations)
    vmfb_cache: int             # compiled executables kept in memory
    module_cache: int           # loaded modules kept in memory
    meta_cache: int             # output metadata per (op, input layouts)
    op_infos: int               # schema facts per ATen op
    metric_entries: int         # list/dict entries of the metrics (recompiles, sources, ...)
    gc_objects: int             # objects the cyclic GC tracks
    cuda_allocated_mb: float = 0.0   # in torch's tensors on the device (torch.cuda.memory_allocated)
    cuda_reserved_mb: float = 0.0    # held by torch's caching allocator (torch.cuda.memory_reserved)
    cuda_used_mb: float = 0.0        # used on the device by anyone, IREE included (mem_get_info)

    def row(self, cuda: bool = False) -> str:
        return " | ".join(str(v) if not isinstance(v, float) else "%.1f" % v
                          for k, v in asdict(self).items() if cuda or not k.startswith("cuda_"))

    @staticmethod
    def header(cuda: bool = False) -> str:
        names = [k for k in Footprint.__dataclass_fields__ if cuda or not k.startswith("cuda_")]
        return " | ".join(names) + "\n" + " | ".join("---" for _ in names)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def footprint(step: int, device: torch.device | str = "cpu") -> Footprint:
    device = torch.device(device)
    pydisc.synchronize()    # no step still running on the worker thread (PYDISC_ASYNC): a quiescent reading
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
        plans=len(ENGINE.plans),
        seen_ops=len(ENGINE.seen_ops),
        vmfb_cache=len(compiler._VMFB_CACHE),
        module_cache=len(compiler._MODULE_CACHE),
        meta_cache=len(RECORDER.meta_cache),
        op_infos=len(op_facts.OPINFOS),
        metric_entries=metric_entries,
        gc_objects=len(objects),
        **(_cuda_memory(device) if device.type == "cuda" else {}),
    )


def _cuda_memory(device: torch.device) -> dict:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"cuda_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
            "cuda_reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
            "cuda_used_mb": (total - free) / 2**20}


def mnist_example():
    """examples/mnist.py, imported once (not a package; dataclasses need it in sys.modules)."""
    name = "pydisc_example_mnist"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "mnist.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def train_mnist_mlp(steps: int, readings: set[int], batch_size: int = 64,
                    device: torch.device | str = "cpu") -> tuple[list[Footprint], list[float]]:
    """Train the example's MLP for `steps` steps with pydisc on `device`; a footprint after each step in
    `readings`. Returns the footprints and the losses."""
    mnist = mnist_example()
    data = mnist.load_digits()
    device = torch.device(device)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    torch.manual_seed(0)
    model = pydisc.lazy(mnist.MLP(data.train_x.shape[-1]), device=device)
    optimizer = mnist.OPTIMIZERS["sgd"](model.parameters())
    losses, prints = [], []
    for step, idx in enumerate(mnist.fixed_batches(len(data.train_y), batch_size, steps), start=1):
        idx = idx.to(device)
        losses.append(mnist.train_step(model, optimizer, train_x[idx], train_y[idx], lazy=True))
        if step in readings:
            prints.append(footprint(step, device))
    return prints, losses
