"""Minimal repros of the bugs found by the differential fuzzer (tests/robustness/fuzz_graphs.py).

A bug still open is xfail(strict=True) here and the fuzzer avoids its pattern while its AVOID switch is
on; once fixed, the xfail goes, the switch is set to False and the repro stays as a regression test.
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


# found by the fuzzer: aten.matmul of a 1-D operand ends in an in-place squeeze_, which changed nothing
# on the lazy (wrapper) tensor; in-place view ops now change its sizes and rebind it (rewrites.py)
@pytest.mark.parametrize("shapes", [((3,), (3, 2)), ((3,), (2, 3, 4)), ((2, 3), (3,)), ((2, 2, 3), (3,)),
                                    ((3,), (3,))])
def test_matmul_with_a_vector_shape(shapes):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    assert_matches(lazy_run(torch.matmul, a, b), a @ b)
    assert_matches(lazy_run(lambda x, y: x.matmul(y), a, b), a @ b)


def test_matmul_vector_times_matrix_backward():
    a, b = torch.randn(3), torch.randn(3, 2)
    la, lb = pydisc.to_lazy(a.clone()).requires_grad_(), pydisc.to_lazy(b.clone()).requires_grad_()
    torch.matmul(la, lb).pow(2).sum().backward()
    pydisc.mark_step()
    ea, eb = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.matmul(ea, eb).pow(2).sum().backward()
    torch.testing.assert_close(la.grad.cpu(), ea.grad)
    torch.testing.assert_close(lb.grad.cpu(), eb.grad)


@pytest.mark.parametrize("pending", [True, False], ids=["pending", "materialized"])
def test_inplace_view_ops_change_the_lazy_tensor(pending):
    def program(x):
        y = x * 2 if pending else x
        y.squeeze_(1)
        y.unsqueeze_(0)
        y.transpose_(0, 2)
        z = y + 1
        y.t_() if y.dim() == 2 else y.squeeze_(2)
        y.swapdims_(0, 1)
        return y, z, y * 3

    x = torch.randn(2, 1, 3)
    lx = pydisc.to_lazy(x.clone())
    got = program(lx)
    pydisc.mark_step()
    want = program(x.clone())
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert_matches(g, w)
    assert_matches(lx, x if pending else want[0])   # materialized: y is x itself


def test_as_strided_inplace_of_a_lazy_tensor():
    x = torch.arange(6.0)
    lx = pydisc.to_lazy(x.clone()) * 1
    lx.as_strided_((2, 2), (1, 2), 1)
    out = lx + 0
    pydisc.mark_step()
    assert_matches(out, (x * 1).as_strided((2, 2), (1, 2), 1) + 0)


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


@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_sin_cos_of_huge_arguments(fn):
    # found by the fuzzer: beyond ~1e15 the float64 division ran out of bits (sin(1e30) = inf); the
    # lowering now reduces with 1/(2 pi) to 216 bits (Payne-Hanek), as torch's kernels do
    x = torch.tensor([1e30, -1e30, 3e38, -3.4028235e38, 1e15, 1e16, 2.0 ** 24 + 1, 2.0 ** 100, math.inf,
                      -math.inf, math.nan])
    got = lazy_run(fn, x).cpu()
    assert_matches(got, fn(x))


@pytest.mark.parametrize("fn", [torch.sin, torch.cos])
def test_sin_cos_over_every_float32_magnitude(fn):
    # every decade from the subnormals to the largest float32, both signs, with float32's own tolerance
    mags = torch.pow(10.0, torch.linspace(-44, 38.5, 3000, dtype=torch.float64)).float()
    x = torch.cat([mags, -mags, torch.randn(2000) * torch.pow(10.0, torch.randint(0, 39, (2000,)).float())])
    assert_matches(lazy_run(fn, x), fn(x))
    for low in (torch.float16, torch.bfloat16):
        assert_matches(lazy_run(fn, x.to(low)), fn(x.to(low)))


# found by the fuzzer: integer -> bfloat16 did not compile on llvm-cpu (iree-lld: undefined symbol
# __truncsfbf2) and the cluster ran eagerly; it now converts through float32, rounded to bf16 there
@pytest.mark.parametrize("src", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.float64])
def test_int_and_double_to_bfloat16_compile_and_round_as_eager(src):
    import warnings
    info = torch.iinfo(src) if not src.is_floating_point else torch.iinfo(torch.int64)
    # values just above a tie of bf16 (2^31 + 2^23 + 1): one rounding goes up, torch's two (through
    # float32, where they become the tie) go to even
    ties = [2 ** k + 2 ** (k - 8) + 1 for k in range(9, 63)]
    g = torch.Generator().manual_seed(0)
    values = [v for v in ties + [-v for v in ties] if info.min <= v <= info.max] + [0, 1, -1, 3, info.max, info.min]
    x = torch.cat([torch.tensor(values, dtype=torch.int64),
                   torch.randint(max(info.min, -2 ** 40), min(info.max, 2 ** 40), (500,), generator=g)])
    x = x.to(src)
    before = sum(pydisc.metrics()["compile_failures"].values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydisc.PydiscWarning)
        got = lazy_run(lambda t: t.to(torch.bfloat16), x)
        got_f16 = lazy_run(lambda t: t.to(torch.float16), x)
    assert sum(pydisc.metrics()["compile_failures"].values()) == before
    assert torch.equal(got.cpu(), x.to(torch.bfloat16))
    assert torch.equal(got_f16.cpu(), x.to(torch.float16))
