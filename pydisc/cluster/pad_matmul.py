"""Zero-padding of matmuls whose sizes are not aligned for cuBLAS, as TorchInductor's pad_mm does.

On CUDA the matmuls run in cuBLAS through torch (`policy.LIBRARY_OPS`). A leading dimension that is
not a multiple of 16 bytes sends cuBLAS to its unvectorized kernels: the three GEMMs of GPT-2's
language-model head (vocabulary 50257, M=16384, bf16) ran as `..._align1` kernels at 8-13 ms each
(~120 TFLOP/s) on an H200, against ~2 ms aligned. `pad_unaligned_matmuls` rewrites the functional graph
before partitioning: each unaligned leading dimension (N always; K of a dense a or a transposed b; M
of a transposed a) is padded with zeros up to the alignment, the matmul runs on the padded operands,
and its result is sliced back. Zeros in K add nothing; padded rows and columns
of M and N are sliced away, so values never change.

An operand that is a transpose of X is padded through the transpose: X is padded and transposed again,
so cuBLAS still reads a transposed view of a dense aligned tensor (padding the view would write a
transposed copy). The pads then fuse into the clusters that produce X, which write the padded tensor
directly: the gradient of GPT-2's logits is padded once for both matmuls that read it.
"""
from __future__ import annotations

import math

import torch

from ..frontend.policy import library_ops_in_torch
from .fx_edit import new_node

__all__ = ["MIN_MULTIPLY_ADDS", "pad_unaligned_matmuls", "pads_matmuls"]

aten = torch.ops.aten

# Smaller matmuls are left alone: the copies that padding costs would outweigh what cuBLAS gains.
MIN_MULTIPLY_ADDS = 2 ** 30
# Elements per 16 bytes: the alignment cuBLAS's vectorized kernels need.
_ALIGNMENT = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}
# Matmuls whose operands are (bias, a, b) rather than (a, b).
_WITH_BIAS = {aten.addmm.default, aten.baddbmm.default}
_MATMULS = {aten.mm.default, aten.bmm.default} | _WITH_BIAS
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


def pads_matmuls(device: torch.device) -> bool:
    """Whether matmuls on `device` run in cuBLAS (and so are padded)."""
    return device.type == "cuda" and library_ops_in_torch(device)


def pad_unaligned_matmuls(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Pad the unaligned dims of large matmuls in `gm` (in place); returns how many matmuls were padded."""
    if not pads_matmuls(device):
        return 0
    graph = gm.graph
    padded: dict[tuple[torch.fx.Node, tuple[int, ...]], torch.fx.Node] = {}   # (node, pads) -> padded node
    count = 0
    for node in list(graph.nodes):
        plan = _padding(node) if node.op == "call_function" and node.target in _MATMULS else None
        if plan is None:
            continue
        a_pads, b_pads, out_pads = plan
        *bias, a, b = node.args
        with graph.inserting_before(node):
            operands = [_pad(graph, a, a_pads, padded, node), _pad(graph, b, b_pads, padded, node)]
            if bias:
                operands.insert(0, _pad(graph, bias[0], _bias_pads(bias[0], out_pads), padded, node))
            result = new_node(graph, node.target, tuple(operands), dict(node.kwargs), node)
            for dim, extra in enumerate(out_pads):
                if extra:
                    size = node.meta["val"].shape[dim]
                    result = new_node(graph, aten.slice.Tensor, (result, dim, 0, size), {}, node)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        for operand in (a, b, *bias):
            _erase_unused_transposes(graph, operand)
        count += 1
    if count:
        graph.lint()
        gm.recompile()
    return count


def _padding(node: torch.fx.Node) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The zeros to append per dim of a, b and the result, or None when the matmul is left alone
    (aligned, small, symbolic sizes or a dtype cuBLAS does not align)."""
    vals = [getattr(x, "meta", {}).get("val") for x in (node, *node.args)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    out, *_, a_val, b_val = vals
    if not all(isinstance(s, int) for v in vals for s in v.shape):   # a dynamic-shape plan
        return None
    alignment = _ALIGNMENT.get(out.dtype)
    m, k, n = a_val.shape[-2], a_val.shape[-1], b_val.shape[-1]
    if alignment is None or math.prod(out.shape) * k < MIN_MULTIPLY_ADDS:
        return None
    pm, pk, pn = (-size % alignment for size in (m, k, n))
    # Only leading dimensions need aligning: N (b's rows, the result's rows) always; M only where a is
    # a transposed view (a dense [K, M] underneath); K where a is dense [M, K] or b a transposed view.
    a_t, b_t = (_is_transpose(x) for x in node.args[-2:])
    pm = pm if a_t else 0
    pk = pk if (not a_t or b_t) else 0
    if not (pm or pk or pn):
        return None
    batch = (0,) * (out.dim() - 2)
    return batch + (pm, pk), batch + (pk, pn), batch + (pm, pn)


def _is_transpose(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES


def _bias_pads(bias: torch.fx.Node, out_pads: tuple[int, ...]) -> tuple[int, ...]:
    """The result's pads for the bias of addmm/baddbmm, which broadcasts: none along its size-1 dims."""
    shape = bias.meta["val"].shape
    return tuple(0 if size == 1 else pad for size, pad in zip(shape, out_pads[len(out_pads) - len(shape):]))


def _pad(graph: torch.fx.Graph, node: torch.fx.Node, pads: tuple[int, ...], padded: dict,
         matmul: torch.fx.Node) -> torch.fx.Node:
    """`node` with `pads[d]` zeros appended along each dim d, made once per (node, pads); through a
    transpose, its input is padded and transposed again."""
    if not any(pads):
        return node
    key = (node, pads)
    if key not in padded:
        if node.op == "call_function" and node.target in _TRANSPOSES:
            source = _source_dims(node)
            inner = [0] * len(pads)
            for dim, pad in enumerate(pads):
                inner[source[dim]] = pad
            x = _pad(graph, node.args[0], tuple(inner), padded, matmul)
            padded[key] = new_node(graph, node.target, (x, *node.args[1:]), dict(node.kwargs), matmul)
        else:
            # constant_pad_nd takes (low, high) pairs from the last dim backwards
            amounts = [amount for pad in reversed(pads) for amount in (0, pad)]
            while amounts and amounts[-1] == 0:
                amounts.pop()
            padded[key] = new_node(graph, aten.constant_pad_nd.default, (node, amounts), {}, matmul)
    return padded[key]


def _source_dims(transpose: torch.fx.Node) -> list[int]:
    """For each dim of the transpose's result, the dim of its input it shows."""
    rank = transpose.meta["val"].dim()
    dims = list(range(rank))
    if transpose.target is aten.permute.default:
        return [d % rank for d in transpose.args[1]]
    if transpose.target is aten.transpose.int:
        d0, d1 = (d % rank for d in transpose.args[1:3])
    else:   # aten.t: swaps the two dims of a matrix, nothing for a vector
        d0, d1 = (0, 1) if rank == 2 else (0, 0)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return dims


def _erase_unused_transposes(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Drop the transposes that only the replaced matmul read (not views for torch to keep around)."""
    while node.op == "call_function" and node.target in _TRANSPOSES and not node.users:
        source = node.args[0]
        graph.erase_node(node)
        node = source
