"""Differential fuzzing: random small programs run eagerly and on lazy tensors must agree.

The programs (tests/robustness/fuzz_graphs.py) mix elementwise ops with broadcasting and Python scalars,
reductions, views, in-place ops on tensors and views, matmul, cat, where/comparisons and dtype
conversions, over shapes with 0- and 1-size dims and float32/float16/bfloat16/int64/int32/bool inputs,
some of them eager. Every value, every (possibly written) input and every mid-step read is compared.

CI runs a fixed-seed slice; `python scripts/fuzz.py --examples N` runs long random campaigns.
"""
from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings

from fuzz_graphs import check_program, programs

# No shrinking in CI: every candidate recompiles, and a failure prints its program as source anyway.
CI_PHASES = [Phase.explicit, Phase.generate]
CI_SETTINGS = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck), phases=CI_PHASES)


@CI_SETTINGS
@given(programs(max_steps=6))
def test_random_programs_match_eager(prog):
    check_program(prog, data_offsets=(0, 1))


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck), phases=CI_PHASES)
@given(programs(max_steps=12))
def test_longer_random_programs_match_eager(prog):
    check_program(prog)
