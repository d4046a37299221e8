"""Elementwise rules against eager torch: many ops per compiled function to keep IREE compiles few."""
from __future__ import annotations

import pytest
import torch

from conftest import check, run_emitted

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def _float_ops(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor) -> list[torch.Tensor]:
    out = [] if x.dtype == torch.float64 else [  # IREE's CPU backend lacks these in f64 (see elementwise.py)
        torch.div(x, y, rounding_mode="floor"), x // y, torch.remainder(x, y), torch.fmod(x, y), x.tanh(),
        x.sin(), x.cos(), torch.nn.functional.gelu(x, approximate="tanh"),
    ]
    return out + [
        x + y, x - 2.5 * y, torch.add(x, y, alpha=3), torch.sub(x, y, alpha=0.5), x * y, x / y, -x, x.abs(),
        torch.div(x, y, rounding_mode="trunc"), 1 - x, 2 / y, x * 3,
        p.exp(), p.log(), p.log1p(), x.expm1(), p.sqrt(), p.rsqrt(), x.sigmoid(), x.relu(),
        torch.erf(x), x.floor(), x.ceil(), (x * 3).round(), x.sign(), x.reciprocal(),
        torch.maximum(x, y), torch.minimum(x, y), x.clamp(-0.5, 0.5), x.clamp(min=0.1), x.clamp(max=y),
        torch.where(x > y, x, y), torch.where(x > 0, x, 0.0), p.pow(y), p ** 2, p ** 0.5, x.pow(3),
        x == y, x != y, x < y, x <= 0.5, x > y, x >= y, torch.isnan(x / x), torch.isinf(1 / x),
        torch.nn.functional.gelu(x), torch.nn.functional.silu(x), torch.nn.functional.softplus(x),
        torch.nn.functional.leaky_relu(x, 0.1), torch.nn.functional.hardtanh(x), torch.trunc(x * 4),
        torch.lerp(x, y, 0.3), torch.addcmul(x, y, p, value=0.5), torch.addcdiv(x, y, p, value=2),
        torch.log_softmax(x, dim=1), torch.softmax(x, dim=0), p.log2(), x.frac(), x.square(),
    ]


@pytest.mark.parametrize("dtype", FLOATS)
def test_float_ops(dtype: torch.dtype) -> None:
    x = torch.randn(6, 5, dtype=dtype)
    y = torch.randn(5, dtype=dtype) + 0.1
    y[0] = -0.7
    x[0, 0] = 0.0  # exercises 0/0 and 1/0
    p = torch.rand(6, 5, dtype=dtype) + 0.05
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype)
    check(_float_ops, x, y, p, atol=tol, rtol=tol)


def _int_ops(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    out = [
        x + y, x - y, x * y, x * 2, x + 3, torch.div(x, y, rounding_mode="trunc"),
        torch.div(x, y, rounding_mode="floor"), x // y, torch.remainder(x, y), torch.fmod(x, y), x / y,
        torch.maximum(x, y), torch.minimum(x, y), x.clamp(1, 5), x == y, x < y, x >= 3, x.sign(),
        x & y, x | y, x ^ y, x * 1.5, x.float(), torch.where(x > y, x, 7), x.abs(), x.floor(),
    ]
    if x.dtype != torch.uint8:
        out += [-x, ~x]
    return out


@pytest.mark.parametrize("dtype", INTS)
def test_int_ops(dtype: torch.dtype) -> None:
    low = 0 if dtype == torch.uint8 else -9
    x = torch.randint(low, 10, (4, 7), dtype=dtype)
    y = torch.randint(1, 6, (7,), dtype=dtype)
    if dtype != torch.uint8:
        y[::2] *= -1
    check(_int_ops, x, y)


def test_bool_and_conversions() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, f: torch.Tensor, i: torch.Tensor) -> list[torch.Tensor]:
        return [
            a & b, a | b, a ^ b, ~a, torch.logical_not(f), torch.logical_and(f, i), torch.logical_or(a, f),
            torch.logical_xor(a, b), a.float(), a.long(), f.bool(), i.bool(), f.long(), f.int(), f.to(torch.int8),
            (f * 100).to(torch.uint8), f.half(), f.bfloat16(), f.double(), i.to(torch.float16), a + a, a * 2,
            a.to(torch.uint8), i.to(torch.int16), (i * 1000).to(torch.int8), a == b,
        ]

    a = torch.rand(3, 4) > 0.5
    b = torch.rand(3, 4) > 0.5
    f = torch.randn(3, 4) * 3
    f[0, 0] = 0.0
    i = torch.randint(-3, 3, (3, 4))
    check(fn, a, b, f, i)


def test_type_promotion_and_broadcasting() -> None:
    def fn(h: torch.Tensor, f: torch.Tensor, i: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> list[torch.Tensor]:
        return [
            h + f, h * 2.5, i + 1.5, i * f, i / 2, s + h, s * i, d * f, h + s, i + True, f + d.float(),
            torch.where(s > 0, h, i), s + 1, torch.tensor(2.0) * h, i.float() ** 2,
        ]

    h = torch.randn(2, 3, 4, dtype=torch.float16)
    f = torch.randn(3, 1)
    i = torch.randint(-5, 5, (4,))
    s = torch.tensor(1.5)
    d = torch.randn(1, 4, dtype=torch.float64)
    check(fn, h, f, i, s, d, atol=1e-2, rtol=1e-2)


def test_tan_as_accurate_as_eager() -> None:
    """IREE's float32 tan is ~5e-5 relative off (near its poles and for small arguments alike): pydisc
    reduces the argument in float64 and sums sin/cos series; checked against float64 near every pole of
    [-8, 8], on small and huge arguments."""
    poles = torch.arange(-5, 5, dtype=torch.float64) * torch.pi + torch.pi / 2
    x = torch.cat([(poles[:, None] + torch.linspace(-1e-2, 1e-2, 41, dtype=torch.float64)).flatten(),
                   torch.tensor([-1.1963408e-3, 1e-30, 0.0, 1e5, 1e10, 3e38, -1e20, float("inf"), float("nan")],
                                dtype=torch.float64)]).float()
    got = check(lambda x: [x.tan(), torch.round(x, decimals=2), torch.round(x * 1e3, decimals=-3)], x)
    # float32 tan is pydisc's own float64 reduction, never IREE's chlo.tan
    assert "chlo.tan" not in got.text
    assert f"stablehlo.convert %arg0 : (tensor<{x.numel()}xf32>) -> tensor<{x.numel()}xf64>" in got.text
    out = run_emitted(torch.tan, x)[0][0].double()
    reference = torch.tan(x.double())
    finite = reference.isfinite()
    assert ((out - reference).abs() / reference.abs().clamp_min(1e-30))[finite].max() < 2e-7


def test_bf16_rounding_between_float32_ops_stays_in_float32() -> None:
    """Autocast rounds to bf16 between float32 ops (a masked fill in bf16 between a softmax's gradient
    and a scale): the rounding is emitted as `reduce_precision` in float32 for the ops that widen it
    again, so that IREE fuses it (it does not fuse a truncation into its consumers), with eager's values
    to the bit, NaN, infinities, ties and values beyond bf16's range included."""
    def fn(x, mask):
        y = torch.where(mask, torch.zeros((), dtype=torch.bfloat16), x.to(torch.bfloat16))
        return (y.float() * 0.125).to(torch.bfloat16), x.to(torch.bfloat16).float() + 1

    x = torch.randn(64, 33) * 100
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1 + 2 ** -8, 1e-40])
    mask = torch.rand(64, 33) > 0.5
    results, cluster = run_emitted(fn, x, mask)
    for got, want in zip(results, fn(x, mask)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert "reduce_precision" in cluster.text


def test_bf16_rounding_survives_views() -> None:
    """A rounded bf16 value that is reshaped or transposed before it is widened again keeps its
    rounding (on a one-element tensor, IREE 3.13's llvm-cpu folds the widening of a reshaped
    truncation into the float32 value: a foreach update of 0-d bf16 tensors came out one step off)."""
    def fn(x):
        y = x.to(torch.bfloat16)
        return y.reshape(-1).float() * 0.75, y.view(()).float() + 1, y.t().float()

    x = torch.tensor([[123.456]])
    results, _ = run_emitted(fn, x)
    for got, want in zip(results, fn(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bf16_rounding_with_dynamic_sizes_compiles() -> None:
    """The same rounding in a cluster with dynamic dims, where IREE 3.13 crashes on reduce_precision:
    done on the bits instead, compiled (not left to eager), with eager's values to the bit."""
    import pydisc
    from pydisc.driver import step as pstep

    def fn(x):
        return (x.to(torch.bfloat16) * 3).float() + 1

    pstep.clear_plans()
    pydisc.reset_metrics()
    try:
        for n in (3, 8, 21, 8):
            x = torch.randn(n, 9) * 100
            x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1 + 2 ** -8, 1e-40])
            pydisc.mark_dynamic(x, [0])
            out = fn(pydisc.to_lazy(x))
            pydisc.mark_step()
            torch.testing.assert_close(out.cpu(), fn(x), rtol=0, atol=0, equal_nan=True)
        m = pydisc.metrics()
        assert m["dynamic_templates"] == 1 and not m["compile_failures"], m["compile_failures"]
    finally:
        pstep.clear_plans()
