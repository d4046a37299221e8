"""Reductions: sum/mean/prod/amax/amin/any/all/var, max/min with indices, argmax/argmin.

`keepdim` is handled by reshaping to the recorded output shape. float16/bfloat16 accumulate in float32
as torch does; integer and bool sums accumulate in the recorded result dtype (int64).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import sympy
import torch

from pydisc.frontend.lowering.builder import FunctionBuilder, Value
from pydisc.frontend.lowering.elementwise import compute_dtype
from pydisc.frontend.lowering.registry import LoweringContext, lowering
from pydisc.frontend.lowering.size_exprs import Size, is_static, size_max

__all__ = ["reduce_dims", "reduce_sum"]

aten = torch.ops.aten
prims = torch.ops.prims


def reduce_dims(x: Value, dim: int | Sequence[int] | None) -> list[int]:
    """torch's dim argument: None or [] means every dim; negative dims wrap."""
    if x.rank == 0:
        return []
    if dim is None:
        return list(range(x.rank))
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return list(range(x.rank))
    return sorted({d % x.rank for d in dims})


def _identity(kind: str, dtype: torch.dtype) -> float | int | bool:
    if kind == "add":
        return 0
    if kind == "multiply":
        return 1
    if kind in ("and", "or"):
        return kind == "and"
    if dtype == torch.bool:
        return kind == "minimum"
    if dtype.is_floating_point:
        return -math.inf if kind == "maximum" else math.inf
    info = torch.iinfo(dtype)
    return info.min if kind == "maximum" else info.max


# A reduction of at least this many elements per result is split in two stages (`_split`).
SPLIT_REDUCTION_MIN = 4096


def _reduce(b: FunctionBuilder, x: Value, dims: Sequence[int], kind: str) -> Value:
    if not dims:
        return x
    split = _split(x, dims)
    if split is not None:
        # [R, *kept] -> [R/k, k, *kept] -> [k, *kept] -> kept: see `_split`
        rows, k, kept = split
        staged = b.reshape(x, (rows, k, *kept))
        if not kept:   # to a scalar: contiguous rows of k first, then the R/k partial results
            return _reduce(b, _reduce(b, staged, [1], kind), [0], kind)
        return _reduce(b, _reduce(b, staged, [0], kind), [0], kind)
    init = b.constant(_identity(kind, x.dtype), x.dtype)
    return b.reduce([x], [init], dims, lambda acc, v: [b.binary(kind, acc, v)])[0]


def _split(x: Value, dims: Sequence[int]) -> tuple[Size, int, tuple[Size, ...]] | None:
    """IREE 3.13's GPU code gives a reduction over leading dims (a bias gradient: [tokens, 768] ->
    [768]) one thread per result, looping over all R reduced elements, and a reduction to a scalar one
    thread in all: at R = 32768 these ran 5-100x slower than torch on the H200. A reduction over the
    leading dims (all dims included) of R >= SPLIT_REDUCTION_MIN elements is done in two: R = (R/k) x k,
    first over the R/k (k times the threads), then over the k. Returns (R/k, k, kept shape) or None. To a
    scalar, the k contiguous elements are reduced first instead. The order of a float sum changes with
    it, as it does between torch's kernels.

    With dynamic sizes (the tokens of variable-length batches, `32*s0`) k is a power of two that divides
    R's constant factor, so that R/k is a size expression (`s0`): a dynamic-shape BERT step's backward
    clusters ran 3-5x slower than the same clusters with static sizes (H100). The kept dims are static."""
    if list(dims) != list(range(len(dims))):
        return None
    kept = tuple(x.shape[len(dims):])
    reduced = math.prod(x.shape[: len(dims)])
    results = math.prod(kept) if is_static(kept) else None
    if results is None:
        return None
    if type(reduced) is not int:
        reduced = sympy.sympify(reduced)
        factor = reduced.as_coeff_Mul()[0]
        if not factor.is_Integer:
            return None
        for k in (1024, 512, 256, 128, 64, 32, 16, 8):
            if int(factor) % k == 0 and k * results <= 2 ** 20:
                return reduced / k, k, kept
        return None
    if reduced < SPLIT_REDUCTION_MIN:
        return None
    # to a scalar: rows of 1024 (one subgroup-wide row reduction each); otherwise k near sqrt(R), so that
    # both stages loop about as long, within 2^20 partial results
    candidates = (1024, 512, 256) if not kept else sorted((8, 16, 32, 64, 128, 256, 512, 1024),
                                                          key=lambda k: abs(math.log2(k) - math.log2(reduced) / 2))
    for k in candidates:
        if reduced % k == 0 and reduced // k >= 16 and k * results <= 2 ** 20:
            return reduced // k, k, kept
    return None


def reduce_sum(b: FunctionBuilder, x: Value, dims: Sequence[int], dtype: torch.dtype) -> Value:
    """Sum in `dtype`'s accumulation type, converted back to `dtype`."""
    acc = compute_dtype(dtype)
    return b.convert(_reduce(b, b.convert(x, acc), dims, "add"), dtype)


@lowering(aten.sum.default, aten.sum.dim_IntList, prims.sum.default, dynamic=True)
def _sum(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, keepdim: bool = False, **_: object) -> Value:
    b = ctx.builder
    return b.reshape(reduce_sum(b, x, reduce_dims(x, dim), ctx.out_dtype), ctx.out_spec.shape)


@lowering(aten.mean.default, aten.mean.dim, dynamic=True)
def _mean(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, keepdim: bool = False, **_: object) -> Value:
    b = ctx.builder
    dims = reduce_dims(x, dim)
    acc = compute_dtype(ctx.out_dtype)
    total = _reduce(b, b.convert(x, acc), dims, "add")
    count = math.prod(x.shape[d] for d in dims)
    mean = b.binary("divide", total, b.full(total.shape, count, acc))
    return b.reshape(b.convert(mean, ctx.out_dtype), ctx.out_spec.shape)


@lowering(aten.prod.default, aten.prod.dim_int, prims.prod.default, dynamic=True)
def _prod(ctx: LoweringContext, x: Value, dim: Sequence[int] | int | None = None, keepdim: bool = False, **_: object) -> Value:
    b = ctx.builder
    acc = compute_dtype(ctx.out_dtype)
    result = _reduce(b, b.convert(x, acc), reduce_dims(x, dim), "multiply")
    return b.reshape(b.convert(result, ctx.out_dtype), ctx.out_spec.shape)


def _extreme(ctx: LoweringContext, x: Value, dim: Sequence[int] | int | None, kind: str) -> Value:
    b = ctx.builder
    result = _reduce(b, x, reduce_dims(x, dim), kind)
    return b.reshape(result, ctx.out_spec.shape)


@lowering(aten.amax.default, aten.max.default, prims.amax.default, dynamic=True)
def _amax(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, keepdim: bool = False) -> Value:
    return _extreme(ctx, x, dim, "maximum")


@lowering(aten.amin.default, aten.min.default, prims.amin.default, dynamic=True)
def _amin(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, keepdim: bool = False) -> Value:
    return _extreme(ctx, x, dim, "minimum")


@lowering(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims, dynamic=True)
def _any_all(ctx: LoweringContext, x: Value, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Value:
    b = ctx.builder
    kind = "or" if ctx.node.target in (aten.any.default, aten.any.dim, aten.any.dims) else "and"
    result = _reduce(b, b.convert(x, torch.bool), reduce_dims(x, dim), kind)
    return b.reshape(b.convert(result, ctx.out_dtype), ctx.out_spec.shape)


def _arg_reduce(b: FunctionBuilder, x: Value, dim: int, direction: str) -> tuple[Value, Value]:
    """(values, int64 indices) of the max (direction GT) or min (LT) along `dim`; NaN wins and the
    first index wins among equals, as in torch."""
    indices = b.iota(x.shape, dim, torch.int64)
    init_value = b.constant(_identity("maximum" if direction == "GT" else "minimum", x.dtype), x.dtype)
    init_index = b.constant(0, torch.int64)

    def body(acc_v: Value, acc_i: Value, v: Value, i: Value) -> list[Value]:
        earlier = b.compare("LT", i, acc_i)
        better = b.compare(direction, v, acc_v)
        tie = b.binary("and", b.compare("EQ", v, acc_v), earlier)
        take = b.binary("or", better, tie)
        if x.dtype.is_floating_point:
            v_nan, acc_nan = b.compare("NE", v, v), b.compare("NE", acc_v, acc_v)
            nan_take = b.binary("and", v_nan, b.binary("or", b.unary("not", acc_nan), earlier))
            take = b.binary("or", nan_take, b.binary("and", b.unary("not", acc_nan), take))
        return [b.select(take, v, acc_v), b.select(take, i, acc_i)]

    values, index = b.reduce([x, indices], [init_value, init_index], [dim], body)
    return values, index


def _arg_rule(ctx: LoweringContext, x: Value, dim: int | None, direction: str) -> Value:
    b = ctx.builder
    if x.rank == 0:
        return b.full((), 0, torch.int64)
    if dim is None:
        x, dim = b.reshape(x, (x.type.numel,)), 0
    _, index = _arg_reduce(b, x, dim % x.rank, direction)
    return b.reshape(index, ctx.out_spec.shape)


@lowering(aten.argmax.default, dynamic=True)
def _argmax(ctx: LoweringContext, x: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    return _arg_rule(ctx, x, dim, "GT")


@lowering(aten.argmin.default, dynamic=True)
def _argmin(ctx: LoweringContext, x: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    return _arg_rule(ctx, x, dim, "LT")


def _max_min_dim(ctx: LoweringContext, x: Value, dim: int, direction: str) -> tuple[Value, Value]:
    b = ctx.builder
    if x.rank == 0:
        return x, b.full((), 0, torch.int64)
    values, index = _arg_reduce(b, x, dim % x.rank, direction)
    return b.reshape(values, ctx.out[0].shape), b.reshape(index, ctx.out[1].shape)


@lowering(aten.max.dim, dynamic=True)
def _max_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple[Value, Value]:
    return _max_min_dim(ctx, x, dim, "GT")


@lowering(aten.min.dim, dynamic=True)
def _min_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple[Value, Value]:
    return _max_min_dim(ctx, x, dim, "LT")


def _variance(b: FunctionBuilder, x: Value, dims: list[int], correction: float, dtype: torch.dtype) -> tuple[Value, Value]:
    """(var, mean), both with the reduced dims kept as size 1, in the accumulation dtype."""
    acc = compute_dtype(dtype)
    x = b.convert(x, acc)
    count = math.prod(x.shape[d] for d in dims)
    kept = tuple(1 if i in dims else s for i, s in enumerate(x.shape))
    total = _reduce(b, x, dims, "add")
    mean = b.reshape(b.binary("divide", total, b.full(total.shape, count, acc)), kept)
    centered = b.binary("subtract", x, b.broadcast_to(mean, x.shape))
    squares = _reduce(b, b.binary("multiply", centered, centered), dims, "add")
    if float(correction).is_integer():  # keeps a symbolic count an integer expression
        correction = int(correction)
    var = b.binary("divide", squares, b.full(squares.shape, size_max(count - correction, 0), acc))
    return b.reshape(var, kept), mean


@lowering(prims.var.default, dynamic=True)
def _prims_var(ctx: LoweringContext, x: Value, dims: Sequence[int] | None, correction: float = 1, *,
               output_dtype: torch.dtype | None = None) -> Value:
    b = ctx.builder
    var, _ = _variance(b, x, reduce_dims(x, dims), correction, ctx.out_dtype)
    return b.reshape(b.convert(var, ctx.out_dtype), ctx.out_spec.shape)


@lowering(aten.var.correction, dynamic=True)
def _var(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, *, correction: float | None = None,
         keepdim: bool = False) -> Value:
    b = ctx.builder
    var, _ = _variance(b, x, reduce_dims(x, dim), 1 if correction is None else correction, ctx.out_dtype)
    return b.reshape(b.convert(var, ctx.out_dtype), ctx.out_spec.shape)


@lowering(aten.var_mean.correction, dynamic=True)
def _var_mean(ctx: LoweringContext, x: Value, dim: Sequence[int] | None = None, *, correction: float | None = None,
              keepdim: bool = False) -> tuple[Value, Value]:
    b = ctx.builder
    var, mean = _variance(b, x, reduce_dims(x, dim), 1 if correction is None else correction, ctx.out_dtype)
    return (
        b.reshape(b.convert(var, ctx.out[0].dtype), ctx.out[0].shape),
        b.reshape(b.convert(mean, ctx.out[1].dtype), ctx.out[1].shape),
    )
