"""The attention kernels that cluster/attention.py puts in place of written-out attention: torch's flash
attention (bf16 or fp16 on CUDA, no mask), its memory-efficient attention (with a bias) and its
CPU flash attention, behind two custom ops that pick the kernel when they run."""
from __future__ import annotations

import torch

__all__ = ["attention", "attention_backward"]

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


def _kernel(q: torch.Tensor, bias: torch.Tensor | None) -> str:
    if q.device.type != "cuda":
        return "cpu"
    return "flash" if bias is None and q.dtype in (torch.bfloat16, torch.float16) else "efficient"


# the fake (meta) versions: the same code, whose kernels run on FakeTensors
attention.register_fake(attention._init_fn)
attention_backward.register_fake(attention_backward._init_fn)
