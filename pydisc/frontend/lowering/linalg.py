"""Matrix products. Low-precision products accumulate in float32 (`dot_general` to f32, then convert):
IREE 3.13's CUDA backend cannot compile bf16 x bf16 -> bf16, and torch accumulates in
f32 too."""
from __future__ import annotations

import torch

from pydisc.frontend.lowering.builder import FunctionBuilder, Value
from pydisc.frontend.lowering.elementwise import as_operand, compute_dtype
from pydisc.frontend.lowering.registry import LoweringContext, lowering

__all__ = ["matmul"]

aten = torch.ops.aten


def matmul(
    b: FunctionBuilder,
    lhs: Value,
    rhs: Value,
    batch: tuple[list[int], list[int]],
    contract: tuple[list[int], list[int]],
    dtype: torch.dtype,
) -> Value:
    lhs, rhs = b.convert(lhs, dtype), b.convert(rhs, dtype)
    return b.convert(b.dot_general(lhs, rhs, batch, contract, compute_dtype(dtype)), dtype)


@lowering(aten.mm.default, dynamic=True)
def _mm(ctx: LoweringContext, a: Value, b_: Value) -> Value:
    return matmul(ctx.builder, a, b_, ([], []), ([1], [0]), ctx.out_dtype)


@lowering(aten.bmm.default, dynamic=True)
def _bmm(ctx: LoweringContext, a: Value, b_: Value) -> Value:
    return matmul(ctx.builder, a, b_, ([0], [0]), ([2], [1]), ctx.out_dtype)


@lowering(aten.dot.default, dynamic=True)
def _dot(ctx: LoweringContext, a: Value, b_: Value) -> Value:
    return matmul(ctx.builder, a, b_, ([], []), ([0], [0]), ctx.out_dtype)


@lowering(aten.mv.default, dynamic=True)
def _mv(ctx: LoweringContext, a: Value, v: Value) -> Value:
    return matmul(ctx.builder, a, v, ([], []), ([1], [0]), ctx.out_dtype)


@lowering(aten.addmm.default, dynamic=True)
def _addmm(ctx: LoweringContext, bias: Value, a: Value, b_: Value, *, beta: float = 1, alpha: float = 1) -> Value:
    b = ctx.builder
    out = ctx.out_spec
    acc = compute_dtype(out.dtype)
    product = b.dot_general(b.convert(a, out.dtype), b.convert(b_, out.dtype), ([], []), ([1], [0]), acc)
    if alpha != 1:
        product = b.binary("multiply", product, b.full(out.shape, alpha, acc))
    if beta == 0:  # torch ignores bias (even NaN) when beta is 0
        return b.convert(product, out.dtype)
    bias = as_operand(b, bias, acc, out.shape)
    if beta != 1:
        bias = b.binary("multiply", bias, b.full(out.shape, beta, acc))
    return b.convert(b.binary("add", product, bias), out.dtype)
