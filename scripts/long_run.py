#!/usr/bin/env python3
"""Train the MNIST example's MLP for many steps and print what the process holds along the way: host
memory and every table of pydisc that could grow per step (a markdown table, for docs/robustness.md);
on a GPU also the device memory (in torch's tensors, reserved by its allocator, used by anyone).

    python scripts/long_run.py                    # 2,000 steps, readings at 1, 10, 200, 500, 1000, 2000
    python scripts/long_run.py --steps 10000 --every 1000
    python scripts/long_run.py --device cuda      # the same on the GPU, with the CUDA memory columns

The same run, with assertions, is tests/robustness/test_long_runs.py (`pytest --long`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "robustness"))

from long_runs import Footprint, train_mnist_mlp  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=0, help="a reading every N steps (default: a fixed set)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    args = ap.parse_args()
    if args.every:
        readings = {1, *range(args.every, args.steps + 1, args.every)}
    else:
        readings = {s for s in (1, 10, 200, 500, 1000, 2000) if s <= args.steps} | {args.steps}
    started = time.perf_counter()
    prints, losses = train_mnist_mlp(args.steps, readings, device=args.device)
    elapsed = time.perf_counter() - started
    cuda = args.device.startswith("cuda")
    print(Footprint.header(cuda))
    for p in prints:
        print(p.row(cuda))
    print("\n%d steps on %s in %.1f s; loss %.4f -> %.4f" % (args.steps, args.device, elapsed, losses[0],
                                                          losses[-1]))
    if cuda and len(prints) > 2:
        warm, last = prints[2], prints[-1]   # from the third reading (step 200 by default): after warm-up
        print("from step %d to %d: CUDA allocated %+.1f MB, reserved %+.1f MB, used %+.1f MB; RSS %+.1f MB" % (
            warm.step, last.step, last.cuda_allocated_mb - warm.cuda_allocated_mb,
            last.cuda_reserved_mb - warm.cuda_reserved_mb, last.cuda_used_mb - warm.cuda_used_mb,
            last.rss_mb - warm.rss_mb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
