"""Where the time of one very large step goes: recording, functionalization, partitioning, emission,
IREE compile, and the first run.

The step is a chain of `--ops` recorded ops on a (4, 8) float32 tensor: a small matmul, tanh, a
multiply by a Python float (a lifted scalar input) and an add of the step's input, repeated. Each phase
is timed by wrapping pydisc's own functions, and the result is compared with eager PyTorch.

    python bench/big_step.py --ops 2000
    python bench/big_step.py --ops 20000 --profile phase.prof    # cProfile of the planning thread
"""
from __future__ import annotations

import argparse
import cProfile
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

# Lets `python bench/big_step.py` run from a checkout without installing pydisc.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pydisc  # noqa: E402
import pydisc.cluster  # noqa: E402
import pydisc.exec  # noqa: E402
import pydisc.exec.compiler  # noqa: E402
import pydisc.frontend.emit  # noqa: E402
import pydisc.driver.plan  # noqa: E402
import pydisc.driver.step  # noqa: E402
from pydisc.frontend.lazy_tensor import RECORDER  # noqa: E402


def chain(x: torch.Tensor, w: torch.Tensor, ops: int) -> torch.Tensor:
    """`ops` recorded ops (a multiple of 4): matmul, tanh, multiply by a float, add the input."""
    y = x
    for _ in range(ops // 4):
        y = torch.tanh(y @ w) * 0.5 + x
    return y


def _timed(owner, name: str, totals: dict, calls: dict) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - started
            calls[name] += 1

    setattr(owner, name, wrapper)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--profile", default="", help="write a cProfile of mark_step (planning included) here")
    args = ap.parse_args()
    warnings.simplefilter("always")
    caught = []
    warnings.showwarning = lambda message, *rest: caught.append(str(message))
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    _timed(pydisc.driver.plan, "functional_graph", totals, calls)        # make_fx + functionalize + decompositions
    _timed(pydisc.cluster, "partition_graph", totals, calls)
    _timed(pydisc.frontend.emit, "emit_cluster", totals, calls)
    _timed(pydisc.exec.compiler, "_compile", totals, calls)       # iree-compile itself
    _timed(pydisc.exec, "compile_module", totals, calls)          # compile + load (or cache hit)
    # plan on this thread, so that cProfile sees it (mark_step is not called from inside dispatch here)
    pydisc.driver.planning.build_plan = pydisc.driver.plan._build

    torch.manual_seed(0)
    w, x = torch.randn(8, 8) * 0.3, torch.randn(4, 8)
    want = chain(x, w, args.ops)
    lazy_x, lazy_w = pydisc.to_lazy(x.clone()), pydisc.to_lazy(w.clone())
    started = time.perf_counter()
    y = chain(lazy_x, lazy_w, args.ops)
    record = time.perf_counter() - started
    entries = len(RECORDER.trace.entries)
    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    pydisc.mark_step()
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    mark = time.perf_counter() - started
    got = y.cpu()
    started = time.perf_counter()
    y = chain(lazy_x, lazy_w, args.ops)
    record2 = time.perf_counter() - started
    started = time.perf_counter()
    pydisc.mark_step()
    mark2 = time.perf_counter() - started
    error = (got - want).abs().max().item()
    m = pydisc.metrics()
    print("ops recorded: %d, clusters: %d, compiles: %d, max |pydisc - eager| = %.2e"
          % (entries, m["clusters"], m["compiles"], error))
    print("record:            %8.2f s  (%.0f us/op)" % (record, 1e6 * record / max(entries, 1)))
    print("mark_step (first): %8.2f s" % mark)
    for name, label in [("functional_graph", "make_fx/functionalize"), ("partition_graph", "partition"),
                        ("emit_cluster", "emit"), ("_compile", "iree-compile"),
                        ("compile_module", "compile+load")]:
        print("  %-22s %8.2f s  (%d calls)" % (label, totals[name], calls[name]))
    accounted = totals["functional_graph"] + totals["partition_graph"] + totals["emit_cluster"] + \
        totals["compile_module"]
    print("  %-22s %8.2f s" % ("rest", mark - accounted))
    print("second step: record %.2f s, mark_step %.3f s (plan reused)" % (record2, mark2))
    if m["recompiles"]:
        print("recompiles:", m["recompiles"])
    for message in caught:
        print("warning:", message[:2000])
    return 0 if error < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
