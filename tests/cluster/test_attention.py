"""Written-out attention rewritten into fused attention kernels (cluster/attention.py).

The pass applies on CUDA; here it runs on the CPU, where the custom ops call torch's CPU flash
attention. Each rewritten graph must compute eager's values, keep no [t, t] matmul or softmax, and a
pattern that differs (probabilities read elsewhere, an additive bias, symbolic sizes) must be left
as it is."""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import pydisc
import pydisc.cluster
from pydisc.driver import step as pstep
from pydisc.cluster import attention as A
from pydisc.frontend import attention_ops
from pydisc.frontend.decompositions import _LIBRARY_TABLE

from test_eager_views import _library_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from workloads import Block  # noqa: E402  (the bench's transformer layer: attention written out)

aten = torch.ops.aten
CPU = torch.device("cpu")
_WRITTEN_OUT = {aten.bmm.default, aten._softmax.default, aten._softmax_backward_data.default}


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(A, "fuses_attention", lambda device: True)


def _attention(q, k, v, scale, mask, dtype, divide=False):
    """As models write it: scores scaled (a float or a 0-d tensor), masked, softmax in float32 as
    autocast runs it, probabilities back in the matmul dtype."""
    scores = q @ k.transpose(-2, -1)
    scores = scores / scale if divide else scores * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.float().softmax(-1).to(dtype) @ v


def _step(dtype, scale, masked, divide=False, heads=4):
    def step(x, w, grad, *scalar):
        x = x.detach().requires_grad_()
        b, t, c = x.shape
        q, k, v = ((x @ w).to(dtype).view(b, t, 3 * heads, c // heads).transpose(1, 2)
                   .split(heads, dim=1))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1) if masked else None
        out = _attention(q, k, v, scalar[0] if scalar else scale, mask, dtype, divide)
        return (out,) + torch.autograd.grad(out, (x,), grad)
    return step


def _inputs(dtype, b=2, t=16, c=32):
    torch.manual_seed(0)
    return torch.randn(b, t, c), torch.randn(c, 3 * c) / math.sqrt(c), torch.randn(b, 4, t, c // 4).to(dtype)


def _rewritten(fn, inputs, mode="fake"):
    gm = make_fx(fn, decomposition_table=_LIBRARY_TABLE, tracing_mode=mode)(*inputs)
    return gm, A.fuse_attention(gm, CPU)


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("scale", ["float", "lifted", "divide"])
def test_attention_and_its_gradient_become_one_kernel_each(on_cpu, dtype, masked, scale):
    x, w, grad = _inputs(dtype)
    extra = (torch.tensor(0.3),) if scale == "lifted" else ()
    fn = _step(dtype, 0.3 if scale != "divide" else 2.5, masked, divide=scale == "divide")
    gm, count = _rewritten(fn, (x, w, grad, *extra))
    assert count == 1, gm.code
    targets = _targets(gm)
    assert not targets & _WRITTEN_OUT, gm.code
    assert {A.ATTENTION, A.ATTENTION_BACKWARD} <= targets
    tolerance = {} if dtype is torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for got, want in zip(gm(x, w, grad, *extra), fn(x, w, grad, *extra)):
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


@pytest.mark.parametrize("masked", [True, False])
def test_attention_without_a_scale_is_rewritten(on_cpu, masked):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)

    def fn(q, k, v, mask):
        scores = q @ k.transpose(-2, -1)
        return (scores.masked_fill(mask, float("-inf")) if masked else scores).softmax(-1) @ v

    gm, count = _rewritten(fn, (q, k, v, mask))
    assert count == 1 and not _targets(gm) & _WRITTEN_OUT, gm.code
    torch.testing.assert_close(gm(q, k, v, mask), fn(q, k, v, mask))


def test_inference_attention_is_rewritten(on_cpu):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
    fn = lambda q, k, v, mask: _attention(q, k, v, 0.35, mask, torch.float32)  # noqa: E731
    gm, count = _rewritten(fn, (q, k, v, mask))
    assert count == 1 and not _targets(gm) & _WRITTEN_OUT, gm.code
    torch.testing.assert_close(gm(q, k, v, mask), fn(q, k, v, mask))


def test_other_patterns_are_left_alone(on_cpu):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    bias = torch.randn(16, 16)

    def probabilities_returned(q, k, v, bias):
        p = (q @ k.transpose(-2, -1) * 0.3).softmax(-1)
        return p @ v, p

    def additive_bias(q, k, v, bias):
        return (q @ k.transpose(-2, -1) * 0.3 + bias).softmax(-1) @ v

    def softmax_over_queries(q, k, v, bias):
        return (q @ k.transpose(-2, -1) * 0.3).softmax(-2) @ v

    for fn in (probabilities_returned, additive_bias, softmax_over_queries):
        gm, count = _rewritten(fn, (q, k, v, bias))
        assert count == 0 and aten._softmax.default in _targets(gm), fn.__name__
        torch.testing.assert_close(gm(q, k, v, bias), fn(q, k, v, bias))


def test_symbolic_sizes_are_left_alone(on_cpu):
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    fn = lambda q, k, v: _attention(q, k, v, 0.3, None, torch.float32)  # noqa: E731
    gm, count = _rewritten(fn, (q, k, v), mode="symbolic")
    assert count == 0


@pytest.mark.parametrize("dtype, masked, t, taken", [
    (torch.bfloat16, False, 12, True),     # flash attention: any length
    (torch.bfloat16, True, 16, True),      # memory-efficient attention: a bias with aligned rows
    (torch.bfloat16, True, 12, False),
    (torch.float32, False, 16, False),     # float32 on CUDA: not measured there, left as written
])
def test_which_attentions_cuda_takes(dtype, masked, t, taken):
    x, w, grad = _inputs(dtype, t=t)
    gm = make_fx(_step(dtype, 0.3, masked), decomposition_table=_LIBRARY_TABLE, tracing_mode="fake")(x, w, grad)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    softmax = next(n for n in gm.graph.nodes if n.target is aten._softmax.default)
    match = A._match(softmax, order)
    assert match is not None and match.do3 is not None
    assert A._supported(torch.device("cuda"), match) == taken
    assert A._supported(CPU, match)


def test_a_mask_before_a_lifted_scale_is_left_alone(on_cpu):
    """where(mask, -inf, S) * s: with s of unknown sign the masked scores need not be -inf."""
    x, w, grad = _inputs(torch.float32)

    def step(x, w, grad, s):
        x = x.detach().requires_grad_()
        q, k, v = (x @ w).view(2, 16, 12, 8).transpose(1, 2).split(4, dim=1)
        mask = torch.ones(16, 16, dtype=torch.bool).triu(1)
        out = ((q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf")) * s).softmax(-1) @ v
        return (out,) + torch.autograd.grad(out, (x,), grad)

    gm, count = _rewritten(step, (x, w, grad, torch.tensor(0.3)))
    assert count == 0


def test_policy(monkeypatch):
    from pydisc.config import CONFIG

    monkeypatch.setattr(CONFIG, "gpu_matmul", "torch")
    monkeypatch.setattr(CONFIG, "cpu_matmul", "iree")
    assert A.fuses_attention(torch.device("cuda")) and not A.fuses_attention(CPU)
    monkeypatch.setattr(CONFIG, "cpu_matmul", "torch")     # PYDISC_CPU_MATMUL=torch: the GPU's policy
    assert A.fuses_attention(CPU)
    monkeypatch.setattr(CONFIG, "fuse_attention", False)
    assert not A.fuses_attention(torch.device("cuda"))
    monkeypatch.setattr(CONFIG, "fuse_attention", True)
    monkeypatch.setattr(CONFIG, "gpu_matmul", "iree")
    assert not A.fuses_attention(torch.device("cuda"))


def test_kernel_reads_operands_whose_rows_are_not_dense():
    """IREE's results reach the op as dense tensors that torch then transposes: k arrives as the
    transpose of a dense [b, h, d, s] tensor. The CPU kernel read such a k wrong."""
    q, v, grad = (torch.randn(2, 4, 16, 8) for _ in range(3))
    kt = torch.randn(2, 4, 8, 16)
    k = kt.transpose(-2, -1)
    assert k.stride(-1) != 1
    got = attention_ops.attention(q, k, v, None, 0.3)
    want = attention_ops.attention(q, k.contiguous(), v, None, 0.3)
    torch.testing.assert_close(got[0], want[0])
    grads = attention_ops.attention_backward(grad, q, k, v, None, *got, 0.3)
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, scale=0.3).backward(grad)
    for g, r in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_training_with_fused_attention_matches_eager(monkeypatch, on_cpu, causal):
    """Three SGD steps of the bench's transformer layers through pydisc with the CUDA policy, attention
    fused, equal eager's; its scale (a lifted scalar) multiplies q inside a cluster."""
    counts: list[int] = []

    def counting(gm, device):
        counts.append(A.fuse_attention(gm, device))
        return counts[-1]

    monkeypatch.setattr(pydisc.cluster, "fuse_attention", counting)
    from pydisc.config import CONFIG
    monkeypatch.setattr(CONFIG, "compile_after", 1)
    _library_policy(monkeypatch)
    pstep.clear_plans()
    pydisc.reset_metrics()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Block(32, 4, causal), Block(32, 4, causal))
        twin = pydisc.lazy(copy.deepcopy(model))
        x = torch.randn(2, 16, 32)
        # SGD: AdamW would turn the key bias's gradient (zero up to rounding: a softmax ignores it) into
        # full steps whose sign is the rounding's
        opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
        losses, twin_losses = [], []
        for _ in range(3):
            for m, o, out in ((model, opt, losses), (twin, twin_opt, twin_losses)):
                loss = m(x).square().mean()
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss)
            pydisc.mark_step()
        torch.testing.assert_close(torch.stack([v.detach().cpu() for v in twin_losses]),
                                   torch.stack([v.detach() for v in losses]), rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)
        assert counts and max(counts) == 2, counts     # both blocks' attention, forward and backward
        m = pydisc.metrics()
        assert m["fallback_ops"] == {} and m["compile_failures"] == {}, (m["fallback_ops"], m["compile_failures"])
        assert m["library_ops"].get("pydisc.attention_backward.default", 0) > 0, m["library_ops"]
        assert "aten._softmax.default" not in m["library_ops"], m["library_ops"]
    finally:
        pstep.clear_plans()
