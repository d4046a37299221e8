"""Written-out attention replaced by torch's fused attention kernels, as TorchInductor's fuse_attention does.

A model that writes attention out (`softmax(q @ k^T * scale, masked) @ v`) makes every step materialise
the [batch, heads, t, t] scores, their softmax and both their gradients. In GPT-2 small at batch 16 and
seq 1024, each of these is 201M elements, written and read several times per layer: most of the GPU
time that separates eager PyTorch from torch.compile, which rewrites the pattern into flash attention
(bench/README.md). On CUDA, `fuse_attention` rewrites the functional graph
before partitioning: each such attention in bf16 or fp16, and its gradient where the step has one,
becomes one call of torch's flash attention (memory-efficient attention where there is a mask) and one
of its backward, run by torch like the matmuls (policy.LIBRARY_OPS). Nothing of size t x t is left.

What is matched, in the ops autograd records for `q @ k.transpose(-2, -1)` and its gradient:

    forward   S = view(bmm(Q3, KT3)) -> casts, * scale, where(mask, -inf, .) -> _softmax(., -1)
              -> casts -> P3 = view(.) -> O3 = bmm(P3, V3)
    backward  dP = view(bmm(dO3, V3^T)) -> casts -> _softmax_backward_data(dP, P)
              -> casts, where(mask, 0, .), * scale -> dS3;
              dQ3 = bmm(dS3, KT3^T), dKT3 = bmm(Q3^T, dS3), dV3 = bmm(P3^T, dO3)

Anything else is left as it is: probabilities or scores read elsewhere (returned attention weights,
dropout on them), an additive bias, a gradient for only some of q, k and v, symbolic sizes, a mask
applied before a scale of unknown sign, float32 on CUDA (not measured there).

The scale is one of the step's lifted scalars (a graph input that could change between steps), so q is
multiplied by it before the kernel (which then scales by 1) and q's gradient after it: in bf16 that
rounds q * scale where eager rounds the scores * scale, exact when the scale is a power of two
(1/sqrt(64)). A boolean mask becomes an additive bias: -inf where masked, 0 elsewhere. The kernels keep
the scores and their softmax in float32 where autocast rounds them to bf16 between ops, so values are
close to eager's, not equal to them.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch

from ..config import CONFIG
from ..frontend import attention_ops
from ..frontend.policy import library_ops_in_torch
from .fx_edit import new_node, refresh_val

__all__ = ["fuse_attention", "fuses_attention"]

aten = torch.ops.aten
prims = torch.ops.prims


_VIEWS = {aten.view.default, aten._unsafe_view.default}
_CASTS = {aten._to_copy.default, prims.convert_element_type.default}
_ALIASES = {aten.alias.default, aten.detach.default}
_SCALES = {aten.mul.Tensor, aten.div.Tensor}
_COPIES = {aten.clone.default}
_FREE = {prims.broadcast_in_dim.default, aten.expand.default, aten.permute.default, aten.transpose.int,
         aten.scalar_tensor.default}


# the kernels this pass calls: run by torch between the clusters (policy.ATTENTION_OPS)
ATTENTION = attention_ops.attention._opoverload
ATTENTION_BACKWARD = attention_ops.attention_backward._opoverload


def fuses_attention(device: torch.device) -> bool:
    """Whether written-out attention on `device` is rewritten (where matmuls and softmax run in torch)."""
    return CONFIG.fuse_attention and library_ops_in_torch(device)


@dataclass
class _Attention:
    """One matched attention: the nodes read, replaced and made dead."""
    b: int
    h: int
    t: int
    s: int
    d: int
    q3: torch.fx.Node
    kt3: torch.fx.Node
    v3: torch.fx.Node
    pv: torch.fx.Node                           # O3 = bmm(P3, V3)
    out_views: list
    scale: tuple | None = None                  # (mul or div, a float or a 0-d tensor node)
    mask: torch.fx.Node | None = None
    # the backward, where there is one
    do3: torch.fx.Node | None = None
    dq: tuple | None = None                     # (bmm, its 4-D views), for q, k^T and v
    dkt: tuple | None = None
    dv: tuple | None = None
    grad_scale: tuple | None = None
    first_backward: torch.fx.Node | None = None
    dead: list = field(default_factory=list)    # nodes left without users once replaced


def fuse_attention(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Replace the written-out attentions of `gm` (in place); returns how many were replaced."""
    if not fuses_attention(device):
        return 0
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    count = 0
    for node in list(graph.nodes):
        if not _call(node, {aten._softmax.default}):
            continue
        match = _match(node, order)
        if match and _supported(device, match):
            _rewrite(graph, match)
            count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


# ---- matching ---------------------------------------------------------------------------------------

def _call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or not all(isinstance(n, int) for n in val.shape):
        return None
    return tuple(val.shape)


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_cast(node) -> bool:
    """A change of dtype only (autocast's casts around the float32 softmax)."""
    if not _call(node, _CASTS):
        return False
    if node.target is prims.convert_element_type.default:
        return True
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    same_device = node.kwargs.get("device") in (None, node.args[0].meta["val"].device)
    return not extra and len(node.args) == 1 and same_device and node.kwargs.get("layout") in (None, torch.strided)


def _fill(node) -> float | None:
    """The value of a constant fill: a number or `scalar_tensor(number)`."""
    if isinstance(node, (int, float)):
        return float(node)
    if _call(node, {aten.scalar_tensor.default}):
        return float(node.args[0])
    return None


def _scale_of(node: torch.fx.Node) -> tuple | None:
    """(op, factor) of `x * factor` or `x / factor`, the factor a number or a 0-d tensor node."""
    factor = node.args[1]
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor != 0:
        return node.target, float(factor)
    val = factor.meta.get("val") if isinstance(factor, torch.fx.Node) else None
    if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype.is_floating_point:
        return node.target, factor
    return None


def _same_scale(a: tuple, b: tuple) -> bool:
    """Whether two scales are the same: equal numbers, or lifted scalars of the same op and vector.

    The gradient's scale is a lifted scalar of its own, recorded from the very float autograd saved for
    the forward's (`MulBackward0`), so it is equal at every step; only a custom autograd function could
    record these ops with another."""
    (op_a, fa), (op_b, fb) = a, b
    if op_a is not op_b:
        return False
    if isinstance(fa, float) or isinstance(fb, float):
        return fa == fb
    if fa is fb:
        return True
    lifted = {aten.select.int}
    return _call(fa, lifted) and _call(fb, lifted) and fa.args[0] is fb.args[0]


def _heads(node3: torch.fx.Node, b: int, h: int) -> torch.fx.Node | None:
    """The [b, h, x, y] tensor that `node3` ([b*h, x, y]) is a view of, past copies and identity
    broadcasts; None when there is none (the caller views `node3`)."""
    if not _call(node3, _VIEWS):
        return None
    x = node3.args[0]
    shape3 = _shape(node3)
    if _shape(x) != (b, h, *shape3[1:]):
        return None
    while True:
        if _call(x, _COPIES) or (_call(x, {prims.broadcast_in_dim.default, aten.expand.default})
                                 and _shape(x.args[0]) == _shape(x)):
            x = x.args[0]
        else:
            return x


def _transposed(node, of: torch.fx.Node) -> bool:
    """Whether `node` swaps the last two dims of the 3-D `of`."""
    if _call(node, {aten.permute.default}):
        return node.args[0] is of and list(node.args[1]) == [0, 2, 1]
    if _call(node, {aten.transpose.int}):
        return node.args[0] is of and sorted(d % 3 for d in node.args[1:3]) == [1, 2]
    return False


def _views_of(bmm: torch.fx.Node, shape: tuple) -> list | None:
    """The users of `bmm`, when all of them are views to `shape`."""
    views = list(bmm.users)
    return views if views and all(_call(v, _VIEWS) and _shape(v) == shape for v in views) else None


def _forward_scores(softmax: torch.fx.Node, m: dict) -> torch.fx.Node | None:
    """Walk from the softmax's input back to the [b, h, t, s] view of the scores' bmm, noting the scale
    and mask in `m`; None where another op is on the way or a value there is read elsewhere."""
    node = softmax.args[0]
    while not _call(node, _VIEWS):
        if _only_user(node) is None:
            return None
        m["dead"].append(node)
        if _is_cast(node):
            node = node.args[0]
        elif _call(node, _SCALES) and "scale" not in m and _scale_of(node):
            m["scale"] = _scale_of(node)
            m["scale_after_mask"] = "mask" not in m   # walking backwards: met before any mask
            node = node.args[0]
        elif (_call(node, {aten.where.self}) and "mask" not in m and _fill(node.args[1]) == -math.inf
              and _shape(node.args[2]) == _shape(node)):
            m["mask"] = node.args[0]
            node = node.args[2]
        else:
            return None
    return node


def _match(softmax: torch.fx.Node, order: dict) -> _Attention | None:
    shape = _shape(softmax)
    if shape is None or len(shape) != 4 or softmax.args[1] not in (-1, 3) or softmax.args[2]:
        return None
    b, h, t, s = shape
    m: dict = {"dead": [softmax]}
    view = _forward_scores(softmax, m)
    if view is None or _shape(view) != shape or _only_user(view) is None:
        return None
    scores = view.args[0]
    if not _call(scores, {aten.bmm.default}) or _only_user(scores) is None or _shape(scores) != (b * h, t, s):
        return None
    q3, kt3 = scores.args
    mask = m.get("mask")
    if mask is not None:
        mshape = _shape(mask)
        if (mshape is None or mask.meta["val"].dtype is not torch.bool or mshape[-2:] != (t, s)
                or torch.broadcast_shapes(mshape, shape) != shape):
            return None
    scale = m.get("scale")
    if mask is not None and m.get("scale_after_mask") and not (isinstance(scale[1], float) and scale[1] > 0):
        return None   # -inf times a factor of unknown sign: the bias would not be the same
    m["dead"] += [view, scores]

    # the softmax's readers: the forward's P @ V and, through aliases, the backward's softmax gradient
    readers, stack = [], [softmax]
    while stack:
        for user in stack.pop().users:
            if _call(user, _ALIASES):
                m["dead"].append(user)
                stack.append(user)
            else:
                readers.append(user)
    grads = [r for r in readers if _call(r, {aten._softmax_backward_data.default})]
    forward = [r for r in readers if r not in grads]
    if len(forward) != 1 or len(grads) > 1:
        return None
    node = forward[0]
    while not _call(node, _VIEWS):
        if not ((_is_cast(node) or _call(node, {prims.broadcast_in_dim.default, aten.expand.default}))
                and _shape(node) == shape and _only_user(node) is not None):
            return None
        m["dead"].append(node)
        node = _only_user(node)
    p3 = node
    pv = [u for u in p3.users if _call(u, {aten.bmm.default}) and u.args[0] is p3]
    if _shape(p3) != (b * h, t, s) or len(pv) != 1:
        return None
    pv = pv[0]
    v3 = pv.args[1]
    if _shape(v3) != (b * h, s, _shape(q3)[2]) or _shape(kt3) != (b * h, _shape(q3)[2], s):
        return None
    d = _shape(q3)[2]
    out_views = _views_of(pv, (b, h, t, d))
    if out_views is None:
        return None
    match = _Attention(b, h, t, s, d, q3, kt3, v3, pv, out_views, scale, mask)
    match.dead = m["dead"] + [p3, pv, *out_views]
    if not grads:
        return match if len(p3.users) == 1 else None
    return match if _match_backward(match, grads[0], p3, order) else None


def _match_backward(m: _Attention, grad: torch.fx.Node, p3: torch.fx.Node, order: dict) -> bool:
    """Fill in the backward of `m` from its softmax gradient `grad`; False where it is not the pattern."""
    b, h, t, s, d = m.b, m.h, m.t, m.s, m.d
    if grad.args[2] not in (-1, 3):
        return False
    node = grad.args[0]                      # dP, from bmm(dO3, V3^T)
    dead = [grad]
    while _is_cast(node) and _only_user(node) is not None:
        dead.append(node)
        node = node.args[0]
    if not (_call(node, _VIEWS) and _shape(node) == (b, h, t, s) and _only_user(node) is not None):
        return False
    dp = node.args[0]
    if not (_call(dp, {aten.bmm.default}) and _only_user(dp) is not None and _transposed(dp.args[1], m.v3)
            and len(dp.args[1].users) == 1):
        return False
    do3 = dp.args[0]
    dead += [node, dp, dp.args[1]]
    # dV3 = bmm(P3^T, dO3): P3's other reader
    others = [u for u in p3.users if u is not m.pv]
    if len(others) != 1 or not _transposed(others[0], p3) or _only_user(others[0]) is None:
        return False
    dv = _only_user(others[0])
    if not (_call(dv, {aten.bmm.default}) and dv.args[0] is others[0] and dv.args[1] is do3):
        return False
    dead.append(others[0])
    # dS, from the softmax gradient on to the view read by dQ3's and dKT3's bmms
    node, mask, scale = _only_user(grad), None, None
    while node is not None and not _call(node, _VIEWS):
        if _is_cast(node):
            pass
        elif _call(node, {aten.where.self}) and mask is None and _fill(node.args[1]) == 0.0:
            mask = node.args[0]
        elif _call(node, _SCALES) and scale is None and _scale_of(node):
            scale = _scale_of(node)
        else:
            return False
        dead.append(node)
        node = _only_user(node)
    if node is None or _shape(node) != (b * h, t, s) or mask is not m.mask:
        return False
    if (scale is None) != (m.scale is None) or (scale and not _same_scale(scale, m.scale)):
        return False
    ds3 = node
    users = list(ds3.users)
    dq = [u for u in users if _call(u, {aten.bmm.default}) and u.args[0] is ds3 and _transposed(u.args[1], m.kt3)]
    dkt = [u for u in users if _call(u, {aten.bmm.default}) and u.args[1] is ds3 and _transposed(u.args[0], m.q3)]
    if len(users) != 2 or len(dq) != 1 or len(dkt) != 1:
        return False
    dq, dkt = dq[0], dkt[0]
    views = (_views_of(dq, (b, h, t, d)), _views_of(dkt, (b, h, d, s)), _views_of(dv, (b, h, s, d)))
    if None in views or any(len(x.users) != 1 for x in (dq.args[1], dkt.args[0])):
        return False
    first = min((dp, dv), key=order.__getitem__)
    if order[m.pv] > order[first]:
        return False
    m.do3, m.grad_scale, m.first_backward = do3, scale, first
    m.dq, m.dkt, m.dv = (dq, views[0]), (dkt, views[1]), (dv, views[2])
    m.dead += dead + [ds3, dq, dkt, dv, dq.args[1], dkt.args[0], *views[0], *views[1], *views[2]]
    return True


# ---- rewriting --------------------------------------------------------------------------------------

def _supported(device: torch.device, m: _Attention) -> bool:
    """Whether torch's kernels (`_kernel`) take `m` on `device`."""
    dtype = m.q3.meta["val"].dtype
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16)
    # on CUDA: half precision (what the H200 runs measured: flash attention, and memory-efficient
    # attention for a mask, whose bias rows must be 16-element aligned)
    if device.type != "cuda" or m.d > 128 or m.d % 8 or dtype not in (torch.bfloat16, torch.float16):
        return False
    return m.mask is None or m.s % 16 == 0


def _untransposed(kt3: torch.fx.Node, b: int, h: int) -> torch.fx.Node | None:
    """k where `kt3` is a view of its transpose (the [b, h, s, d] tensor underneath, rows dense)."""
    kt = _heads(kt3, b, h)
    if _call(kt, {aten.permute.default}) and list(kt.args[1]) == [0, 1, 3, 2]:
        return kt.args[0]
    if _call(kt, {aten.transpose.int}) and sorted(d % 4 for d in kt.args[1:3]) == [2, 3]:
        return kt.args[0]
    return None


def _rewrite(graph: torch.fx.Graph, m: _Attention) -> None:
    like = m.pv
    dtype = m.q3.meta["val"].dtype

    def call(target, *args, **kwargs) -> torch.fx.Node:
        return new_node(graph, target, args, kwargs, like)

    def heads(node3: torch.fx.Node, transpose: bool = False) -> torch.fx.Node:
        x = _heads(node3, m.b, m.h) or call(aten.view.default, node3, [m.b, m.h, *_shape(node3)[1:]])
        return call(aten.transpose.int, x, -2, -1) if transpose else x

    with graph.inserting_before(m.pv):
        q, k, v = heads(m.q3), _untransposed(m.kt3, m.b, m.h) or heads(m.kt3, transpose=True), heads(m.v3)
        scale = 1.0
        if m.scale is not None:
            op, factor = m.scale
            if isinstance(factor, float):
                scale = factor if op is aten.mul.Tensor else 1.0 / factor
            else:
                q = call(op, q, factor)
        bias = None
        if m.mask is not None:
            device = m.mask.meta["val"].device
            fills = [call(aten.scalar_tensor.default, x, dtype=dtype, device=device) for x in (-math.inf, 0.0)]
            bias = call(aten.expand.default, call(aten.where.self, m.mask, *fills), [m.b, m.h, m.t, m.s])
        f = call(ATTENTION, q, k, v, bias, scale)
        out, *saved = (call(operator.getitem, f, i) for i in range(4))
    _replace(graph, m.out_views, out)
    if m.do3 is not None:
        with graph.inserting_before(m.first_backward):
            g = call(ATTENTION_BACKWARD, heads(m.do3), q, k, v, bias, out, *saved, scale)
            gq, gk, gv = (call(operator.getitem, g, i) for i in range(3))
        if m.scale is not None and not isinstance(m.scale[1], float):    # q was scaled: its gradient too
            with graph.inserting_before(m.dq[0]):
                gq = call(m.grad_scale[0], gq, m.grad_scale[1])
        with graph.inserting_before(m.dkt[0]):
            gkt = call(aten.transpose.int, gk, -2, -1)
        for (_, views), grad in ((m.dq, gq), (m.dkt, gkt), (m.dv, gv)):
            _replace(graph, views, grad)
    # erase what was replaced, and the views, copies and constants only it read
    dead = set(m.dead) | {m.q3, m.kt3, m.v3, m.do3} - {None}
    for node in reversed(list(graph.nodes)):
        if node in dead and not node.users:
            dead.update(a for a in node.all_input_nodes if _call(a, _VIEWS | _COPIES | _ALIASES | _FREE))
            graph.erase_node(node)


def _replace(graph: torch.fx.Graph, views: list, value: torch.fx.Node) -> None:
    """Make the readers of `views` (contiguous 4-D views of a bmm's result) read `value`, copied into
    the same layout where the kernel's differs, so every later view and stride stays as it was."""
    for view in views:
        new = value
        if tuple(value.meta["val"].stride()) != tuple(view.meta["val"].stride()):
            if _copied_after_transposes(view):
                # the model copies it anyway (`.transpose(1, 2).reshape(b, t, c)`): no copy of ours
                for user in view.users:
                    refresh_val(user, {view: value})
            else:
                with graph.inserting_before(view):
                    new = new_node(graph, aten.clone.default, (value,),
                                   {"memory_format": torch.contiguous_format}, view)
        view.replace_all_uses_with(new)


def _copied_after_transposes(view: torch.fx.Node) -> bool:
    """Whether every reader of `view` is a transpose that only contiguous copies read."""
    return all(_call(u, {aten.permute.default, aten.transpose.int}) and u.users
               and all(_call(c, _COPIES) and c.kwargs.get("memory_format") == torch.contiguous_format
                       for c in u.users) for u in view.users)
