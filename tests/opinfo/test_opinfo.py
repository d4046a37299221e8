"""A CI slice of the OpInfo sweep: core ops whose samples must all compile and match eager.

The full sweep (every Core ATen OpInfo entry, every dtype) is `python -m tests.opinfo.sweep`, or these
tests with PYDISC_OPINFO_FULL=1; it writes docs/ops.md.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("expecttest")  # needed by torch's op_db

from .harness import full_name, run_case  # noqa: E402

f32, bf16, i64, b8 = torch.float32, torch.bfloat16, torch.int64, torch.bool

FORWARD_F32 = [
    "add", "sub", "mul", "div.no_rounding_mode", "div.floor_rounding", "neg", "abs", "exp", "log",
    "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "atan2", "pow", "where", "clamp", "maximum", "eq", "lt",
    "sum", "mean", "amax", "argmax", "max.reduction_with_dim", "var", "prod", "mm", "bmm", "addmm",
    "cat", "permute", "expand", "squeeze", "select", "flip", "constant_pad_nd", "gather",
    "index_select", "scatter_add", "cumsum", "full", "nn.functional.relu", "nn.functional.embedding",
    "nn.functional.max_pool2d", "sort", "tan", "scatter_reduce.amax", "nn.functional.pad.reflect",
]
BACKWARD_F32 = [
    "mul", "div.no_rounding_mode", "tanh", "sum", "mean", "amax", "addmm", "cat", "gather", "softmax",
    "log_softmax", "nn.functional.gelu", "nn.functional.conv2d", "nn.functional.layer_norm",
    "nn.functional.max_pool2d", "nn.functional.interpolate.nearest", "nn.functional.adaptive_avg_pool2d",
]
OTHER = [
    ("add", bf16, False), ("mul", bf16, True), ("sum", bf16, True), ("mm", bf16, False),
    ("softmax", bf16, True), ("nn.functional.layer_norm", bf16, True),
    ("add", i64, False), ("mul", i64, False), ("sum", i64, False), ("remainder", i64, False),
    ("cumsum", i64, False), ("argmax", i64, False),
    ("logical_and", b8, False), ("eq", b8, False), ("any", b8, False), ("where", b8, False),
]
CASES = [(n, f32, False) for n in FORWARD_F32] + [(n, f32, True) for n in BACKWARD_F32] + OTHER
SAMPLES = 3

FULL = os.environ.get("PYDISC_OPINFO_FULL") == "1"


@functools.cache
def _ops() -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    return {full_name(op): op for op in op_db}


def _case_id(case: tuple) -> str:
    name, dtype, grad = case
    return f"{name}-{str(dtype).removeprefix('torch.')}" + ("-grad" if grad else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_opinfo_slice(case: tuple) -> None:
    name, dtype, grad = case
    result = run_case(_ops()[name], dtype, grad=grad, max_samples=SAMPLES)
    assert result.outcomes, f"{name}: no sample ran"
    bad = [o for o in result.outcomes if o.kind != "compiled"]
    assert not bad, "\n".join(f"{o.kind}: {o.detail}" for o in bad)


@pytest.mark.skipif(not FULL, reason="the full sweep runs with PYDISC_OPINFO_FULL=1")
def test_opinfo_full_sweep() -> None:
    from .sweep import main

    assert main([]) == 0
