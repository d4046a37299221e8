#!/usr/bin/env python3
"""Long differential-fuzzing runs of pydisc against eager PyTorch.

    python scripts/fuzz.py --examples 2000            # random seeds, programs of up to 8 steps
    python scripts/fuzz.py --examples 500 --max-steps 16 --seed 7
    python scripts/fuzz.py --examples 300 --no-avoid   # also draw the patterns of known (xfail) bugs

The programs and the comparison are those of tests/robustness/test_fuzz.py (see
tests/robustness/fuzz_graphs.py). Every failing program is printed as Python source and appended to
--log; by default the run continues after a failure (hypothesis shrinks it first unless --no-shrink).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "robustness"))

import warnings  # noqa: E402

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

import fuzz_graphs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=200, help="programs per round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds (each continues after failures)")
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--no-avoid", action="store_true", help="also generate patterns of known bugs")
    ap.add_argument("--log", default="fuzz_failures.txt")
    args = ap.parse_args()
    if args.no_avoid:
        for k in fuzz_graphs.AVOID:
            fuzz_graphs.AVOID[k] = False
    warnings.simplefilter("ignore")
    phases = [Phase.explicit, Phase.generate] + ([] if args.no_shrink else [Phase.shrink])
    counter = {"n": 0, "failures": 0}
    started = time.time()

    @settings(max_examples=args.examples, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(fuzz_graphs.programs(max_steps=args.max_steps))
    def fuzz(prog):
        counter["n"] += 1
        if counter["n"] % 25 == 0:
            print("[fuzz] %d programs, %.0f s" % (counter["n"], time.time() - started), flush=True)
        fuzz_graphs.check_program(prog, data_offsets=(0, 1))

    if args.seed is not None:
        fuzz = __import__("hypothesis").seed(args.seed)(fuzz)
    for r in range(args.rounds):
        try:
            fuzz()
        except Exception as exc:  # noqa: BLE001 -- report and go on with the next round
            counter["failures"] += 1
            text = "".join(traceback.format_exception_only(type(exc), exc))
            print("[fuzz] FAILURE in round %d:\n%s" % (r, text), flush=True)
            with open(args.log, "a") as f:
                f.write("=== round %d, %s\n%s\n" % (r, time.strftime("%Y-%m-%d %H:%M:%S"), text))
            fuzz_graphs.reset_pending()
    print("[fuzz] done: %d programs, %d failing rounds, %.0f s" % (counter["n"], counter["failures"],
                                                               time.time() - started))
    return 1 if counter["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
