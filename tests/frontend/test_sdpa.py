"""F.scaled_dot_product_attention trained under pydisc against eager: every variant the CPU kernel
takes (causal, float and boolean masks, an explicit scale, GQA), dropout (torch's math path), and the
views after it (`transpose(1, 2).reshape(...)`, which need the kernel's output strides). Each compiles:
no matmul runs eagerly. And the numerics check sees a step made wrong by a decomposition or outside
every cluster."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions

import pydisc
from pydisc.config import CONFIG
from pydisc.driver import planning
from pydisc.frontend import decompositions

aten = torch.ops.aten
MATMULS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}
B, T, D, HEADS = 2, 8, 32, 4


class Attention(nn.Module):
    """Self-attention over fused q, k, v projections, as HF's and timm's models write it."""

    def __init__(self, kv_heads: int = HEADS, **sdpa):
        super().__init__()
        self.kv_heads, self.sdpa = kv_heads, sdpa
        self.head = D // HEADS
        self.qkv = nn.Linear(D, D + 2 * kv_heads * self.head)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([D, self.kv_heads * self.head, self.kv_heads * self.head], -1)
        q = q.view(b, t, HEADS, self.head).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.sdpa)
        return self.out(y.transpose(1, 2).reshape(b, t, D))


def _masks(kind: str) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(1)
    if kind == "bool":
        keep = torch.rand(T, T, generator=g) > 0.3
        keep[:, 0] = True
        return keep
    if kind == "float":
        return torch.randn(B, 1, T, T, generator=g)
    return None


CASES = {
    "plain": ({}, None, HEADS),
    "causal": ({"is_causal": True}, None, HEADS),
    "bool_mask": ({}, "bool", HEADS),
    "float_mask": ({}, "float", HEADS),
    "scale": ({"scale": 0.3, "is_causal": True}, None, HEADS),
    "gqa": ({"is_causal": True, "enable_gqa": True}, None, 2),
    "dropout": ({"dropout_p": 0.2}, None, HEADS),
}


def train(make, steps: int = 4, mask=None, opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
          dtype=torch.float32):
    """Train `make()` eagerly and under pydisc from the same weights and batches; returns both models,
    both loss lists and the metrics of the pydisc side."""
    torch.manual_seed(0)
    eager = make()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    opt_e, opt_l = opt(eager.parameters()), opt(lazy.parameters())
    pydisc.reset_metrics()
    g = torch.Generator().manual_seed(0)
    losses_e, losses_l = [], []
    for step in range(steps):
        x, target = torch.randn(B, T, D, generator=g, dtype=dtype), torch.randn(B, T, D, generator=g, dtype=dtype)
        for model, optimizer, losses in ((eager, opt_e, losses_e), (lazy, opt_l, losses_l)):
            torch.manual_seed(100 + step)       # the same dropout masks on both sides
            loss = (model(x, mask) - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if model is lazy:
                pydisc.mark_step()
            losses.append(float(loss.detach()))
    return eager, lazy, losses_e, losses_l, pydisc.metrics()


def adamw(params):
    """AdamW with eps 1e-6: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    shift shared by a row's scores), rounding noise in eager and compiled alike, and Adam with eps 1e-8
    turns noise of 1e-9 into updates of lr's size, different on each side; with 1e-6 the two sides
    stay within 1e-4 of each other."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def assert_same_training(eager, lazy, losses_e, losses_l, rtol=1e-4, atol=1e-5) -> None:
    torch.testing.assert_close(torch.tensor(losses_l), torch.tensor(losses_e), rtol=rtol, atol=atol)
    for (name, p), q in zip(eager.named_parameters(), lazy.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=rtol, atol=atol, msg=lambda m: name + ": " + m)


@pytest.mark.parametrize("case", CASES)
def test_sdpa_trains_like_eager_and_compiles(case: str) -> None:
    sdpa, mask_kind, kv_heads = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydisc.PydiscWarning)      # no step may give up planning
        eager, lazy, le, ll, m = train(lambda: Attention(kv_heads, **sdpa), mask=_masks(mask_kind))
    assert_same_training(eager, lazy, le, ll)
    assert m["clusters"] >= 1 and m["executions"] >= 1
    assert not MATMULS & set(m["fallback_ops"]), m["fallback_ops"]
    random_ops = {"aten.bernoulli.p"}      # dropout draws its mask from torch's generator, eagerly
    assert set(m["fallback_ops"]) <= (random_ops if case == "dropout" else set()), m["fallback_ops"]


@pytest.mark.parametrize("fast", ["all", "off"])
def test_float64_attention_trains_like_eager_and_plans_whole(fast: str, monkeypatch) -> None:
    """The kernel accumulates a float64 input in float64 and returns a float64 logsumexp. Written out in
    float32, the backward multiplied float64 by float32: the fast step failed to plan and fell back op
    by op (values right, nothing fused)."""
    monkeypatch.setattr(CONFIG, "fast_record", fast)
    mask = _masks("float").double()
    with warnings.catch_warnings():
        warnings.simplefilter("error", pydisc.PydiscWarning)
        eager, lazy, le, ll, m = train(lambda: Attention(2, is_causal=False, enable_gqa=True).double(),
                                       steps=3, mask=mask, dtype=torch.float64)
    assert lazy.qkv.weight.dtype == torch.float64
    assert_same_training(eager, lazy, le, ll, rtol=1e-9, atol=1e-10)
    assert not m["fast_demotions"], m["fast_demotions"]
    assert m["executions"] >= 1 and not MATMULS & set(m["fallback_ops"]), m["fallback_ops"]


def test_transformer_encoder_layer_trains_like_eager_with_adamw() -> None:
    """nn.TransformerEncoderLayer (its fused attention path on the CPU) trained 2-3% off eager when
    the backward kernel was fed the attention probabilities in place of the logsumexp."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=True)

        def forward(self, x, mask=None):
            return self.layer(x)

    eager, lazy, le, ll, m = train(Encoder, steps=5, opt=adamw)
    assert_same_training(eager, lazy, le, ll, atol=1e-4)
    assert not MATMULS & set(m["fallback_ops"]) and m["executions"] >= 1


class _Reduced(nn.Module):
    """Attention whose output is only transposed and its last two dims merged, a view under the
    kernel's layout and under that of torch's decomposition alike: a step that plans with either."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


@pytest.fixture
def torch_sdpa_decomposition(monkeypatch, fresh_plans):
    """torch's decomposition of the CPU kernel, unchecked: it returns the attention probabilities in
    the logsumexp's slot, which the (eager) backward kernel then reads."""
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    monkeypatch.setitem(decompositions.DECOMPOSITIONS, op, core_aten_decompositions()[op])
    monkeypatch.delitem(decompositions.DECOMPOSITIONS,
                        aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


def test_a_decomposition_that_returns_another_slot_is_not_used(monkeypatch, fresh_plans) -> None:
    """With torch's decomposition checked against the kernel's meta function, the forward stays whole
    (and runs as torch's kernel): training matches eager."""
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    monkeypatch.setitem(decompositions.DECOMPOSITIONS, op,
                        decompositions.conforming(op, core_aten_decompositions()[op]))
    eager, lazy, le, ll, m = train(_Reduced, steps=3)
    assert_same_training(eager, lazy, le, ll)
    assert str(op) in m["fallback_ops"]


def test_numerics_check_catches_a_decomposition_that_feeds_an_eager_backward_wrong(
        torch_sdpa_decomposition, monkeypatch) -> None:
    monkeypatch.setattr(CONFIG, "check_every", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, le, ll, m = train(_Reduced, steps=3)
    assert m["numerics_checks"] >= 2
    assert any("diverges from eager" in s and "step's" in s for s in m["numerics_mismatches"]), \
        m["numerics_mismatches"]


def test_numerics_check_catches_a_wrong_value_outside_every_cluster(monkeypatch, fresh_plans) -> None:
    """An eager op of the plan (not in any cluster) made to return a wrong value is seen by the check of
    the whole step, which the per-cluster check cannot see."""
    monkeypatch.setattr(CONFIG, "check_every", 1)
    original = planning.build_plan

    def build_plan(*args, **kwargs):
        plan = original(*args, **kwargs)
        for node in plan.runner.graph.nodes:     # the step's first eager op now doubles its result
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
                    node.target is aten.sin.default:
                node.target = lambda *a, **k: aten.sin.default(*a, **k) * 2
                plan.runner.recompile()
                return plan
        raise AssertionError("no eager sin in the plan")

    monkeypatch.setattr(planning, "build_plan", build_plan)
    monkeypatch.setattr(CONFIG, "cpu_matmul", "torch")    # the matmuls run in torch, between the clusters
    monkeypatch.setattr(CONFIG, "min_cluster_ops", 2)     # and the lone sin stays out of every cluster
    x = pydisc.to_lazy(torch.randn(8, 8))
    pydisc.reset_metrics()
    y = (x @ x).sin() @ x + 1
    pydisc.mark_step()
    m = pydisc.metrics()
    assert m["numerics_checks"] >= 1
    assert any("step's value made by" in s for s in m["numerics_mismatches"]), m["numerics_mismatches"]
    del y
