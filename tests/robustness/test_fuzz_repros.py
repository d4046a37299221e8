"""Minimal repros of the bugs found by the differential fuzzer (tests/robustness/fuzz_graphs.py).

Each is xfail(strict=True) until fixed; the fuzzer avoids the pattern while its AVOID switch is on
(remove the xfail and set the switch to False once the bug is fixed).
"""
from __future__ import annotations

import math

import pytest
import torch

import pydisc


def lazy_run(fn, *xs):
    out = fn(*[pydisc.to_lazy(x.clone()) for x in xs])
    pydisc.mark_step()
    return out


def assert_matches(lazy_out, eager_out):
    assert lazy_out.dtype == eager_out.dtype
    assert lazy_out.shape == eager_out.shape
    torch.testing.assert_close(lazy_out.cpu(), eager_out, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zero_dim_half_times_python_float_keeps_dtype(dtype):
    x = torch.tensor(1.5, dtype=dtype)
    assert_matches(lazy_run(lambda t: t * 0.9, x), x * 0.9)


@pytest.mark.xfail(strict=True, reason="bug: 1-D @ 2-D matmul keeps the unsqueezed dim: shape (1, m), eager "
                                       "(m,) (aten.matmul ends with squeeze_, which runs eagerly and does not "
                                       "update the lazy tensor's shape)")
def test_matmul_vector_times_matrix_shape():
    a, b = torch.randn(3), torch.randn(3, 2)
    assert_matches(lazy_run(torch.matmul, a, b), a @ b)


def test_pow_tensor_exponent_zero_and_negative_base():
    base = torch.tensor([0.0, -2.0, -0.0, 2.0])
    exp = torch.tensor([0.0, 2.0, 0.0, 0.5])
    assert_matches(lazy_run(torch.pow, base, exp), torch.pow(base, exp))


def test_pow_scalar_base_zero():
    e = torch.tensor([0.0, 1.0, 2.0])
    assert_matches(lazy_run(lambda t: 0.0 ** t, e), 0.0 ** e)


# found by the fuzzer, fixed in 39eabb6 ("atan2 special cases"): kept as a regression test
def test_atan2_signed_zero_and_zero_zero():
    y = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    x = torch.tensor([-1.0, -1.0, 0.0, 0.0])
    got = lazy_run(torch.atan2, y, x)
    want = torch.atan2(y, x)
    assert_matches(got, want)
    assert [math.copysign(1, v) for v in got.tolist()] == [math.copysign(1, v) for v in want.tolist()]


@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_sin_cos_of_large_arguments(fn):
    # IREE's float32 sine reduced poorly (sin(1e5) off by 3e-3, sin(1e10) = -6e21): fixed by a float64
    # range reduction in the lowering
    x = torch.tensor([12345.678, 1e5, 1e6, 1e10, -3e9, 0.25])
    got = lazy_run(fn, x).cpu()
    assert bool((got.abs() <= 1).all()), got
    torch.testing.assert_close(got, fn(x), atol=1e-4, rtol=0)


@pytest.mark.xfail(strict=True, reason="bug: sin/cos of arguments beyond ~1e15 (where float64 range reduction "
                                       "runs out of bits) give inf (eager: values in [-1, 1])")
@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_sin_cos_of_huge_arguments(fn):
    x = torch.tensor([1e30, -1e30, 3e38])
    got = lazy_run(fn, x).cpu()
    assert bool((got.abs() <= 1).all()), got
    torch.testing.assert_close(got, fn(x), atol=1e-4, rtol=0)


@pytest.mark.xfail(strict=True, reason="bug: int64/int32 -> bfloat16 conversion does not compile on llvm-cpu "
                                       "(iree-lld: undefined symbol __truncsfbf2); the cluster falls back to "
                                       "eager with a PydiscWarning (results are right)")
@pytest.mark.parametrize("src", [torch.int64, torch.int32])
def test_int_to_bfloat16_compiles(src):
    import warnings
    x = torch.arange(-3, 3).to(src)
    before = sum(pydisc.metrics()["compile_failures"].values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydisc.PydiscWarning)
        got = lazy_run(lambda t: t.to(torch.bfloat16), x)
    assert_matches(got, x.to(torch.bfloat16))
    assert sum(pydisc.metrics()["compile_failures"].values()) == before
