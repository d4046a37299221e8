"""Shape ops, copies, dtype conversions and tensor creation.

View ops arrive here already functionalized (`view_copy`, `permute`, ...), so each is a pure value
transformation. Output shapes are the recorded ones; the rules normalise dims the way torch does
(negative dims wrap, slice bounds clamp).
"""
from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch

from pydisc.frontend.lowering.builder import TensorSpec, Value
from pydisc.frontend.lowering.size_exprs import Size, size_max, size_min, size_of
from pydisc.frontend.lowering.elementwise import as_operand, compute_dtype
from pydisc.frontend.lowering.registry import LoweringContext, lowering, support_check

__all__ = ["normalize_dim"]

aten = torch.ops.aten
prims = torch.ops.prims


def normalize_dim(dim: int, rank: int) -> int:
    # torch lets a 0-d tensor use dim 0 / -1.
    return dim % max(rank, 1)


# ---- pure reshapes ------------------------------------------------------------------------------
@lowering(
    aten.view.default, aten.view_copy.default, aten._unsafe_view.default, aten.reshape.default,
    aten._reshape_alias.default, aten._reshape_alias_copy.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.default, aten.squeeze_copy.dim,
    aten.squeeze_copy.dims, aten.unsqueeze.default, aten.unsqueeze_copy.default,
    prims.squeeze.default, aten.flatten.using_ints,
    dynamic=True,
)
def _reshape(ctx: LoweringContext, x: Value, *_: object, **__: object) -> Value:
    return ctx.builder.reshape(x, ctx.out_spec.shape)


@lowering(aten.permute.default, aten.permute_copy.default, prims.transpose.default, dynamic=True)
def _permute(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    return ctx.builder.transpose(x, [normalize_dim(d, x.rank) for d in dims])


@lowering(aten.transpose.int, aten.transpose_copy.int, dynamic=True)
def _transpose(ctx: LoweringContext, x: Value, dim0: int, dim1: int) -> Value:
    perm = list(range(x.rank))
    a, b = normalize_dim(dim0, x.rank), normalize_dim(dim1, x.rank)
    perm[a], perm[b] = perm[b], perm[a]
    return ctx.builder.transpose(x, perm)


@lowering(aten.expand.default, aten.expand_copy.default, dynamic=True)
def _expand(ctx: LoweringContext, x: Value, size: Sequence[int], *, implicit: bool = False) -> Value:
    return ctx.builder.broadcast_to(x, ctx.out_spec.shape)


@lowering(prims.broadcast_in_dim.default, dynamic=True)
def _prims_broadcast(ctx: LoweringContext, x: Value, shape: Sequence[int], dims: Sequence[int]) -> Value:
    return ctx.builder.broadcast_in_dim(x, ctx.out_spec.shape, dims)


# ---- copies and conversions ---------------------------------------------------------------------
@lowering(
    aten.clone.default, aten.alias.default, aten.alias_copy.default, aten.detach.default,
    aten.detach_copy.default, aten.lift_fresh_copy.default, aten.contiguous.default,
    aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype,
    aten._conj.default, aten.resolve_conj.default, aten.resolve_neg.default,
    prims.copy_strided.default,     # (torch's lerp decomposition gives its result the strides eager's has)
    dynamic=True,
)
def _convert(ctx: LoweringContext, x: Value, *_: object, **__: object) -> Value:
    # float -> int truncates toward zero and anything -> bool means != 0, as in torch (see builder).
    return ctx.builder.convert(x, ctx.out_dtype)


@lowering(aten.copy.default, aten.copy_.default, dynamic=True)
def _copy(ctx: LoweringContext, dst: Value, src: Value, non_blocking: bool = False) -> Value:
    b = ctx.builder
    return b.broadcast_to(b.convert(src, ctx.out_dtype), ctx.out_spec.shape)


@support_check(aten.copy_.default)
def _copy_check(node: torch.fx.Node) -> str | None:
    """Decompositions traced below functionalization (batch norm's running stats) leave `copy_`s in
    the graph. Lowered as a value (the copy_ node *is* the new contents), which is only right when
    nothing reads the old destination node afterwards."""
    dst = node.args[0]
    later = [u for u in dst.users if u is not node and _comes_after(u, node)]  # type: ignore[union-attr]
    return "copy_ into a tensor that is read afterwards" if later else None


def _comes_after(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    node = b.next
    while node.op != "root":
        if node is a:
            return True
        node = node.next
    return False


# ---- slicing and joining ------------------------------------------------------------------------
def _slice_bounds(size: Size, start: Size | None, end: Size | None) -> tuple[Size, Size]:
    start = 0 if start is None else start
    end = size if end is None else end
    if type(size) is not int or type(start) is not int or type(end) is not int:
        return _symbolic_slice_bounds(size, start, end)
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


def _symbolic_slice_bounds(size: Size, start: Size, end: Size) -> tuple[Size, Size]:
    """torch's clamping of slice bounds, as size expressions computed at run time."""
    start = _position(start, size)
    start = start if _known_le(start, size) else size_min(start, size)
    if type(end) is int and end >= _UNBOUNDED:
        return start, size
    end = _position(end, size)
    end = end if _known_le(end, size) else size_min(end, size)
    return start, end if _known_le(start, end) else size_max(start, end)


_UNBOUNDED = 1 << 62  # x[a:] arrives as end = sys.maxsize


def _position(index: Size, size: Size) -> Size:
    """A non-negative position: -k counts from the end. A symbolic index is non-negative (`_bounds_check`
    refuses the others)."""
    if type(index) is int:
        return index + size if index < 0 else index
    return index


def _known_le(a: Size, b: Size) -> bool:
    if type(a) is int and type(b) is int:
        return a <= b
    return bool(sympy.sympify(b - a).is_nonnegative)


@lowering(aten.slice.Tensor, aten.slice_copy.Tensor, dynamic=True)
def _slice(ctx: LoweringContext, x: Value, dim: int = 0, start: Size | None = None, end: Size | None = None,
           step: int = 1) -> Value:
    dim = normalize_dim(dim, x.rank)
    lo, hi = _slice_bounds(x.shape[dim], start, end)
    starts, limits, strides = [0] * x.rank, list(x.shape), [1] * x.rank
    starts[dim], limits[dim], strides[dim] = lo, hi, step
    return ctx.builder.slice(x, starts, limits, strides, shape=ctx.out_spec.shape)


@support_check(aten.slice.Tensor, aten.slice_copy.Tensor, aten.select.int, aten.select_copy.int)
def _bounds_check(node: torch.fx.Node) -> str | None:
    """A symbolic bound must be non-negative at every size the graph is valid for (its sign decides how
    torch clamps it): checked against the ranges the ShapeEnv knows for its symbols."""
    names = ("start", "end") if node.target in (aten.slice.Tensor, aten.slice_copy.Tensor) else ("index",)
    for position, name in enumerate(names, start=2):
        value = node.args[position] if len(node.args) > position else node.kwargs.get(name)
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if isinstance(val, torch.SymInt) and not isinstance(size_of(val), int):
            expr = size_of(val)
            if not (expr.is_nonnegative or val.node.shape_env.bound_sympy(expr).lower >= 0):
                return f"a {name} ({expr}) that may be negative"
    return None


@lowering(aten.select.int, aten.select_copy.int, dynamic=True)
def _select(ctx: LoweringContext, x: Value, dim: int, index: Size, spec: TensorSpec | None = None) -> Value:
    dim = normalize_dim(dim, x.rank)
    index = _position(index, x.shape[dim])
    starts, limits = [0] * x.rank, list(x.shape)
    starts[dim], limits[dim] = index, index + 1
    shape = (spec or ctx.out_spec).shape
    sliced_shape = list(x.shape)
    sliced_shape[dim] = 1
    return ctx.builder.reshape(ctx.builder.slice(x, starts, limits, [1] * x.rank, shape=sliced_shape), shape)


@lowering(aten.cat.default, dynamic=True)
def _cat(ctx: LoweringContext, tensors: Sequence[Value], dim: int = 0) -> Value:
    b = ctx.builder
    out = ctx.out_spec
    # torch skips legacy empty 1-D tensors whatever the dim.
    parts = [t for t in tensors if not (t.rank == 1 and t.shape[0] == 0)]
    if not parts:
        return b.full(out.shape, 0, out.dtype)
    dim = normalize_dim(dim, out.rank)
    return b.concatenate([b.convert(t, out.dtype) for t in parts], dim)


@lowering(aten.split_with_sizes.default, aten.split_with_sizes_copy.default, dynamic=True)
def _split_with_sizes(ctx: LoweringContext, x: Value, sizes: Sequence[int], dim: int = 0) -> tuple[Value, ...]:
    dim = normalize_dim(dim, x.rank)
    results, offset = [], 0
    for size, spec in zip(sizes, ctx.out):
        starts, limits = [0] * x.rank, list(x.shape)
        starts[dim], limits[dim] = offset, offset + size
        results.append(ctx.builder.slice(x, starts, limits, [1] * x.rank, shape=spec.shape))
        offset += size
    return tuple(results)


@lowering(aten.unbind.int, aten.unbind_copy.int, dynamic=True)
def _unbind(ctx: LoweringContext, x: Value, dim: int = 0) -> tuple[Value, ...]:
    dim = normalize_dim(dim, x.rank)
    return tuple(_select(ctx, x, dim, i, spec) for i, spec in enumerate(ctx.out))


@lowering(aten.constant_pad_nd.default, dynamic=True)
def _constant_pad(ctx: LoweringContext, x: Value, pad: Sequence[int], value: float = 0) -> Value:
    """Padding by fixed amounts (HF's shift of the labels, `F.pad(labels, (0, 1), value=-100)`), also of
    dynamic dims; amounts that are themselves sizes are not supported (`_constant_pad_check`)."""
    b = ctx.builder
    low, high = [0] * x.rank, [0] * x.rank
    for i in range(len(pad) // 2):
        # pad lists (low, high) pairs starting from the last dim; negative values crop.
        low[x.rank - 1 - i], high[x.rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    if not x.type.is_static and any(a < 0 for a in low + high):
        # IREE 3.13 cannot legalize a negative pad of a dynamic dim (the gradient of a pad along the
        # length, MobileBERT's trigram embedding): the crop is a slice, then what remains pads
        start = [max(0, -lo) for lo in low]
        limit = [d + min(0, hi) for d, hi in zip(x.shape, high)]
        x = b.slice(x, start, limit, [1] * x.rank, shape=[hi - lo for lo, hi in zip(start, limit)])
        low, high = [max(0, a) for a in low], [max(0, a) for a in high]
    return b.pad(x, b.constant(value, x.dtype), low, high, [0] * x.rank, shape=ctx.out_spec.shape)


@support_check(aten.constant_pad_nd.default)
def _constant_pad_check(node: torch.fx.Node) -> str | None:
    pad = node.args[1]
    if not all(isinstance(p, int) for p in pad):     # type: ignore[union-attr]
        return "padding by a size that is not a number"
    return None


@lowering(aten.flip.default, dynamic=True)
def _flip(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    return ctx.builder.reverse(x, sorted({normalize_dim(d, x.rank) for d in dims}))


# ---- creation -----------------------------------------------------------------------------------
def _fill(ctx: LoweringContext, value: float | int | bool | Value) -> Value:
    b = ctx.builder
    return as_operand(b, value, ctx.out_dtype, ctx.out_spec.shape)


@lowering(aten.full.default, aten.new_full.default, aten.full_like.default, dynamic=True)
def _full(ctx: LoweringContext, *args: object, **_: object) -> Value:
    # full(size, value), new_full(self, size, value), full_like(self, value)
    value = args[1] if ctx.node.target is not aten.new_full.default else args[2]
    return _fill(ctx, value)  # type: ignore[arg-type]


@lowering(aten.scalar_tensor.default, dynamic=True)
def _scalar_tensor(ctx: LoweringContext, value: float, **_: object) -> Value:
    return _fill(ctx, value)


@lowering(
    aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.empty.memory_format,
    aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
    aten.new_empty_strided.default, aten.empty_permuted.default, aten.zero.default,
    dynamic=True,
)
def _zeros(ctx: LoweringContext, *_: object, **__: object) -> Value:
    # Uninitialised memory is zeros here: deterministic, and free to materialise.
    return _fill(ctx, 0)


@lowering(aten.ones.default, aten.ones_like.default, aten.new_ones.default, dynamic=True)
def _ones(ctx: LoweringContext, *_: object, **__: object) -> Value:
    return _fill(ctx, 1)


def _range(ctx: LoweringContext, start: float, step: float) -> Value:
    b = ctx.builder
    out = ctx.out_spec
    dtype = compute_dtype(out.dtype) if out.dtype.is_floating_point else torch.int64
    index = b.iota(out.shape, 0, dtype)
    scaled = b.binary("multiply", index, b.full(out.shape, step, dtype))
    return b.convert(b.binary("add", scaled, b.full(out.shape, start, dtype)), out.dtype)


@lowering(aten.arange.default, aten.arange.start, aten.arange.start_step, dynamic=True)
def _arange(ctx: LoweringContext, *args: float, **_: object) -> Value:
    if ctx.node.target is aten.arange.default:
        return _range(ctx, 0, 1)
    step = args[2] if ctx.node.target is aten.arange.start_step and len(args) > 2 else 1
    return _range(ctx, args[0], step)


@lowering(prims.iota.default, dynamic=True)
def _iota(ctx: LoweringContext, length: int, *, start: int, step: int, **_: object) -> Value:
    return _range(ctx, start, step)
