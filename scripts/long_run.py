#!/usr/bin/env python3
"""Train the MNIST example's MLP for many steps and print what the process holds along the way: host
memory and every table of pydisc that could grow per step (a markdown table, for docs/robustness.md).

    python scripts/long_run.py                    # 2,000 steps, readings at 1, 10, 200, 500, 1000, 2000
    python scripts/long_run.py --steps 10000 --every 1000

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
    args = ap.parse_args()
    if args.every:
        readings = {1, *range(args.every, args.steps + 1, args.every)}
    else:
        readings = {s for s in (1, 10, 200, 500, 1000, 2000) if s <= args.steps} | {args.steps}
    started = time.perf_counter()
    prints, losses = train_mnist_mlp(args.steps, readings)
    elapsed = time.perf_counter() - started
    print(Footprint.header())
    for p in prints:
        print(p.row())
    print("\n%d steps in %.1f s; loss %.4f -> %.4f" % (args.steps, elapsed, losses[0], losses[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
