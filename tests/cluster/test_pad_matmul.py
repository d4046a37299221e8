"""Padding of unaligned matmuls (cluster/pad_matmul.py): the rewritten graph computes eager's values,
its matmuls see aligned sizes, transposed operands are padded through the transpose, and an operand read
by two matmuls is padded once. The pass applies on CUDA; these tests apply it on the CPU."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import pydisc
import pydisc.cluster
from pydisc.driver import step as pstep
from pydisc.cluster import pad_matmul as PM
from pydisc.cluster import pad_unaligned_matmuls

from test_eager_views import _library_policy

aten = torch.ops.aten
CPU = torch.device("cpu")
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_TOLERANCE = {torch.float32: {}, torch.bfloat16: {"rtol": 2e-2, "atol": 5e-2}}


@pytest.fixture
def on_cpu(monkeypatch):
    """The pass as on CUDA, for matmuls of any size."""
    monkeypatch.setattr(PM, "pads_matmuls", lambda device: True)
    monkeypatch.setattr(PM, "MIN_MULTIPLY_ADDS", 1)


def _rewritten(fn, *inputs) -> tuple[torch.fx.GraphModule, int]:
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return gm, pad_unaligned_matmuls(gm, CPU)


def _nodes(gm: torch.fx.GraphModule, targets) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _assert_padded(gm: torch.fx.GraphModule, fn, inputs, dtype: torch.dtype) -> None:
    """Values equal eager's; every matmul reads aligned sizes; no transposed view is padded (its input is)."""
    torch.testing.assert_close(gm(*inputs), fn(*inputs), **_TOLERANCE[dtype])
    alignment = 4 if dtype is torch.float32 else 8
    for mm in _nodes(gm, _MATMULS):
        a, b = (x.meta["val"] for x in mm.args[-2:])
        a_t, b_t = (x.target in PM._TRANSPOSES for x in mm.args[-2:])
        # the leading dims: N always, M where a is a transposed view, K where a is not or b is
        leading = [b.shape[-1]] + [a.shape[-2]] * a_t + [a.shape[-1]] * (not a_t or b_t)
        assert all(size % alignment == 0 for size in leading), (a.shape, b.shape)
    for pad in _nodes(gm, {aten.constant_pad_nd.default}):
        assert pad.args[0].target not in PM._TRANSPOSES, gm.code
        assert all(x == 0 for x in pad.args[1][::2]), pad.args   # zeros appended, never prepended
    for node in gm.graph.nodes:
        if node.op == "call_function":
            assert isinstance(node.meta["val"], torch._subclasses.FakeTensor), node


def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# (name, function, input shapes): M, K or N odd, with plain and transposed operands and biases
_CASES = [
    ("mm odd N", torch.mm, [(16, 12), (12, 37)]),
    ("mm odd K", torch.mm, [(16, 37), (37, 12)]),
    ("mm odd M, a transposed", lambda a, b: a.t() @ b, [(12, 37), (12, 16)]),
    ("mm all odd", torch.mm, [(13, 9), (9, 11)]),
    ("mm t operands", lambda a, b: a.t() @ b.t(), [(9, 13), (11, 9)]),
    ("mm transpose operand", lambda a, b: a @ b.transpose(0, 1), [(13, 9), (11, 9)]),
    ("mm permute operand", lambda a, b: a.permute(1, 0) @ b, [(9, 13), (9, 11)]),
    ("addmm [N] bias", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(11,), (13, 9), (9, 11)]),
    ("addmm [1,N] bias", lambda c, a, b: torch.addmm(c, a, b), [(1, 11), (13, 9), (9, 11)]),
    ("addmm [M,1] bias", lambda c, a, b: torch.addmm(c, a, b), [(13, 1), (13, 9), (9, 11)]),
    ("addmm [M,N] bias", lambda c, a, b: torch.addmm(c, a, b, beta=2.0), [(13, 11), (13, 9), (9, 11)]),
    ("addmm transposed bias", lambda c, a, b: torch.addmm(c.t(), a, b), [(11, 13), (13, 9), (9, 11)]),
    ("linear", lambda x, w, c: F.linear(x, w, c), [(13, 9), (11, 9), (11,)]),
    ("bmm", torch.bmm, [(3, 13, 9), (3, 9, 11)]),
    ("bmm transposed operands", lambda a, b: torch.bmm(a.transpose(1, 2), b.permute(1, 2, 0)),
     [(3, 9, 13), (11, 3, 9)]),
    ("baddbmm [B,M,N] bias", lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=1.5),
     [(3, 13, 11), (3, 13, 9), (3, 9, 11)]),
    ("baddbmm [N] bias", lambda c, a, b: torch.baddbmm(c, a, b), [(11,), (3, 13, 9), (3, 9, 11)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,fn,shapes", _CASES, ids=[c[0] for c in _CASES])
def test_padded_matmul_computes_eager_values(on_cpu, name, fn, shapes, dtype):
    torch.manual_seed(0)
    inputs = [_rand(*s, dtype=dtype) for s in shapes]
    gm, padded = _rewritten(fn, *inputs)
    assert padded == 1, gm.code
    _assert_padded(gm, fn, inputs, dtype)


def test_lm_head_pads_each_operand_once_through_transposes(on_cpu):
    """GPT-2's head: logits = h @ W^T, grad_h = g @ W, grad_W = g^T @ h. W and g are each padded once,
    along the vocabulary, and the transposes read the padded tensors."""
    def head(h, w, g):
        return h @ w.t(), g @ w, g.t() @ h

    inputs = [_rand(16, 12), _rand(37, 12), _rand(16, 37)]
    gm, padded = _rewritten(head, *inputs)
    assert padded == 3
    _assert_padded(gm, head, inputs, torch.float32)
    pads = {n.args[0].name: tuple(n.meta["val"].shape) for n in _nodes(gm, {aten.constant_pad_nd.default})}
    assert pads == {"w_1": (40, 12), "g_1": (16, 40)}, gm.code
    shapes = [tuple(n.meta["val"].shape) for n in _nodes(gm, {aten.mm.default})]
    assert shapes == [(16, 40), (16, 12), (40, 12)], gm.code
    slices = [tuple(n.meta["val"].shape) for n in _nodes(gm, {aten.slice.Tensor})]
    assert slices == [(16, 37), (37, 12)], gm.code
    assert not _nodes(gm, {aten.t.default}) or all(
        n.args[0].target is aten.constant_pad_nd.default for n in _nodes(gm, {aten.t.default}))


def test_new_nodes_keep_the_source_entry(on_cpu):
    gm = make_fx(torch.mm, tracing_mode="fake")(_rand(13, 9), _rand(9, 11))
    for node in gm.graph.nodes:
        node.meta["pydisc_entry"] = 7
    assert pad_unaligned_matmuls(gm, CPU) == 1
    assert all(n.meta.get("pydisc_entry") == 7 for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("shapes,dtype", [
    ([(16, 12), (12, 8)], torch.float32),       # aligned
    ([(37, 12), (12, 16)], torch.float32),      # odd M of a dense a: not a leading dim
    ([(16, 24), (24, 8)], torch.bfloat16),      # aligned for 2-byte types
    ([(13, 9), (9, 11)], torch.float64),        # no alignment rule for this dtype
    ([(13, 9), (9, 11)], torch.int64),
], ids=["aligned f32", "odd M dense", "aligned bf16", "f64", "int64"])
def test_aligned_or_other_dtypes_are_left_alone(on_cpu, shapes, dtype):
    gm = make_fx(torch.mm, tracing_mode="fake")(*[torch.ones(s, dtype=dtype) for s in shapes])
    code = gm.code
    assert pad_unaligned_matmuls(gm, CPU) == 0
    assert gm.code == code


def test_small_matmuls_and_other_devices_are_left_alone(monkeypatch):
    gm = make_fx(torch.mm, tracing_mode="fake")(_rand(13, 9), _rand(9, 11))
    code = gm.code
    assert pad_unaligned_matmuls(gm, CPU) == 0            # cuBLAS runs only CUDA's matmuls
    monkeypatch.setattr(PM, "pads_matmuls", lambda device: True)
    assert pad_unaligned_matmuls(gm, CPU) == 0            # 13*9*11 multiply-adds: below the threshold
    monkeypatch.setattr(PM, "MIN_MULTIPLY_ADDS", 13 * 9 * 11)
    assert pad_unaligned_matmuls(gm, CPU) == 1
    assert gm.code != code


def test_policy_follows_the_library_matmuls(monkeypatch):
    from pydisc.config import CONFIG

    monkeypatch.setattr(CONFIG, "gpu_matmul", "torch")
    assert PM.pads_matmuls(torch.device("cuda")) and not PM.pads_matmuls(CPU)
    monkeypatch.setattr(CONFIG, "gpu_matmul", "iree")
    assert not PM.pads_matmuls(torch.device("cuda"))


def test_symbolic_sizes_are_left_alone(on_cpu):
    gm = make_fx(torch.mm, tracing_mode="symbolic")(_rand(13, 9), _rand(9, 11))
    assert pad_unaligned_matmuls(gm, CPU) == 0


class _TiedHead(nn.Module):
    """A language model's head with its vocabulary (1001) unaligned, tied to the embedding as in GPT-2."""

    def __init__(self, vocab: int = 1001, hidden: int = 64):
        super().__init__()
        self.embed, self.proj = nn.Embedding(vocab, hidden), nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.proj(self.embed(ids))), self.embed.weight)


def test_training_with_padded_lm_head_matches_eager(monkeypatch, on_cpu):
    """Three SGD steps through pydisc with the CUDA policy (matmuls in torch, padded) equal eager's."""
    counts: list[int] = []

    def counting(gm, device):
        counts.append(pad_unaligned_matmuls(gm, device))
        return counts[-1]

    monkeypatch.setattr(pydisc.cluster, "pad_unaligned_matmuls", counting)
    _library_policy(monkeypatch)
    pstep.clear_plans()
    pydisc.reset_metrics()
    try:
        torch.manual_seed(0)
        model = _TiedHead()
        twin = pydisc.lazy(copy.deepcopy(model))
        ids, targets = torch.randint(0, 1001, (2, 9)), torch.randint(0, 1001, (2, 9))
        opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin))
        losses, twin_losses = [], []
        for _ in range(3):
            for m, o, out in ((model, opt, losses), (twin, twin_opt, twin_losses)):
                loss = F.cross_entropy(m(ids).view(-1, 1001), targets.view(-1))
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(loss)
            pydisc.mark_step()
        torch.testing.assert_close(torch.stack([x.detach().cpu() for x in twin_losses]),
                                   torch.stack([x.detach() for x in losses]), rtol=1e-5, atol=1e-5)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)
        # the logits, the gradient of the head's input and of the tied weight: the vocabulary padded
        assert counts and max(counts) >= 3, counts
        m = pydisc.metrics()
        assert m["fallback_ops"] == {} and m["compile_failures"] == {}, (m["fallback_ops"], m["compile_failures"])
        assert m["library_ops"].get("aten.mm.default", 0) > 0, m["library_ops"]
    finally:
        pstep.clear_plans()
