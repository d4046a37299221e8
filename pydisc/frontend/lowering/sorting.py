"""sort and topk as a stable `stablehlo.sort` of (values, iota) with torch's ordering: NaN above
everything, equal values in index order."""
from __future__ import annotations

import torch

from pydisc.frontend.lowering.builder import FunctionBuilder, TensorSpec, Value
from pydisc.frontend.lowering.registry import LoweringContext, lowering, support_check
from pydisc.frontend.lowering.shape import normalize_dim

__all__ = ["sort"]

aten = torch.ops.aten


def sort(b: FunctionBuilder, x: Value, dim: int, descending: bool) -> tuple[Value, Value]:
    """(values, int64 indices) of `x` sorted along `dim`."""
    indices = b.iota(x.shape, dim, torch.int64)
    x = b.fresh_copy(x)  # the sort runs in place: never on the cluster's input buffer
    scalar = TensorSpec((), x.dtype)
    index = TensorSpec((), torch.int64)

    def before(lhs: Value, rhs: Value, _li: Value, _ri: Value) -> list[Value]:
        first, second = (rhs, lhs) if descending else (lhs, rhs)
        ordered = b.compare("LT", first, second)
        if x.dtype.is_floating_point:  # NaN is the largest value
            nan_first, nan_second = b.compare("NE", first, first), b.compare("NE", second, second)
            ordered = b.binary("or", ordered, b.binary("and", nan_second, b.unary("not", nan_first)))
        return [ordered]

    values, positions = b.op(
        "stablehlo.sort", [x, indices], [x.type, indices.type],
        {"dimension": f"{dim} : i64", "is_stable": "true"},
        regions=[b.block([scalar, scalar, index, index], before)],
    )  # type: ignore[misc]
    return values, positions


@lowering(aten.sort.default, aten.sort.stable)
def _sort(ctx: LoweringContext, x: Value, *args: object, **kwargs: object) -> tuple[Value, Value]:
    if ctx.node.target is aten.sort.stable:
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    b = ctx.builder
    if x.rank == 0:
        return x, b.full((), 0, torch.int64)
    return sort(b, x, normalize_dim(int(dim), x.rank), bool(descending))  # type: ignore[arg-type]


@lowering(aten.topk.default)
def _topk(ctx: LoweringContext, x: Value, k: int, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> tuple[Value, Value]:
    b = ctx.builder
    if x.rank == 0:
        return x, b.full((), 0, torch.int64)
    dim = normalize_dim(dim, x.rank)
    values, indices = sort(b, x, dim, descending=largest)
    limits = list(x.shape)
    limits[dim] = k
    start, step = [0] * x.rank, [1] * x.rank
    return b.slice(values, start, limits, step), b.slice(indices, start, limits, step)


@support_check(aten.sort.default, aten.sort.stable, aten.topk.default)
def _sort_check(node: torch.fx.Node) -> str | None:
    dtype = node.args[0].meta["val"].dtype  # type: ignore[union-attr]
    if dtype == torch.bool:
        return "sort of bool (IREE orders i1 keys differently)"
    if node.target is aten.sort.default and dtype not in (torch.float32, torch.float64):
        return f"unstable sort in {dtype} (torch orders its many ties differently)"
    if node.target is aten.topk.default and dtype not in (torch.float32, torch.float64):
        # torch's topk orders equal values by its selection algorithm, not by index; ties are common
        # in narrow and integer dtypes.
        return f"topk in {dtype} (tie order differs from torch)"
    return None
