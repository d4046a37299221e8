"""Indexing ops: gather, scatter, index_select, embedding, index.Tensor.

torch's `gather`/`scatter` address one element per index entry; in StableHLO that is a gather/scatter
whose index vectors hold a full coordinate: the index tensor along `dim`, an iota along every other dim.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pydisc.frontend.lowering.builder import FunctionBuilder, TensorSpec, Value, i64_array
from pydisc.frontend.lowering.elementwise import as_operand
from pydisc.frontend.lowering.registry import LoweringContext, lowering, support_check
from pydisc.frontend.lowering.shape import normalize_dim
from pydisc.frontend.lowering.size_exprs import DynamicShapeError, is_static, same_size, size_of

__all__ = ["scatter", "one_per_row"]

aten = torch.ops.aten
prims = torch.ops.prims


def _dims(values: Sequence[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _whole(b: FunctionBuilder, x: Value) -> Value:
    """`x` as a tensor of its own, never a strided view of a larger buffer, for a gather to read.

    IREE 3.13's CUDA codegen vectorizes the `tensor.extract` of a gather into a `vector.gather` whose
    offsets are linearised over the operand's own shape. Where IREE fuses a slice of a larger buffer
    into the gather's dispatch, the operand becomes a strided view of that buffer after bufferization,
    and the linearised offsets read other elements (rows of the slice's width, not the buffer's):
    Llama's RoPE backward (slice_scatter's index of `x[..., 4:8]`) came out wrong on the H200 while
    llvm-cpu was right. Behind an optimization barrier the gather reads a whole tensor; a function
    argument, a view of one, or a value already behind a barrier is whole (no copy). Static shapes only:
    IREE cannot follow dynamic dims through a barrier."""
    if x.name.startswith("%arg") or x.name in b.whole or not x.type.is_static:
        return x
    (x,) = b.optimization_barrier(x)
    b.whole.add(x.name)
    return x


def _view_of_whole(b: FunctionBuilder, source: Value, view: Value) -> Value:
    """Mark `view` (a transpose or reshape of `source`, which `_whole` made whole) as whole too: IREE
    folds it into the gather's indexing, and the load stays a whole tensor."""
    if source.name in b.whole or source.name.startswith("%arg"):
        b.whole.add(view.name)
    return view


def _gather(
    b: FunctionBuilder,
    x: Value,
    indices: Value,
    out: TensorSpec,
    *,
    offset_dims: Sequence[int],
    collapsed: Sequence[int],
    start_index_map: Sequence[int],
    index_vector_dim: int,
    slice_sizes: Sequence[int],
) -> Value:
    x = _whole(b, x)
    numbers = (
        f"#stablehlo.gather<offset_dims = {_dims(offset_dims)}, collapsed_slice_dims = {_dims(collapsed)}, "
        f"start_index_map = {_dims(start_index_map)}, index_vector_dim = {index_vector_dim}>"
    )
    return b.op(
        "stablehlo.gather",
        [x, indices],
        out,
        {"dimension_numbers": numbers, "slice_sizes": i64_array(slice_sizes), "indices_are_sorted": "false"},
    )


def _wrap_negative(b: FunctionBuilder, index: Value, size: int) -> Value:
    """torch accepts index -k for size - k."""
    index = b.convert(index, torch.int64)
    negative = b.compare("LT", index, b.full(index.shape, 0, torch.int64))
    return b.select(negative, b.binary("add", index, b.full(index.shape, size, torch.int64)), index)


def _full_coordinates(b: FunctionBuilder, index: Value, dim: int, size: int) -> Value:
    """index.shape + [rank]: coordinate `dim` from `index`, the others from iotas."""
    shape = (*index.shape, 1)
    index = _wrap_negative(b, index, size)
    columns = [
        b.reshape(index, shape) if d == dim else b.iota(shape, d, torch.int64) for d in range(index.rank)
    ]
    return b.concatenate(columns, index.rank)


@lowering(aten.gather.default, dynamic=True)
def _gather_rule(ctx: LoweringContext, x: Value, dim: int, index: Value, *, sparse_grad: bool = False) -> Value:
    b = ctx.builder
    if x.rank == 0:
        return b.reshape(x, ctx.out_spec.shape)
    dim = normalize_dim(dim, x.rank)
    coords = _full_coordinates(b, index, dim, x.shape[dim])
    rank = x.rank
    return _gather(
        b, x, coords, ctx.out_spec, offset_dims=[], collapsed=range(rank), start_index_map=range(rank),
        index_vector_dim=rank, slice_sizes=[1] * rank,
    )


@lowering(aten.index_select.default, dynamic=True)
def _index_select(ctx: LoweringContext, x: Value, dim: int, index: Value) -> Value:
    b = ctx.builder
    dim = normalize_dim(dim, x.rank)
    if x.rank == 0:
        return b.reshape(x, ctx.out_spec.shape)
    index = b.reshape(_wrap_negative(b, index, x.shape[dim]), (ctx.out_spec.shape[dim],))
    sizes = list(x.shape)
    sizes[dim] = 1
    return _gather(
        b, x, index, ctx.out_spec, offset_dims=[d for d in range(x.rank) if d != dim], collapsed=[dim],
        start_index_map=[dim], index_vector_dim=1, slice_sizes=sizes,
    )


@lowering(aten.embedding.default, dynamic=True)
def _embedding(ctx: LoweringContext, weight: Value, indices: Value, *_: object) -> Value:
    b = ctx.builder
    indices = b.convert(indices, torch.int64)
    return _gather(
        b, weight, indices, ctx.out_spec, offset_dims=[indices.rank], collapsed=[0], start_index_map=[0],
        index_vector_dim=indices.rank, slice_sizes=[1, weight.shape[1]],
    )


def _batch_moves(batch_rank: int, leading: int, out_rank: int) -> list[int]:
    """Result dims (batch first, then the untouched dims) reordered so that the batch dims come after the
    `leading` untouched dims, as torch places them when the indexed dims are adjacent."""
    batch = list(range(batch_rank))
    rest = list(range(batch_rank, out_rank))
    return rest[:leading] + batch + rest[leading:]


def _inverse(perm: Sequence[int]) -> list[int]:
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def _front_indexed(b: FunctionBuilder, x: Value, indices: Sequence[Value | None]) -> tuple[Value, list[Value], list[int], int]:
    """`x` with its indexed dims moved to the front; the index tensors; the permutation used; and the
    number of untouched dims that torch keeps before the batch dims in the result (0 when the indexed
    dims are not adjacent)."""
    indices = list(indices) + [None] * (x.rank - len(indices))
    positions = [d for d, i in enumerate(indices) if i is not None]
    rest = [d for d in range(x.rank) if d not in positions]
    perm = positions + rest
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    x = _whole(b, x)
    moved = x if perm == list(range(x.rank)) else _view_of_whole(b, x, b.transpose(x, perm))
    return moved, [indices[d] for d in positions], perm, positions[0] if adjacent else 0  # type: ignore[misc]


@lowering(aten.index.Tensor, dynamic=True)
def _index(ctx: LoweringContext, x: Value, indices: Sequence[Value | None]) -> Value:
    """x[i0, i1, ...]: the index tensors (broadcast together) pick along their dims, None entries and
    trailing dims are full slices."""
    b = ctx.builder
    if not ctx.out_spec.is_static:
        return _dynamic_index(b, x, indices, ctx.out_spec)  # type: ignore[arg-type]
    moved, taken, _, leading = _front_indexed(b, x, indices)
    count = len(taken)
    batch = torch.broadcast_shapes(*(i.shape for i in taken))
    columns = [
        b.reshape(b.broadcast_to(_wrap_negative(b, i, moved.shape[d]), batch), (*batch, 1))
        for d, i in enumerate(taken)
    ]
    coords = b.concatenate(columns, len(batch))
    gathered_shape = (*batch, *moved.shape[count:])
    gathered = _gather(
        b, moved, coords, TensorSpec(gathered_shape, x.dtype), offset_dims=range(len(batch), len(batch) + x.rank - count),
        collapsed=range(count), start_index_map=range(count), index_vector_dim=len(batch),
        slice_sizes=[1] * count + list(moved.shape[count:]),
    )
    if leading == 0:
        return gathered
    return b.transpose(gathered, _batch_moves(len(batch), leading, len(gathered_shape)))


def _dynamic_index(b: FunctionBuilder, x: Value, indices: Sequence[Value], out: TensorSpec) -> Value:
    """`_index` with dynamic sizes. A single index tensor is used as is, with an implicit index vector
    dim: IREE 3.13 fails to compile a gather whose indices are `tensor<?x1xi64>`."""
    count = len(indices)
    batch = out.shape[: out.rank - (x.rank - count)]
    if count == 1:
        coords = _wrap_negative(b, indices[0], x.shape[0])
    else:
        columns = [
            b.reshape(b.broadcast_to(_wrap_negative(b, i, x.shape[d]), batch), (*batch, 1)) for d, i in enumerate(indices)
        ]
        coords = b.concatenate(columns, len(batch))
    return _gather(
        b, x, coords, out, offset_dims=range(len(batch), len(batch) + x.rank - count),
        collapsed=range(count), start_index_map=range(count), index_vector_dim=len(batch),
        slice_sizes=[1] * count + list(x.shape[count:]),
    )


def _static_dims(node: torch.fx.Node, position: int, dims: object) -> str | None:
    """Gathers take whole slices of these dims of argument `position`: their sizes are attributes."""
    shape = node.args[position].meta["val"].shape  # type: ignore[union-attr]
    if any(not isinstance(size_of(shape[d]), int) for d in dims):  # type: ignore[attr-defined]
        return f"{node.target} taking slices of dynamic size"
    return None


@support_check(aten.embedding.default)
def _embedding_check(node: torch.fx.Node) -> str | None:
    return _static_dims(node, 0, [1])


@support_check(aten.index_select.default)
def _index_select_check(node: torch.fx.Node) -> str | None:
    rank = node.args[0].meta["val"].dim()  # type: ignore[union-attr]
    dim = int(node.args[1]) % max(rank, 1)  # type: ignore[arg-type]
    return _static_dims(node, 0, [d for d in range(rank) if d != dim])


@support_check(aten.index.Tensor)
def _index_check(node: torch.fx.Node) -> str | None:
    return _slices_check(node) or _static_dims(node, 0, range(len(node.args[1]), node.args[0].meta["val"].dim()))  # type: ignore[union-attr, arg-type]


def _slices_check(node: torch.fx.Node) -> str | None:
    """index/index_put: None (full-slice) entries only with static shapes, no boolean masks."""
    indices = [i for i in node.args[1] if i is not None]  # type: ignore[union-attr]
    if not indices:
        return f"{node.target} without index tensors"
    if any(i.meta["val"].dtype == torch.bool for i in indices):  # type: ignore[union-attr]
        return "boolean mask indexing has a data-dependent shape"
    if len(indices) < len(node.args[1]):  # type: ignore[arg-type]
        for n in (node.args[0], *indices, node):
            if any(not isinstance(size_of(d), int) for d in n.meta["val"].shape):  # type: ignore[union-attr]
                return f"{node.target} with None (slice) entries and dynamic sizes"
    return None


def scatter(
    b: FunctionBuilder, x: Value, dim: int, index: Value, updates: Value, combine: Callable[..., Value] | None
) -> Value:
    """torch.scatter along `dim`: `combine(current, update)` or overwrite when None."""
    dim = normalize_dim(dim, x.rank)
    coords = _full_coordinates(b, index, dim, x.shape[dim])
    rank = x.rank
    numbers = (
        f"#stablehlo.scatter<update_window_dims = [], inserted_window_dims = {_dims(range(rank))}, "
        f"scatter_dims_to_operand_dims = {_dims(range(rank))}, index_vector_dim = {rank}>"
    )
    return _scatter_op(b, x, coords, updates, numbers, combine)


def _scatter_op(b: FunctionBuilder, x: Value, coords: Value, updates: Value, numbers: str,
                combine: Callable[..., Value] | None, unique: bool = False) -> Value:
    """`stablehlo.scatter` into a copy of `x`: `combine(b, current, update)`, or overwrite when None.
    `unique`: no two updates share a coordinate. IREE 3.13 runs a scatter that may repeat coordinates
    on one GPU thread (the embedding gradient: 1 s against torch's 4 ms on the H200), a unique one in
    parallel."""
    scalar = TensorSpec((), x.dtype)

    def body(current: Value, update: Value) -> list[Value]:
        return [update if combine is None else combine(b, current, update)]

    return b.op(
        "stablehlo.scatter",
        [b.fresh_copy(x), coords, updates],
        x.type,
        {"scatter_dimension_numbers": numbers, "indices_are_sorted": "false",
         "unique_indices": "true" if unique else "false"},
        regions=[b.block([scalar, scalar], body)],
    )  # type: ignore[return-value]


def _updates(b: FunctionBuilder, src: Value | float, index: Value, dtype: torch.dtype) -> Value:
    if not isinstance(src, Value):
        return as_operand(b, src, dtype, index.shape)
    # Only src[:index.shape] takes part.
    return b.convert(b.slice(src, [0] * src.rank, index.shape, [1] * src.rank), dtype)


def one_per_row(x_shape: Sequence, dim: int, index_shape: Sequence) -> bool:
    """A scatter that writes one element per row along `dim` (nll_loss's backward): emitted as a one-hot
    select instead, a parallel elementwise op (IREE 3.13 runs a scatter that may repeat coordinates on
    one GPU thread, and fails on some fusions of a dynamic one: 'stack allocation size overflows').
    Sizes are ints or size expressions (`size_of`); the partitioner asks too, from node metadata."""
    return (len(index_shape) == len(x_shape) and index_shape[dim] == 1
            and all(same_size(index_shape[d], x_shape[d]) for d in range(len(x_shape)) if d != dim))


def _one_hot_scatter(b: FunctionBuilder, x: Value, dim: int, index: Value, updates: Value,
                     combine: Callable[..., Value] | None) -> Value:
    hit = b.compare("EQ", b.iota(x.shape, dim, torch.int64), b.broadcast_to(_wrap_negative(b, index, x.shape[dim]), x.shape))
    spread = b.broadcast_to(updates, x.shape)
    return b.select(hit, spread if combine is None else combine(b, x, spread), x)


@lowering(aten.scatter.value, aten.scatter.src, dynamic=True)
def _scatter_rule(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value | float) -> Value:
    if x.rank == 0:
        return ctx.builder.reshape(_updates(ctx.builder, src, ctx.builder.reshape(index, (1,)), x.dtype), ())
    dim = normalize_dim(dim, x.rank)
    if one_per_row(x.shape, dim, index.shape):
        return _one_hot_scatter(ctx.builder, x, dim, index, _updates(ctx.builder, src, index, x.dtype), None)
    return scatter(ctx.builder, x, dim, index, _updates(ctx.builder, src, index, x.dtype), None)


@lowering(aten.scatter_add.default, dynamic=True)
def _scatter_add(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value) -> Value:
    # bool + bool saturates to True in torch; i1 addition would wrap
    add = lambda b, u, v: b.binary("or" if x.dtype == torch.bool else "add", u, v)  # noqa: E731
    dim = normalize_dim(dim, x.rank)
    if one_per_row(x.shape, dim, index.shape):
        return _one_hot_scatter(ctx.builder, x, dim, index, _updates(ctx.builder, src, index, x.dtype), add)
    return scatter(ctx.builder, x, dim, index, _updates(ctx.builder, src, index, x.dtype), add)


def _reduce_identity(reduce: str, dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return reduce in ("prod", "amin")
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if dtype.is_floating_point:
        return -math.inf if reduce == "amax" else math.inf
    info = torch.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


def _reduce_combine(reduce: str, dtype: torch.dtype) -> Callable[..., Value]:
    if dtype == torch.bool:   # bool sum/max saturate (or), prod/min are and
        name = "or" if reduce in ("sum", "mean", "amax") else "and"
    else:
        name = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "maximum", "amin": "minimum"}[reduce]
    return lambda b, u, v: b.binary(name, u, v)


@lowering(aten.scatter_reduce.two)
def _scatter_reduce(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value, reduce: str, *,
                    include_self: bool = True) -> Value:
    """torch.scatter_reduce: a scatter that combines with sum/prod/amax/amin; without `include_self`
    the positions written are first set to the combination's identity. `mean` is the sum divided by
    the number of values combined (floor division for integers, as torch)."""
    b = ctx.builder
    shape = x.shape
    if x.rank == 0:
        x, index, src = (b.reshape(v, (1,)) for v in (x, index, src))
    dim = normalize_dim(dim, x.rank)
    updates = _updates(b, src, index, x.dtype)
    base = x
    if not include_self:
        identity = b.full(index.shape, _reduce_identity(reduce, x.dtype), x.dtype)
        base = scatter(b, x, dim, index, identity, None)
    out = scatter(b, base, dim, index, updates, _reduce_combine(reduce, x.dtype))
    if reduce == "mean":
        count = scatter(b, b.full(x.shape, 1 if include_self else 0, x.dtype), dim, index,
                        b.full(index.shape, 1, x.dtype), _reduce_combine("sum", x.dtype))
        count = b.binary("maximum", count, b.full(x.shape, 1, x.dtype))
        quotient = b.binary("divide", out, count)
        if not x.dtype.is_floating_point:   # floor: truncation rounds up for a negative inexact quotient
            inexact = b.compare("NE", b.binary("multiply", quotient, count), out)
            negative = b.compare("LT", out, b.full(x.shape, 0, x.dtype))
            quotient = b.select(b.binary("and", inexact, negative),
                                b.binary("subtract", quotient, b.full(x.shape, 1, x.dtype)), quotient)
        out = quotient
    return b.reshape(out, shape) if len(shape) == 0 else out


@support_check(aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.gather.default, aten.scatter_reduce.two)
def _no_empty_index(node: torch.fx.Node) -> str | None:
    if any(size_of(d) == 0 for d in node.args[2].meta["val"].shape):  # type: ignore[union-attr]
        return "empty index tensor"
    return None


@lowering(aten.index_put.default, dynamic=True)
def _index_put(ctx: LoweringContext, x: Value, indices: Sequence[Value], values: Value, accumulate: bool = False) -> Value:
    """x[i0, i1, ...] = values (or += with `accumulate`): a scatter of the broadcast values at the
    coordinates given by the leading index tensors (torch's embedding backward is one)."""
    b = ctx.builder
    if any(i is None for i in indices):
        return _index_put_slices(b, x, indices, values, accumulate)
    count = len(indices)
    shapes = [i.shape for i in indices]
    if all(is_static(s) for s in shapes):
        batch: tuple = tuple(torch.broadcast_shapes(*shapes))
    elif all(len(s) == len(shapes[0]) and all(same_size(p, q) for p, q in zip(s, shapes[0])) for s in shapes):
        batch = shapes[0]
    else:
        raise DynamicShapeError("index_put with index tensors of different dynamic shapes")
    # A dynamic index size that the values pin to a static one (values (2, 5) for an index of size s0):
    # use the static size, as IREE refines the values' side and then rejects the mismatch.
    value_batch = values.shape[: max(values.rank - (x.rank - count), 0)]
    pinned = list(batch)
    for k in range(1, min(len(batch), len(value_batch)) + 1):
        if type(batch[-k]) is not int and type(value_batch[-k]) is int and value_batch[-k] != 1:
            pinned[-k] = value_batch[-k]
    if pinned != list(batch):
        batch = tuple(pinned)
        indices = [b.cast(b.broadcast_to(i, shapes[0]), TensorSpec(batch, i.dtype)) for i in indices]
    updates = b.broadcast_to(b.convert(values, x.dtype), (*batch, *x.shape[count:]))
    return _put_rows(b, x, indices, batch, updates, accumulate)


def _index_put_slices(b: FunctionBuilder, x: Value, indices: Sequence[Value | None], values: Value,
                      accumulate: bool) -> Value:
    """index_put with None (full-slice) entries, static shapes: the indexed dims are moved to the front,
    the values into the same order, and the result back."""
    moved, taken, perm, leading = _front_indexed(b, x, indices)
    count = len(taken)
    batch = tuple(torch.broadcast_shapes(*(i.shape for i in taken)))
    shape = (*batch, *moved.shape[count:])
    values = b.convert(values, x.dtype)
    if leading:
        moves = _batch_moves(len(batch), leading, len(shape))
        updates = b.transpose(b.broadcast_to(values, [shape[m] for m in moves]), _inverse(moves))
    else:
        updates = b.broadcast_to(values, shape)
    return b.transpose(_put_rows(b, moved, taken, batch, updates, accumulate), _inverse(perm))


def _put_rows(b: FunctionBuilder, x: Value, indices: Sequence[Value], batch: Sequence, updates: Value,
              accumulate: bool) -> Value:
    """Scatter `updates` (batch + the trailing dims of `x`) into `x` at the rows picked by the index
    tensors of its leading dims (broadcast to `batch`)."""
    count = len(indices)
    if count == 1:
        coords = b.broadcast_to(_wrap_negative(b, indices[0], x.shape[0]), batch)
    else:
        columns = [
            b.reshape(b.broadcast_to(_wrap_negative(b, i, x.shape[d]), batch), (*batch, 1)) for d, i in enumerate(indices)
        ]
        coords = b.concatenate(columns, len(batch))
    window = range(len(batch), len(batch) + x.rank - count)
    numbers = (
        f"#stablehlo.scatter<update_window_dims = {_dims(window)}, inserted_window_dims = {_dims(range(count))}, "
        f"scatter_dims_to_operand_dims = {_dims(range(count))}, index_vector_dim = {len(batch)}>"
    )
    add = "or" if x.dtype == torch.bool else "add"
    return _scatter_op(b, x, coords, updates, numbers,
                       (lambda bb, current, update: bb.binary(add, current, update)) if accumulate else None)


@support_check(aten.index_put.default)
def _index_put_check(node: torch.fx.Node) -> str | None:
    reason = _slices_check(node)
    if reason is None and any(size_of(d) == 0 for i in node.args[1] if i is not None for d in i.meta["val"].shape):  # type: ignore[union-attr]
        return "empty index tensor"
    return reason


def _is_reshape(source_shape: Sequence, size: Sequence, stride: Sequence, offset=None) -> bool:
    """Whether `as_strided(x, size, stride, offset)` of a contiguous `x` reads all of x in order: a
    reshape (torch's group norm decomposition takes such views of a `[B, G, C/G, 1]` value)."""
    if offset not in (None, 0) and size_of(offset) != 0:
        return False
    size = [size_of(d) for d in size]
    if not same_size(math.prod(size_of(d) for d in source_shape), math.prod(size)):
        return False
    expected: object = 1
    for d, step in zip(reversed(size), reversed(stride)):
        if not (same_size(d, 1) or same_size(size_of(step), expected)):
            return False
        expected = expected * d
    return True


@lowering(aten.as_strided.default, aten.as_strided_copy.default, dynamic=True)
def _as_strided(ctx: LoweringContext, x: Value, size: Sequence[int], stride: Sequence[int],
                storage_offset: int | None = None) -> Value:
    """A strided view of a contiguous tensor: gather the flat positions offset + sum(i_d * stride_d);
    a reshape where it reads all of x in order (the only form with dynamic sizes, `_as_strided_check`)."""
    b = ctx.builder
    shape = ctx.out_spec.shape
    if _is_reshape(x.shape, size, stride, storage_offset):
        return b.reshape(x, shape)
    if ctx.out_spec.numel == 0:
        return b.full(shape, 0, x.dtype)
    x = _whole(b, x)
    flat = _view_of_whole(b, x, b.reshape(x, (x.type.numel,)))
    return _gather(
        b, flat, b.reshape(_strided_positions(b, shape, stride, storage_offset), (*shape, 1)), ctx.out_spec,
        offset_dims=[], collapsed=[0], start_index_map=[0], index_vector_dim=len(shape), slice_sizes=[1],
    )


def _strided_positions(b: FunctionBuilder, shape: Sequence[int], stride: Sequence[int], offset: int | None) -> Value:
    """The flat storage position of every element of a strided view: offset + sum(i_d * stride_d)."""
    position = b.full(shape, int(offset or 0), torch.int64)
    for d, step in enumerate(stride):
        if shape[d] > 1:
            term = b.binary("multiply", b.iota(shape, d, torch.int64), b.full(shape, int(step), torch.int64))
            position = b.binary("add", position, term)
    return position


@lowering(prims.as_strided_scatter.default)
def _as_strided_scatter(ctx: LoweringContext, x: Value, src: Value, size: Sequence[int], stride: Sequence[int],
                        storage_offset: int | None = None) -> Value:
    """`x` (contiguous, its own storage) with the strided view's elements replaced by `src`: a scatter
    at the flat positions the view reads (the backward of as_strided)."""
    b = ctx.builder
    if math.prod(size) == 0:
        return x
    flat = b.reshape(x, (x.type.numel,))
    positions = b.reshape(_strided_positions(b, size, stride, storage_offset), (*size, 1))
    numbers = (f"#stablehlo.scatter<update_window_dims = [], inserted_window_dims = [0], "
               f"scatter_dims_to_operand_dims = [0], index_vector_dim = {len(size)}>")
    written = _scatter_op(b, flat, positions, b.reshape(b.convert(src, x.dtype), tuple(size)), numbers, None,
                          unique=_non_overlapping(size, stride))
    return b.reshape(written, x.shape)


def _non_overlapping(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a strided view reaches every storage position at most once: taken by increasing stride,
    each dim of size > 1 steps past the whole extent of the ones before it."""
    extent = 1
    for n, step in sorted(((n, s) for n, s in zip(size, stride) if n > 1), key=lambda p: p[1]):
        if step < extent:
            return False
        extent = step * n
    return True


def _values(args):
    """FX arguments with each node (a size computed in the graph) replaced by its value."""
    if isinstance(args, (list, tuple)):
        return type(args)(_values(a) for a in args)
    return args.meta["val"] if isinstance(args, torch.fx.Node) else args


@support_check(aten.as_strided.default, aten.as_strided_copy.default, prims.as_strided_scatter.default)
def _as_strided_check(node: torch.fx.Node) -> str | None:
    source = node.args[0].meta["val"]  # type: ignore[union-attr]
    if not source.is_contiguous() or source.storage_offset() != 0:
        return "as_strided of a non-contiguous tensor"
    if not (is_static([size_of(d) for d in source.shape]) and is_static([size_of(d) for d in node.meta["val"].shape])) \
            and (node.target is prims.as_strided_scatter.default or not _is_reshape(source.shape, *_values(node.args[1:]))):
        return f"{node.target} with dynamic sizes, other than a reshape"
    if source.numel() == 0 and node.meta["val"].numel() != 0:
        return "as_strided of an empty tensor"
    return None
