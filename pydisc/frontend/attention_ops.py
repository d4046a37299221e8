"""The attention kernels that cluster/attention.py puts in place of written-out attention: torch's flash
attention (bf16 or fp16 on CUDA, no mask), its memory-efficient attention (with a bias) and its
CPU flash attention, behind two custom ops that pick the kernel when they run."""
from __future__ import annotations

import torch

__all__ = ["attention", "attention_backward", "aligned_bias", "align_attention_biases"]

aten = torch.ops.aten


@torch.library.custom_op("pydisc::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(q @ k^T * scale + bias) @ v by torch's fused kernels: (output, and what the backward
    reads). A custom op rather than the kernels' own so that it can make the last dim of each operand
    dense: the layouts that reach it are those of IREE's results viewed by torch, known only when it
    runs (the CPU kernel reads a transposed operand wrong, the CUDA ones refuse it)."""
    q, k, v = (_dense_rows(x) for x in (q, k, v))
    kind = _kernel(q, bias)
    bias = aligned_bias(bias) if kind == "efficient" else bias
    if kind == "flash":
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
    elif kind == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False,
                                                                              scale=scale)
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                   scale=scale)
        seed, offset = lse.new_empty(0), lse.new_empty(0)
    return out, lse, seed, offset


@torch.library.custom_op("pydisc::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       bias: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, seed: torch.Tensor,
                       offset: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v of `attention`, from its results."""
    grad, q, k, v = (_dense_rows(x) for x in (grad, q, k, v))
    kind = _kernel(q, bias)
    bias = aligned_bias(bias) if kind == "efficient" else bias
    if kind == "flash":
        t, s = q.shape[-2], k.shape[-2]
        gq, gk, gv = aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, t, s, 0.0, False, seed, offset, scale=scale)
    elif kind == "efficient":
        gq, gk, gv, _ = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], False, scale=scale)
    else:
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale)
    return gq, gk, gv


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


_BIAS_ALIGN = 16    # elements, as F.scaled_dot_product_attention pads a mask for these kernels


def aligned_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """`bias` in a layout CUDA's memory-efficient attention accepts: rows dense and starting every 16
    elements. F.scaled_dot_product_attention pads the mask's rows (a `constant_pad_nd` and a slice, so
    that the kernel reads it in place); compiled, the pad and the slice fuse away and the bias reaches
    the kernel as IREE's dense result (T5's 6x6 position bias: rows 6 apart, which the kernel refuses:
    "attn_bias is not correctly aligned"). Broadcast dims (stride 0) pass the check; a bias that needs
    the copy is copied whole, as F.scaled_dot_product_attention's padding does."""
    if bias is None or bias.dim() < 2:
        return bias
    if bias.stride(-1) == 1 and (bias.size(-2) <= 1 or bias.stride(-2) % _BIAS_ALIGN == 0) and \
            all(st % _BIAS_ALIGN == 0 for st, n in zip(bias.stride()[:-2], bias.shape[:-2]) if n > 1 and st):
        return bias
    last = bias.size(-1)
    padded = bias.new_empty(*bias.shape[:-1], -(-last // _BIAS_ALIGN) * _BIAS_ALIGN)[..., :last]
    return padded.copy_(bias)


def _bias_argument(op) -> int | None:
    for k, a in enumerate(op._schema.arguments):
        if a.name in ("attn_bias", "bias"):
            return k
    return None


_EFFICIENT = [getattr(aten, name).default for name in (
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward") if hasattr(aten, name)]
_BIAS_AT = {op: _bias_argument(op) for op in _EFFICIENT}


def align_attention_biases(gm: torch.fx.GraphModule) -> int:
    """Before each memory-efficient attention kernel that torch runs between the clusters, make its bias
    `aligned_bias` (at run time: a bias already aligned passes as it is). Returns the kernels so fed."""
    count = 0
    for node in list(gm.graph.nodes):
        at = _BIAS_AT.get(node.target) if node.op == "call_function" else None
        if at is None or at >= len(node.args) or not isinstance(node.args[at], torch.fx.Node):
            continue
        bias = node.args[at]
        with gm.graph.inserting_before(node):
            aligned = gm.graph.call_function(aligned_bias, (bias,))
        aligned.meta = {**bias.meta, "pydisc_view": True}   # a layout for torch's kernel: not a fallback
        node.update_arg(at, aligned)
        count += 1
    if count:
        gm.recompile()
    return count


def _kernel(q: torch.Tensor, bias: torch.Tensor | None) -> str:
    if q.device.type != "cuda":
        return "cpu"
    return "flash" if bias is None and q.dtype in (torch.bfloat16, torch.float16) else "efficient"


# the fake (meta) versions: the same code, whose kernels run on FakeTensors
attention.register_fake(attention._init_fn)
attention_backward.register_fake(attention_backward._init_fn)
