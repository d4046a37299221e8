"""`python -m pydisc.precompile SHAPE_LOG [--device cpu|cuda]`: compile the clusters a previous run
logged (PYDISC_SHAPE_LOG) into the persistent compile cache, so the next run compiles nothing."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .driver.shape_log import read_log
from .exec import compile_module
from .metrics import METRICS

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pydisc.precompile", description=__doc__)
    parser.add_argument("log", help="a shape log written by a run with PYDISC_SHAPE_LOG=path")
    parser.add_argument("--device", default=None,
                        help="compile for this device (default: the device each cluster ran on)")
    args = parser.parse_args(argv)
    entries = read_log(args.log)
    started = time.perf_counter()
    failed = 0
    for i, entry in enumerate(entries, 1):
        device = torch.device(args.device or entry["device"])
        if device.type == "cuda" and not torch.cuda.is_available():
            print("skip %s: no CUDA device here" % entry["sha256"][:16])
            continue
        try:
            compile_module(entry["mlir"], device, entry.get("input_type", "stablehlo"))
        except Exception as exc:   # report and go on: one bad entry should not stop the warm-up
            failed += 1
            print("cluster %d/%d (%s) failed: %s" % (i, len(entries), entry["sha256"][:16],
                                                     str(exc).splitlines()[0]))
            continue
        print("cluster %d/%d ready (%s)" % (i, len(entries), entry["sha256"][:16]), flush=True)
    print("%d clusters: %d compiled, %d already cached, %d failed, %.1f s" % (
        len(entries), METRICS.compiles, METRICS.cache_hits, failed, time.perf_counter() - started))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
