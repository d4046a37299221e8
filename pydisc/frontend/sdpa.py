"""Decompositions of PyTorch's CPU flash attention, forward and backward, that return what the kernels
return in every output slot.

`F.scaled_dot_product_attention` on the CPU dispatches `_scaled_dot_product_flash_attention_for_cpu`,
which returns the output and the logsumexp of each row's scores, and autograd hands both to
`_scaled_dot_product_flash_attention_for_cpu_backward`. torch's own decomposition of the forward (kept
for export) returns the attention probabilities where the kernel returns the logsumexp, so a backward
fed from it computes garbage. Here both are written out in the kernel's accumulation type (float32, or
float64 for float64 inputs; the logsumexp has that type too):

    forward   s = q @ k^T * scale + bias;  lse = logsumexp(s);  out = exp(s - lse) @ v
    backward  p = exp(s - lse);  dv = p^T @ g;  ds = p * (g @ v^T - rowsum(g * out))
              dq = ds @ k * scale;  dk = ds^T @ q * scale

with the kernel's conventions: `is_causal` keeps the lower triangle aligned top-left, a float mask is
added to the scores (F.scaled_dot_product_attention turns a boolean one into -inf/0 before the kernel),
fewer key/value heads than query heads are shared by groups of query heads (GQA), and a row whose
every score is masked gives output 0 and logsumexp 0. Output layouts follow the kernel's meta function
through `decompositions.conforming`.
"""
from __future__ import annotations

import math

import torch

__all__ = ["SDPA_DECOMPOSITIONS"]

aten = torch.ops.aten


def _scale(q: torch.Tensor, scale: float | None):
    if scale is not None:
        return scale
    e = q.size(-1)
    return 1.0 / math.sqrt(e) if isinstance(e, int) else torch.sym_float(e) ** -0.5


def _shared(t: torch.Tensor, heads) -> torch.Tensor:
    """Key or value heads repeated for each query head that shares them."""
    groups = heads // t.size(1)
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _accumulation(t: torch.Tensor) -> torch.dtype:
    """The kernel's accumulation type (`at::opmath_type`): float32 for float32 and narrower floats, else the dtype."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool, attn_mask: torch.Tensor | None,
            scale) -> torch.Tensor:
    acc = _accumulation(q)
    s = torch.matmul(q.to(acc), _shared(k, q.size(1)).to(acc).transpose(-2, -1)) * scale
    if is_causal:
        rows, cols = q.size(-2), k.size(-2)
        keep = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s + attn_mask.to(acc)
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.exp(s - lse.to(s.dtype).unsqueeze(-1))


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
             is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if dropout_p != 0.0:
        return NotImplemented       # (the kernel refuses dropout; torch picks the math path for it)
    s = _scores(query, key, is_causal, attn_mask, _scale(query, scale))
    lse = torch.logsumexp(s, -1)
    lse = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)   # a fully masked row
    out = torch.matmul(_probabilities(s, lse), _shared(value, query.size(1)).to(s.dtype))
    return out.to(query.dtype), lse


def _backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool, *,
              attn_mask: torch.Tensor | None = None,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dropout_p != 0.0:
        return NotImplemented
    heads = query.size(1)
    factor = _scale(query, scale)
    p = _probabilities(_scores(query, key, is_causal, attn_mask, factor), logsumexp)
    acc = p.dtype
    g = grad_out.to(acc)
    grad_value = torch.matmul(p.transpose(-2, -1), g)
    dp = torch.matmul(g, _shared(value, heads).to(acc).transpose(-2, -1))
    ds = p * (dp - (g * out.to(acc)).sum(-1, keepdim=True))
    grad_query = torch.matmul(ds, _shared(key, heads).to(acc)) * factor
    grad_key = torch.matmul(ds.transpose(-2, -1), query.to(acc)) * factor
    kv_heads = key.size(1)
    if kv_heads != heads:       # each shared head gets the gradients of the query heads that read it
        b, _, s, e = grad_key.shape
        grad_key = grad_key.reshape(b, kv_heads, heads // kv_heads, s, e).sum(2)
        grad_value = grad_value.reshape(b, kv_heads, heads // kv_heads, s, grad_value.size(-1)).sum(2)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


SDPA_DECOMPOSITIONS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _backward,
}
