"""The decomposition table used when a recorded step is traced into core ATen.

pydisc lowers only what is left after decomposition, so every op decomposed here is one op that needs
no hand-written lowering rule. The table is torch's own core-ATen table plus torch's decompositions of
ops that the core set keeps whole (softmax, norms, pooling backward, ...), which torch expects backends
to lower but which are simpler for us to see as elementwise ops and reductions.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch._decomp import core_aten_decompositions, decomposition_table, get_decompositions
from torch._decomp.decompositions import _normalize_start_end
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..diagnostics import log
from .policy import KEPT_WHOLE, library_ops_in_torch
from .sdpa import SDPA_DECOMPOSITIONS

__all__ = ["DECOMPOSITIONS", "conforming", "decompositions_for"]

aten = torch.ops.aten

# Ops kept whole by core ATen that torch can still decompose for us. Ops with a hand-written rule
# (convolution, convolution_backward, max_pool2d_with_indices, avg_pool2d, ...) are deliberately absent.
_EXTRA: list[OpOverload | OpOverloadPacket] = [
    aten._log_softmax,
    aten._softmax,
    aten._log_softmax_backward_data,
    aten._softmax_backward_data,
    aten.nll_loss_forward,
    aten.nll_loss_backward,
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
    aten.threshold_backward,
    aten.gelu,
    aten.gelu_backward,
    aten.embedding_dense_backward,
    aten.addmm,
    aten.t,
    aten.hardtanh,
    aten.elu,
    aten.leaky_relu,
    aten.mean.dim,
    aten.var_mean,
    aten.var,
    aten.std,
    aten.unsqueeze,
    aten.expand,
    aten.repeat,
    aten.linalg_vector_norm,
    aten.native_dropout_backward,
    aten._adaptive_avg_pool2d,
    aten.slice_scatter,
    aten.select_scatter,
    aten.baddbmm,
    aten.cumsum,
    # Found missing by the OpInfo sweep (tests/opinfo): torch decomposes them into ops we lower.
    aten.diagonal_scatter,
    aten.diagonal_copy,
    aten.upsample_nearest1d,
    aten.upsample_nearest2d,
    aten.upsample_nearest3d,
    aten._upsample_nearest_exact2d,
    aten.upsample_linear1d,
    aten.upsample_bilinear2d,
    aten.upsample_trilinear3d,
    aten.grid_sampler_2d,
    aten.native_group_norm,
    aten.native_group_norm_backward,
    aten.roll,
    aten.as_strided_scatter,
    aten.im2col,
    aten.col2im,
    aten.round.decimals,
    aten.cumprod,
    aten.max_pool3d_with_indices,
]


# Backward ops that torch does not decompose, of forward ops that only pick elements (nearest
# upsampling, replication padding): the forward decomposition run on the positions 0..n-1 says where
# each output element comes from, and the gradient is the output gradient added back there (a
# scatter-add), the transpose of that gather.
def _gather_transpose(forward: Callable[[torch.Tensor], torch.Tensor], grad_output: torch.Tensor,
                      input_size: list[int]) -> torch.Tensor:
    numel = 1
    for s in input_size:
        numel *= s
    positions = forward(torch.arange(numel, device=grad_output.device).reshape(input_size))
    flat = grad_output.new_zeros((numel,))
    return aten.index_put(flat, [positions.reshape(-1)], grad_output.reshape(-1), True).reshape(input_size)


def _upsample_backward(forward: OpOverload) -> Callable:
    def backward(grad_output: torch.Tensor, output_size: list[int], input_size: list[int],
                 *scales: float | None) -> torch.Tensor:
        return _gather_transpose(lambda x: forward(x, output_size, *scales), grad_output, input_size)
    return backward


def _pad_backward(forward: OpOverload) -> Callable:
    def backward(grad_output: torch.Tensor, x: torch.Tensor, padding: list[int]) -> torch.Tensor:
        return _gather_transpose(lambda t: forward(t, padding), grad_output, list(x.shape))
    return backward


def _max_pool3d_backward(grad_output: torch.Tensor, x: torch.Tensor, kernel_size: list[int],
                         stride: list[int], padding: list[int], dilation: list[int], ceil_mode: bool,
                         indices: torch.Tensor) -> torch.Tensor:
    """The gradient goes to the input position each window took its maximum from: `indices` holds it
    flattened over the (D, H, W) plane, so the backward is a scatter-add along the flattened plane."""
    plane = x.shape[-3] * x.shape[-2] * x.shape[-1]
    flat = grad_output.new_zeros((*x.shape[:-3], plane))
    return aten.scatter_add(flat, -1, indices.flatten(-3), grad_output.flatten(-3)).reshape(x.shape)


def _adaptive_weights(out_size: int, in_size: int, like: torch.Tensor) -> torch.Tensor:
    """(out_size, in_size): row i averages input positions floor(i*in/out) .. ceil((i+1)*in/out) - 1,
    adaptive average pooling's windows along one dim."""
    i = torch.arange(out_size, device=like.device)
    start = torch.div(i * in_size, out_size, rounding_mode="floor")
    end = torch.div((i + 1) * in_size + out_size - 1, out_size, rounding_mode="floor")
    h = torch.arange(in_size, device=like.device)
    window = (h[None, :] >= start[:, None]) & (h[None, :] < end[:, None])
    return window.to(torch.float32) / (end - start)[:, None].to(torch.float32)


def _adaptive_apply(x: torch.Tensor, sizes: list[int], transpose: bool) -> torch.Tensor:
    """Adaptive average pooling (or, with `transpose`, its backward) of the last len(sizes) dims of `x`,
    one dim at a time: a matmul with that dim's window weights, in float32."""
    dtype = x.dtype
    y = x.to(torch.float32)
    spatial = len(sizes)
    for k in range(spatial):
        dim = y.dim() - spatial + k
        weights = _adaptive_weights(y.shape[dim], sizes[k], y) if transpose else \
            _adaptive_weights(sizes[k], y.shape[dim], y)
        y = torch.matmul(y.movedim(dim, -1), weights.t() if not transpose else weights).movedim(-1, dim)
    return y.to(dtype)


def _linear_backward(grad_output: torch.Tensor, output_size: list[int], input_size: list[int],
                     align_corners: bool, *scales: float | None) -> torch.Tensor:
    """Backward of linear/bilinear/trilinear upsampling: separable, so per dim a matmul with the
    transposed interpolation weights, which the forward (linear 1d, decomposed) gives when run on the
    identity matrix."""
    spatial = len(output_size)
    scales = scales + (None,) * (spatial - len(scales))
    dtype = grad_output.dtype
    y = grad_output.to(torch.float32)
    for k in range(spatial):
        dim = y.dim() - spatial + k
        eye = torch.eye(input_size[2 + k], dtype=torch.float32, device=y.device)
        weights = aten.upsample_linear1d(eye[None], [output_size[k]], align_corners, scales[k])[0]   # (in, out)
        y = torch.matmul(y.movedim(dim, -1), weights.t()).movedim(-1, dim)
    return y.to(dtype)


def _masked_positions(mask: torch.Tensor) -> torch.Tensor:
    """For each element of `mask` (flattened), the index of the source element masked_scatter puts
    there: the number of True elements before it (its own included) - 1, clamped at 0 where none."""
    return (torch.cumsum(mask.reshape(-1).to(torch.int64), 0) - 1).clamp(min=0)


def _masked_scatter(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The k-th True position of `mask` takes source's k-th element: a gather at the running count of
    True elements, static in shape (unlike masked_select)."""
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    if source.numel() == 0:     # (eager requires a mask with nothing set then)
        return x.expand(shape).clone()
    mask = mask.expand(shape)
    picked = aten.index(source.reshape(-1), [_masked_positions(mask)]).reshape(shape)
    return torch.where(mask, picked, x.expand(shape))


def _masked_scatter_backward(grad_output: torch.Tensor, mask: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Source's gradient: the output gradient at the k-th True position of `mask` goes to element k."""
    numel = 1
    for s in sizes:
        numel *= s
    mask = mask.expand(grad_output.shape)
    values = torch.where(mask, grad_output, torch.zeros_like(grad_output)).reshape(-1)
    # positions stay below numel: eager requires a source with at least as many elements as True's
    flat = aten.index_put(grad_output.new_zeros((numel,)), [_masked_positions(mask)], values, True)
    return flat.reshape(sizes)


def _diagonal_scatter(x: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0,
                      dim2: int = 1) -> torch.Tensor:
    """diagonal_scatter as a select (torch's decomposition writes into a diagonal view with copy_,
    which is left as an in-place op): with dim1, dim2 moved last, position (r, c) with c - r == offset
    takes src[..., r - max(-offset, 0)]."""
    if src.shape[-1] == 0:
        return x.clone()
    moved = x.movedim((dim1, dim2), (-2, -1))
    rows = torch.arange(moved.shape[-2], device=x.device)
    cols = torch.arange(moved.shape[-1], device=x.device)
    on = (cols[None, :] - rows[:, None]) == offset
    k = (rows - max(-offset, 0)).clamp(0, src.shape[-1] - 1)
    values = src.index_select(-1, k).unsqueeze(-1).to(x.dtype)
    return torch.where(on, values, moved).movedim((-2, -1), (dim1, dim2))


def _slice_scatter(x: torch.Tensor, src: torch.Tensor, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> torch.Tensor:
    """slice_scatter, and with it the gradient of every slice (`slice_backward`), as the parts of `x`
    around the slice concatenated with `src`. torch's decomposition selects with a mask and an `index`
    with full-slice entries, which has no rule with dynamic sizes: in a dynamic-shape step the gradient of
    `logits[..., :4]` ran in torch and cut the step's cluster in two. A strided slice (`x[..., ::2]`,
    rotary embeddings) of a dim of static size that the step divides is a slice of x viewed as
    (size / step, step) there, at one position of the second dim; other strided slices keep torch's
    decomposition."""
    dim = dim % x.dim()
    size = x.shape[dim]
    start, end = _normalize_start_end(x, dim, start, end)
    if step != 1:
        if type(size) is not int or size % step or end <= start:
            return decomposition_table[aten.slice_scatter.default](x, src, dim, start, end, step)
        rows = x.unflatten(dim, (size // step, step))
        first = start // step
        inner = _slice_scatter(rows.select(dim + 1, start % step), src, dim, first, first + src.shape[dim])
        return aten.select_scatter(rows, inner, dim + 1, start % step).flatten(dim, dim + 1)
    shape = list(x.shape)
    shape[dim] = end - start
    parts = [src.expand(shape)]
    if start != 0:
        parts.insert(0, x.narrow(dim, 0, start))
    if end != size:
        parts.append(x.narrow(dim, end, size - end))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone()


def _batch_norm_backward(torch_decomposition: Callable) -> Callable:
    """torch's decomposition of native_batch_norm_backward, with the batch mean of a training step in
    half precision taken again from the input in float32: on the CPU the saved mean is rounded to the
    input's dtype, and x - mean then carries that rounding into every gradient (sum(x - mean) is no
    longer 0), where eager's kernel, and CUDA's float32 saved statistics, do not."""
    def backward(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                 output_mask):
        if train and save_mean is not None and save_mean.dtype in (torch.float16, torch.bfloat16):
            dims = [d for d in range(x.dim()) if d != 1]
            save_mean = x.to(torch.float32).mean(dims)
        return torch_decomposition(grad_out, x, weight, running_mean, running_var, save_mean, save_invstd,
                                   train, eps, output_mask)
    return backward


def _weight_norm_backward(grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor,
                          dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_weight_norm_interface_backward` (torch has no decomposition of it): w = g * v / |v|, the norm over
    every dim but `dim`, so grad_g = sum(grad_w * v) / |v| and grad_v = g / |v| * (grad_w - v * grad_g / |v|),
    in float32 at least, as the kernel accumulates."""
    dim = dim % v.dim()
    acc = torch.promote_types(v.dtype, torch.float32)
    dims = [d for d in range(v.dim()) if d != dim]
    gw, vv, gg, n = grad_w.to(acc), v.to(acc), g.to(acc), norms.to(acc)
    grad_g = (gw * vv).sum(dims, keepdim=True) / n
    grad_v = gg / n * (gw - vv * (grad_g / n))
    return grad_v.to(v.dtype), grad_g.to(g.dtype)


def _gather_backwards() -> dict[OpOverload, Callable]:
    table: dict[OpOverload, Callable] = {}
    for name in ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                 "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d"):
        table[getattr(aten, name + "_backward").default] = _upsample_backward(getattr(aten, name).default)
    for name in ("replication_pad1d", "replication_pad2d", "replication_pad3d"):
        table[getattr(aten, name + "_backward").default] = _pad_backward(getattr(aten, name).default)
    table[aten.max_pool3d_with_indices_backward.default] = _max_pool3d_backward
    table[aten._adaptive_avg_pool2d_backward.default] = lambda g, x: _adaptive_apply(g, list(x.shape[-2:]), True)
    table[aten._adaptive_avg_pool3d_backward.default] = lambda g, x: _adaptive_apply(g, list(x.shape[-3:]), True)
    table[aten._adaptive_avg_pool3d.default] = lambda x, size: _adaptive_apply(x, list(size), False)
    for name in ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"):
        table[getattr(aten, name + "_backward").default] = _linear_backward
    table[aten.masked_scatter.default] = _masked_scatter
    table[aten.masked_scatter_backward.default] = _masked_scatter_backward
    table[aten.diagonal_scatter.default] = _diagonal_scatter
    table[aten._weight_norm_interface_backward.default] = _weight_norm_backward
    return table


# Multi-tensor ops of the optimizers (Adam(foreach=True), SGD): torch has no decomposition for them,
# and each one is just its single-tensor op applied to the i-th element of every list argument.
_FOREACH_BASES = (
    "add", "sub", "mul", "div", "addcmul", "addcdiv", "lerp", "sqrt", "rsqrt", "neg", "abs", "exp",
    "log", "reciprocal", "sign", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "zero", "copy",
    "sigmoid", "tanh",
)


def _foreach_decomposition(base: OpOverloadPacket) -> Callable:
    # Some foreach schemas take positionally what the single-tensor op takes by keyword
    # (`_foreach_addcmul(self, t1, t2, value)` vs `addcmul(self, t1, t2, *, value)`).
    schema = getattr(base, base.overloads()[0])._schema
    positional = sum(1 for a in schema.arguments if not a.kwarg_only)
    keyword_names = [a.name for a in schema.arguments if a.kwarg_only]

    def decomposed(*args: object, **kwargs: object) -> list[torch.Tensor]:
        length = next(len(a) for a in args if isinstance(a, (list, tuple)))
        extra = dict(zip(keyword_names, args[positional:]))
        args = args[:positional]

        def pick(arg: object, i: int) -> object:
            return arg[i] if isinstance(arg, (list, tuple)) else arg

        return [
            base(*(pick(a, i) for a in args), **{k: pick(v, i) for k, v in {**extra, **kwargs}.items()})
            for i in range(length)
        ]

    return decomposed


def _foreach_decompositions() -> dict[OpOverload, Callable]:
    table: dict[OpOverload, Callable] = {}
    for name in _FOREACH_BASES:
        packet = getattr(aten, f"_foreach_{name}", None)
        base = getattr(aten, name, None)
        if packet is None or base is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            # Only the functional overloads: functionalization has already replaced the in-place
            # and out= variants by these.
            if op._schema.is_mutable or overload.endswith("out"):
                continue
            table[op] = _foreach_decomposition(base)
    return table


# ---- every decomposition returns what its op returns -------------------------------------------------
# A decomposed op whose outputs differ from the real op's in any slot is wrong wherever a later op reads
# that slot: a backward kernel that runs eagerly reads the forward's saved results, views after it
# depend on its strides (`transpose(1, 2).reshape(...)` after attention), `as_strided` reads the memory
# those strides describe. So each decomposition's results are checked, while a step is traced, against
# the op's own meta function on the same fake inputs: a result whose strides differ is copied into the
# op's layout, and a decomposition whose results differ in number, shape, dtype or device (torch's of
# `_scaled_dot_product_flash_attention_for_cpu` returns the attention probabilities where the kernel
# returns the logsumexp) is not used: the op stays whole (lowered, run by torch, or eager). The values
# of every decomposition are compared with the real kernels, over PyTorch's OpInfo samples, in
# tests/frontend/test_decompositions.py.

def conforming(op: OpOverload, decomposition: Callable) -> Callable:
    """`decomposition` of `op`, checked against `op`'s meta function when traced on fake tensors."""
    if op._schema.is_mutable:
        return decomposition    # in-place and out= forms: functionalization has replaced them

    @functools.wraps(decomposition)
    def conformed(*args, **kwargs):
        out = decomposition(*args, **kwargs)
        if out is NotImplemented:
            return out
        if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
            return out          # run on real tensors (a test, a replay): nothing to compare with cheaply
        flat, spec = tree_flatten(out)
        with disable_proxy_modes_tracing():     # the meta function and the comparisons are not traced
            expected = tree_flatten(op(*args, **kwargs))[0]
            why, layouts = _differences(flat, expected)
        if why is not None:
            return _kept_whole(op, why)
        for k, ref in layouts:
            flat[k] = _restrided(flat[k], ref)
        return tree_unflatten(flat, spec)
    return conformed


def _same(a, b) -> bool:
    if type(a) is int and type(b) is int:
        return a == b
    return statically_known_true(a == b)


def _differences(flat: list, expected: list) -> tuple[str | None, list]:
    """Why the results `flat` cannot stand for the op's `expected` ones (None if they can), and the
    (index, expected result) of those to copy into the op's layout."""
    if len(flat) != len(expected):
        return "%d results where the op has %d" % (len(flat), len(expected)), []
    layouts = []
    for k, (got, ref) in enumerate(zip(flat, expected)):
        if not isinstance(ref, torch.Tensor) or not isinstance(got, torch.Tensor):
            if isinstance(ref, torch.Tensor) or isinstance(got, torch.Tensor):
                return "result %d is %s where the op's is %s" % (k, type(got).__name__, type(ref).__name__), []
            continue
        if got.dtype != ref.dtype or got.device != ref.device or got.dim() != ref.dim() or \
                not all(_same(x, y) for x, y in zip(got.shape, ref.shape)):
            return "result %d is %s%s where the op's is %s%s" % (
                k, got.dtype, list(got.shape), ref.dtype, list(ref.shape)), []
        if not _same_strides(got.stride(), ref):
            if not _dense(ref):
                return "result %d has strides %s where the op's are %s" % (k, got.stride(), ref.stride()), []
            layouts.append((k, ref))
    return None, layouts


def _same_strides(stride, ref: torch.Tensor) -> bool:
    if _same(ref.numel(), 0) or _same(ref.numel(), 1):
        return True
    return all(_same(n, 1) or _same(x, y) for n, x, y in zip(ref.shape, stride, ref.stride()))


def _hint(x) -> int:
    return x if type(x) is int else x.node.hint


def _order(ref: torch.Tensor) -> list[int]:
    """`ref`'s dims from the outermost in memory to the innermost."""
    return sorted(range(ref.dim()), key=lambda d: (-_hint(ref.stride(d)), -_hint(ref.shape[d])))


def _dense(ref: torch.Tensor) -> bool:
    """Whether `ref`'s layout is a permutation of a contiguous one (the only kind a kernel allocates)."""
    expected = 1
    for d in reversed(_order(ref)):
        if not _same(ref.shape[d], 1) and not _same(ref.stride(d), expected):
            return False
        expected = expected * ref.shape[d]
    return True


def _restrided(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`got` copied into `ref`'s (dense) layout."""
    order = _order(ref)
    return got.permute(order).contiguous().permute([order.index(d) for d in range(ref.dim())])


_KEPT_WHOLE_LOGGED: set = set()


def _kept_whole(op: OpOverload, why: str):
    if op not in _KEPT_WHOLE_LOGGED:
        _KEPT_WHOLE_LOGGED.add(op)
        log("plans", "torch's decomposition of %s is not used (%s): the op stays whole", op, why)
    return NotImplemented


def _build() -> dict[OpOverload, Callable]:
    table: dict[OpOverload, Callable] = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    table.update(_foreach_decompositions())
    table.update(_gather_backwards())
    table.update(SDPA_DECOMPOSITIONS)
    table[aten.slice_scatter.default] = _slice_scatter
    bn_backward = aten.native_batch_norm_backward.default
    table[bn_backward] = _batch_norm_backward(table[bn_backward])
    return {op: conforming(op, fn) for op, fn in table.items()}


DECOMPOSITIONS: dict[OpOverload, Callable] = _build()

# Where the library ops run in torch (policy.library_ops_in_torch), the ops of policy.KEPT_WHOLE reach
# them whole.
_LIBRARY_TABLE: dict[OpOverload, Callable] = {
    op: fn for op, fn in DECOMPOSITIONS.items() if op._overloadpacket not in KEPT_WHOLE}


def decompositions_for(device: torch.device) -> dict[OpOverload, Callable]:
    """The decomposition table for a step on `device`."""
    return _LIBRARY_TABLE if library_ops_in_torch(device) else DECOMPOSITIONS
