"""Neural-network ops that torch keeps whole in core ATen: convolution (forward, transposed, backward),
max_pool2d_with_indices (forward and backward) and avg_pool2d.

The convolution backward follows the usual identities: grad_input is a transposed convolution of the
output gradient with the weight, grad_weight a convolution of the input with the output gradient
(batch and feature roles swapped), grad_bias a sum.

With dynamic sizes, only the batch dim (dim 0 of activations) may be dynamic: the window arithmetic
of the spatial dims stays static (`_batch_only`).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from pydisc.frontend.lowering.builder import FunctionBuilder, TensorSpec, Value, i64_array
from pydisc.frontend.lowering.indexing import scatter
from pydisc.frontend.lowering.linalg import matmul  # noqa: F401  (rules for mm/bmm live there)
from pydisc.frontend.lowering.reductions import reduce_sum
from pydisc.frontend.lowering.registry import LoweringContext, lowering, support_check
from pydisc.frontend.lowering.size_exprs import size_of

__all__: list[str] = []

aten = torch.ops.aten


def _conv_numbers(lhs: str, rhs: str, out: str, spatial: int) -> str:
    dims = ", ".join(str(i) for i in range(spatial))
    return f"#stablehlo.conv<[{lhs}, {dims}]x[{rhs}, {dims}]->[{out}, {dims}]>"


def _conv(
    b: FunctionBuilder,
    lhs: Value,
    rhs: Value,
    out: TensorSpec,
    *,
    numbers: str,
    strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    feature_groups: int = 1,
    batch_groups: int = 1,
) -> Value:
    # IREE 3.13 rejects a convolution whose (padded) input is longer than its windows reach ("inferred
    # input/output operand #1 has shape's dimension #1 to be 10, but found 9"): drop the rows no window
    # reads, from the high padding first, then from the input itself.
    padding = [tuple(p) for p in padding]
    limits = list(lhs.shape)
    for i in range(len(padding)):
        size = (lhs.shape[2 + i] - 1) * lhs_dilation[i] + 1
        span = (rhs.shape[2 + i] - 1) * rhs_dilation[i] + 1
        needed = (out.shape[2 + i] - 1) * strides[i] + span if out.shape[2 + i] > 0 else None
        excess = 0 if needed is None else size + padding[i][0] + padding[i][1] - needed
        if excess <= 0:
            continue
        low, high = padding[i]
        cut = min(excess, max(high, 0))
        high -= cut
        excess -= cut
        if excess > 0 and lhs_dilation[i] == 1 and excess < limits[2 + i]:
            limits[2 + i] -= excess
        padding[i] = (low, high)
    lhs = b.slice(lhs, [0] * lhs.rank, limits, [1] * lhs.rank)
    attrs = {
        "batch_group_count": f"{batch_groups} : i64",
        "dimension_numbers": numbers,
        "feature_group_count": f"{feature_groups} : i64",
        "lhs_dilation": i64_array(lhs_dilation),
        "padding": "dense<[" + ", ".join(f"[{lo}, {hi}]" for lo, hi in padding) + f"]> : tensor<{len(padding)}x2xi64>",
        "rhs_dilation": i64_array(rhs_dilation),
        "window_strides": i64_array(strides),
    }
    acc = TensorSpec(out.shape, torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype)
    return b.convert(b.op("stablehlo.convolution", [lhs, rhs], acc, attrs), out.dtype)  # type: ignore[arg-type]


def _expand(values: Sequence[int], n: int) -> list[int]:
    return list(values) * n if len(values) == 1 else list(values)


def _add_bias(b: FunctionBuilder, y: Value, bias: Value | None) -> Value:
    if bias is None:
        return y
    return b.binary("add", y, b.broadcast_in_dim(b.convert(bias, y.dtype), y.shape, [1]))


def _transposed_conv(
    b: FunctionBuilder, x: Value, weight: Value, out: TensorSpec, stride: list[int], padding: list[int],
    dilation: list[int], groups: int,
) -> Value:
    """The transposed convolution of `x` (N, Cin, ...) with `weight` (Cin, Cout/G, k...) whose
    output has shape `out` (the output padding is whatever makes that size)."""
    spatial = x.rank - 2
    kernel = weight.shape[2:]
    cin, cout_g = weight.shape[0], weight.shape[1]
    if groups > 1:
        # (G*Cin_g, Cout_g, k) -> (Cin_g, G*Cout_g, k): output features must be grouped contiguously.
        cin_g = cin // groups
        w = b.reshape(weight, (groups, cin_g, cout_g, *kernel))
        w = b.transpose(w, [1, 0, 2, *range(3, 3 + spatial)])
        weight = b.reshape(w, (cin_g, groups * cout_g, *kernel))
    weight = b.reverse(weight, list(range(2, 2 + spatial)))
    pads = []
    for i in range(spatial):
        low = dilation[i] * (kernel[i] - 1) - padding[i]
        natural = (x.shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + 1
        pads.append((low, low + out.shape[2 + i] - natural))
    return _conv(
        b, x, weight, out, numbers=_conv_numbers("b, f", "i, o", "b, f", spatial), strides=[1] * spatial,
        padding=pads, lhs_dilation=stride, rhs_dilation=dilation, feature_groups=groups,
    )


def _batch_only(node: torch.fx.Node, weight: int | None = None) -> str | None:
    """A reason unless every dynamic dim is dim 0 of an activation (not of the weight, argument
    `weight`)."""
    for k, arg in enumerate(node.all_input_nodes + [node]):
        vals = arg.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else (vals,):
            if not isinstance(v, torch.Tensor):
                continue
            shape = [size_of(d) for d in v.shape]
            first = 0 if arg is node or weight is None or node.args[weight] is not arg else -1
            if any(type(d) is not int for i, d in enumerate(shape) if i != first):
                return f"{node.target} with a dynamic dim other than the batch"
    return None


@support_check(aten.convolution.default, aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default)
def _convolution_check(node: torch.fx.Node) -> str | None:
    return _batch_only(node, weight=1 if node.target is aten.convolution.default else None)


@lowering(aten.convolution.default, dynamic=True)
def _convolution(
    ctx: LoweringContext, x: Value, weight: Value, bias: Value | None, stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
    groups: int,
) -> Value:
    b = ctx.builder
    spatial = x.rank - 2
    stride, padding, dilation = _expand(stride, spatial), _expand(padding, spatial), _expand(dilation, spatial)
    if transposed:
        y = _transposed_conv(b, x, weight, ctx.out_spec, stride, padding, dilation, groups)
    else:
        y = _conv(
            b, x, weight, ctx.out_spec, numbers=_conv_numbers("b, f", "o, i", "b, f", spatial), strides=stride,
            padding=[(p, p) for p in padding], lhs_dilation=[1] * spatial, rhs_dilation=dilation,
            feature_groups=groups,
        )
    return _add_bias(b, y, bias)


@lowering(aten.convolution_backward.default, dynamic=True)
def _convolution_backward(
    ctx: LoweringContext, grad: Value, x: Value, weight: Value, bias_sizes: Sequence[int] | None,
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], transposed: bool,
    output_padding: Sequence[int], groups: int, output_mask: Sequence[bool],
) -> tuple[Value | None, Value | None, Value | None]:
    b = ctx.builder
    spatial = x.rank - 2
    stride, padding, dilation = _expand(stride, spatial), _expand(padding, spatial), _expand(dilation, spatial)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = _transposed_conv(b, grad, weight, ctx.out[0], stride, padding, dilation, groups)
    if output_mask[1]:
        kernel = weight.shape[2:]
        lhs, pads = x, []
        for i in range(spatial):
            used = (kernel[i] - 1) * dilation[i] + (grad.shape[2 + i] - 1) * stride[i] + 1
            high = used - x.shape[2 + i] - padding[i]
            if high < 0:  # trailing input rows the forward pass never read: crop instead of padding
                limits = list(lhs.shape)
                limits[2 + i] += high
                lhs = b.slice(lhs, [0] * lhs.rank, limits, [1] * lhs.rank)
                high = 0
            pads.append((padding[i], high))
        # Input as (feature=N, batch=C), gradient as kernel (in=N, out=O): the result is (O, C/G, k...).
        grad_weight = _conv(
            b, lhs, grad, ctx.out[1], numbers=_conv_numbers("f, b", "i, o", "f, b", spatial), strides=dilation,
            padding=pads, lhs_dilation=[1] * spatial, rhs_dilation=stride, batch_groups=groups,
        )
    if output_mask[2]:
        dims = [d for d in range(grad.rank) if d != 1]
        grad_bias = reduce_sum(b, grad, dims, ctx.out[2].dtype)
    return grad_input, grad_weight, grad_bias


@support_check(aten.convolution_backward.default)
def _conv_backward_check(node: torch.fx.Node) -> str | None:
    if node.args[7]:
        return "backward of a transposed convolution"
    return _batch_only(node, weight=2)


# ---- pooling ------------------------------------------------------------------------------------
def _pool_params(x: Value, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int] | int,
                 dilation: Sequence[int] | int = 1, spatial: int = 2) -> tuple[list[int], list[int], list[int], list[int]]:
    kernel = _expand(kernel, spatial)
    stride = _expand(stride, spatial) if stride else kernel
    padding = _expand([padding] if isinstance(padding, int) else padding, spatial)
    dilation = _expand([dilation] if isinstance(dilation, int) else dilation, spatial)
    return kernel, stride, padding, dilation


def _lowest(dtype: torch.dtype) -> float | int:
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


@lowering(aten.max_pool2d_with_indices.default, dynamic=True)
def _max_pool2d_with_indices(
    ctx: LoweringContext, x: Value, kernel_size: Sequence[int], stride: Sequence[int] = (),
    padding: Sequence[int] = (0,), dilation: Sequence[int] = (1,), ceil_mode: bool = False,
) -> tuple[Value, Value]:
    """Max over each window as a chain of strided slices (k*k elementwise steps that fuse well); the
    index is the flat position in the unpadded H*W plane, as torch returns it."""
    b = ctx.builder
    kernel, stride, padding, dilation = _pool_params(x, kernel_size, stride, padding, dilation)
    out = ctx.out[0]
    oh, ow = out.shape[-2:]
    h, w = x.shape[-2:]
    lead = x.rank - 2
    low, high = [0] * x.rank, [0] * x.rank
    for i, size in enumerate((h, w)):
        needed = (out.shape[lead + i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
        low[lead + i], high[lead + i] = padding[i], max(0, needed - size - padding[i])
    padded = b.pad(x, b.constant(_lowest(x.dtype), x.dtype), low, high, [0] * x.rank)
    rows = b.iota(out.shape, lead, torch.int64)
    cols = b.iota(out.shape, lead + 1, torch.int64)
    best = index = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            starts = [0] * x.rank
            starts[lead], starts[lead + 1] = i * dilation[0], j * dilation[1]
            limits = list(padded.shape)
            limits[lead] = starts[lead] + (oh - 1) * stride[0] + 1
            limits[lead + 1] = starts[lead + 1] + (ow - 1) * stride[1] + 1
            strides = [1] * x.rank
            strides[lead], strides[lead + 1] = stride[0], stride[1]
            candidate = b.slice(padded, starts, limits, strides)
            r = b.binary("add", b.binary("multiply", rows, b.full(out.shape, stride[0], torch.int64)),
                         b.full(out.shape, i * dilation[0] - padding[0], torch.int64))
            c = b.binary("add", b.binary("multiply", cols, b.full(out.shape, stride[1], torch.int64)),
                         b.full(out.shape, j * dilation[1] - padding[1], torch.int64))
            flat = b.binary("add", b.binary("multiply", r, b.full(out.shape, w, torch.int64)), c)
            if best is None:
                best, index = candidate, flat
                continue
            take = b.compare("GT", candidate, best)
            if x.dtype.is_floating_point:  # torch: a NaN always takes over
                take = b.binary("or", take, b.compare("NE", candidate, candidate))
            best, index = b.select(take, candidate, best), b.select(take, flat, index)
    return best, index  # type: ignore[return-value]


@lowering(aten.max_pool2d_with_indices_backward.default, dynamic=True)
def _max_pool2d_backward(
    ctx: LoweringContext, grad: Value, x: Value, kernel_size: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], ceil_mode: bool, indices: Value,
) -> Value:
    b = ctx.builder
    if not x.type.is_static:
        return _max_pool2d_backward_by_windows(ctx, grad, x, kernel_size, stride, padding, dilation, indices)
    lead = x.shape[:-2]
    plane = x.shape[-2] * x.shape[-1]
    zeros = b.full((*lead, plane), 0, x.dtype)
    flat_grad = b.reshape(grad, (*lead, grad.shape[-2] * grad.shape[-1]))
    flat_index = b.reshape(indices, (*lead, indices.shape[-2] * indices.shape[-1]))
    summed = scatter(b, zeros, len(lead), flat_index, flat_grad, lambda b_, u, v: b_.binary("add", u, v))
    return b.reshape(summed, x.shape)


def _max_pool2d_backward_by_windows(
    ctx: LoweringContext, grad: Value, x: Value, kernel_size: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], dilation: Sequence[int], indices: Value,
) -> Value:
    """With dynamic sizes, no scatter (IREE 3.13 fails to size a fused scatter's stack buffer): for each
    window offset, the gradient of the outputs whose argmax sits at that offset, spread back to the
    input as in `_avg_pool2d_backward`."""
    b = ctx.builder
    kernel, stride, padding, dilation = _pool_params(x, kernel_size, stride, padding, dilation)
    lead = x.rank - 2
    out = grad.type
    w = x.shape[-1]
    rows = b.iota(out.shape, lead, torch.int64)
    cols = b.iota(out.shape, lead + 1, torch.int64)
    zero = b.constant(0, grad.dtype)
    zeros = b.full(out.shape, 0, grad.dtype)
    total = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            r = b.binary("add", b.binary("multiply", rows, b.full(out.shape, stride[0], torch.int64)),
                         b.full(out.shape, i * dilation[0] - padding[0], torch.int64))
            c = b.binary("add", b.binary("multiply", cols, b.full(out.shape, stride[1], torch.int64)),
                         b.full(out.shape, j * dilation[1] - padding[1], torch.int64))
            flat = b.binary("add", b.binary("multiply", r, b.full(out.shape, w, torch.int64)), c)
            picked = b.select(b.compare("EQ", indices, flat), grad, zeros)
            low = [0] * lead + [i * dilation[0], j * dilation[1]]
            high = [0] * lead + [
                x.shape[lead + d] + 2 * padding[d] - low[lead + d] - ((out.shape[lead + d] - 1) * stride[d] + 1)
                for d in range(2)
            ]
            spread = b.pad(picked, zero, low, high, [0] * lead + [s - 1 for s in stride])
            total = spread if total is None else b.binary("add", total, spread)
    limits = list(total.shape[:lead]) + [padding[d] + x.shape[lead + d] for d in range(2)]  # type: ignore[union-attr]
    return b.slice(total, [0] * lead + list(padding), limits, [1] * x.rank, shape=x.shape)  # type: ignore[arg-type]


@lowering(aten.avg_pool2d.default, aten.avg_pool3d.default, dynamic=True)
def _avg_pool(
    ctx: LoweringContext, x: Value, kernel_size: Sequence[int], stride: Sequence[int] = (),
    padding: Sequence[int] = (0,), ceil_mode: bool = False, count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Value:
    """avg_pool2d/3d: a window sum (reduce_window over the zero-padded input, padded further at the end
    where ceil_mode lets the last windows start there) divided by torch's divisor per position."""
    b = ctx.builder
    spatial = 3 if ctx.node.target is aten.avg_pool3d.default else 2
    kernel, stride, padding, _ = _pool_params(x, kernel_size, stride, padding, spatial=spatial)
    lead = x.rank - spatial
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xs = b.convert(x, acc)
    if not x.type.is_static:  # IREE 3.13 cannot lower a reduce_window of dynamic shape
        return _avg_pool2d_by_slices(ctx, xs, kernel, stride, padding, count_include_pad, divisor_override)
    out = ctx.out_spec.shape
    # A window longer than the padded input (HF EfficientNet pools with a kernel of 1280 and ceil_mode)
    # sums what one as long as the padded input sums: the rest lies past it.
    reach = [min(k, x.shape[lead + d] + 2 * padding[d]) for d, k in enumerate(kernel)]
    window = [1] * lead + reach
    strides = [1] * lead + stride
    highs = [(out[lead + d] - 1) * stride[d] + reach[d] - x.shape[lead + d] - padding[d] for d in range(spatial)]
    pads = [(0, 0)] * lead + [(p, max(h, 0)) for p, h in zip(padding, highs)]
    if any(h < 0 for h in highs):
        # the last rows no window reads are cut: IREE 3.13 rejects a reduce_window whose input is longer
        # than its windows reach ("inferred input/output operand #1 has shape's dimension #0 to be 3,
        # but found 2"), as it does such a convolution
        limits = list(x.shape[:lead]) + [x.shape[lead + d] + min(h, 0) for d, h in enumerate(highs)]
        xs = b.slice(xs, [0] * x.rank, limits, [1] * x.rank)
    add = lambda u, v: [b.binary("add", u, v)]  # noqa: E731
    total = b.reduce_window(xs, b.constant(0, acc), window, strides, pads, add)
    count = _pool_divisor(b, x, ctx.out_spec.with_dtype(acc), kernel, stride, padding, count_include_pad,
                          divisor_override)
    return b.convert(b.binary("divide", total, count), ctx.out_dtype)


def _avg_pool2d_by_slices(
    ctx: LoweringContext, x: Value, kernel: list[int], stride: list[int], padding: list[int],
    count_include_pad: bool, divisor_override: int | None,
) -> Value:
    """The window sums as k*k strided slices of the zero-padded input, added; the divisor per output
    position depends only on the (static) spatial sizes, so it is computed here."""
    b = ctx.builder
    lead = x.rank - 2
    out = ctx.out_spec.with_dtype(x.dtype)
    padded = b.pad(x, b.constant(0, x.dtype), [0] * lead + padding, [0] * lead + padding, [0] * x.rank)
    total = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            starts = [0] * lead + [i, j]
            limits = list(padded.shape[:lead]) + [
                starts[lead + d] + (out.shape[lead + d] - 1) * stride[d] + 1 for d in range(2)
            ]
            window = b.slice(padded, starts, limits, [1] * lead + stride, shape=out.shape)
            total = window if total is None else b.binary("add", total, window)
    count = _pool_divisor(b, x, out, kernel, stride, padding, count_include_pad, divisor_override)
    return b.convert(b.binary("divide", total, count), ctx.out_dtype)  # type: ignore[arg-type]


def _pool_divisor(b: FunctionBuilder, x: Value, out: TensorSpec, kernel: list[int], stride: list[int],
                  padding: list[int], count_include_pad: bool, divisor_override: int | None) -> Value:
    """avg_pool's divisor per output position, of shape `out`, as torch computes it: the window clipped
    to the padded input (ceil_mode's last windows may reach past it), or without count_include_pad the
    count of unpadded elements. It depends only on the static spatial sizes: a product of one vector per
    spatial dim."""
    spatial = len(kernel)
    lead = x.rank - spatial
    if divisor_override:
        return b.full(out.shape, divisor_override, out.dtype)
    divisor = torch.ones(())
    for d in range(spatial):
        n, k, s, p = x.shape[lead + d], kernel[d], stride[d], padding[d]
        start = torch.arange(out.shape[lead + d]) * s - p
        end = torch.minimum(start + k, torch.tensor(n + p))
        if not count_include_pad:
            start, end = start.clamp(min=0), end.clamp(max=n)
        divisor = divisor[..., None] * (end - start).to(torch.float64)
    return b.broadcast_in_dim(b.literal(divisor.to(out.dtype)), out.shape, list(range(lead, lead + spatial)))


@lowering(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default, dynamic=True)
def _avg_pool_backward(
    ctx: LoweringContext, grad: Value, x: Value, kernel_size: Sequence[int], stride: Sequence[int],
    padding: Sequence[int], ceil_mode: bool, count_include_pad: bool, divisor_override: int | None,
) -> Value:
    """Each window offset sends grad / divisor back to the input positions it read: the scaled gradient
    spread out by the stride (interior padding), shifted by the offset, summed over the window's offsets
    and cropped to the unpadded input (ceil_mode's windows past the padded input read nothing there)."""
    b = ctx.builder
    spatial = 3 if ctx.node.target is aten.avg_pool3d_backward.default else 2
    kernel, stride, padding, _ = _pool_params(x, kernel_size, stride, padding, spatial=spatial)
    lead = x.rank - spatial
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    g = b.convert(grad, acc)
    g = b.binary("divide", g, _pool_divisor(b, x, g.type, kernel, stride, padding, count_include_pad, divisor_override))
    zero = b.constant(0, acc)
    total = None
    # (offsets past the end of the input reach none of it: HF EfficientNet's kernel of 1280 over 7x7
    # would be 1.6 million pads)
    reach = [min(k, x.shape[lead + d] + padding[d]) for d, k in enumerate(kernel)]
    for offset in itertools.product(*(range(k) for k in reach)):
        low = [0] * lead + list(offset)
        high = [0] * lead + [
            x.shape[lead + d] + 2 * padding[d] - offset[d] - ((g.shape[lead + d] - 1) * stride[d] + 1)
            for d in range(spatial)
        ]
        spread = b.pad(g, zero, low, high, [0] * lead + [s - 1 for s in stride])
        total = spread if total is None else b.binary("add", total, spread)
    starts = [0] * lead + padding
    limits = list(total.shape[:lead]) + [padding[d] + x.shape[lead + d] for d in range(spatial)]  # type: ignore[union-attr]
    cropped = b.slice(total, starts, limits, [1] * x.rank, shape=x.shape)  # type: ignore[arg-type]
    return b.convert(cropped, ctx.out_dtype)


@support_check(aten.avg_pool2d.default, aten.avg_pool2d_backward.default, aten.avg_pool3d.default,
               aten.avg_pool3d_backward.default)
def _avg_pool_check(node: torch.fx.Node) -> str | None:
    args = list(node.args) + [None] * 8
    ceil_mode = args[4] if node.target in (aten.avg_pool2d.default, aten.avg_pool3d.default) else args[5]
    reason = _batch_only(node)
    if reason is None and (ceil_mode or node.target in (aten.avg_pool3d.default, aten.avg_pool3d_backward.default)):
        if any(not isinstance(size_of(d), int) for n in (node.args[0], node) for d in n.meta["val"].shape):  # type: ignore[union-attr]
            return f"{node.target} with ceil_mode or in 3d, of dynamic shape"
    return reason
