"""The fast recorder (PYDISC_FAST_RECORD=1, frontend/fast.py): training steps recorded at
`__torch_function__` and differentiated at plan time equal eager, and so does every step it cannot follow
(demoted to the dispatch recorder), each cause counted."""
from __future__ import annotations

import copy
import gc
import inspect
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pydisc
from pydisc.config import CONFIG
from pydisc.driver import dynamic, plan
from pydisc.frontend import fast, segment
from pydisc.frontend.tensor import LazyTensor, StrictModeError
from pydisc.metrics import METRICS


@pytest.fixture
def fast_recording():
    """Every lazy module records fast (whatever PYDISC_FAST_RECORD says); the default again after."""
    previous = fast.FAST.default
    fast.install()
    METRICS.reset()
    dynamic.clear()     # no sizes of another test's steps: the first step records fast
    yield
    fast.uninstall()
    fast.set_default(previous)


@pytest.fixture
def replayed_eagerly(monkeypatch):
    """Recording is the subject, not compiling: the recorded steps replay in torch at mark_step
    (PYDISC_DISABLE), not through IREE, whose compiles of each variant cost ~20 s on a 2-core CPU.
    The tests that compile (the block, the HF models, autocast) cover the planned path."""
    monkeypatch.setattr(CONFIG, "disable", True)


class Block(nn.Module):
    """A pre-norm transformer block with torch's fused attention, and a classifier head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = [y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v)]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.head(x.mean(dim=1))


def _train(make, forward, steps: int = 3, opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batch=None,
           **lazy_options):
    """Eager and lazy copies of one model trained side by side: (eager losses, lazy losses, models)."""
    torch.manual_seed(0)
    ref = make()
    model = pydisc.lazy(copy.deepcopy(ref), **lazy_options)
    o_ref, o = opt(ref.parameters()), opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    losses, lazy_losses = [], []
    for _ in range(steps):
        x, y = (batch or (lambda g: (torch.randn(4, 6, 16, generator=g), torch.randint(0, 5, (4,), generator=g))))(g)
        for m, op, out in ((ref, o_ref, losses), (model, o, lazy_losses)):
            op.zero_grad()
            loss = forward(m, x, y)
            op.step()
            if m is model:
                pydisc.mark_step()
            out.append(loss.item())
    return losses, lazy_losses, ref, model


def _assert_same(ref: nn.Module, model: nn.Module, losses, lazy_losses, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(lazy_losses), torch.tensor(losses), rtol=tol, atol=tol)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=tol, atol=tol, msg=name)


def _ce(m, x, y):
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    return loss


def test_block_trains_like_eager_with_few_entries(fast_recording) -> None:
    losses, lazy_losses, ref, model = _train(Block, _ce)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_segments"] == 3, m
    assert m["graph_cache_hits"] >= 1 and m["fallback_ops"] == {}
    # the forward and its backward as ~25 calls; the dispatcher records ~120 ATen ops for them
    assert m["fast_entries"] <= 3 * 30, m["fast_entries"]


class _Varying(nn.Module):
    """A forward whose calls differ from the step before's in one place each step, in what a step's kept
    calls hold: which parameter a call takes (a new one, or one an earlier call took), a constant (a
    softmax's dim, a float, a slice, the loss's reduction), a keyword's name, the function called on the
    same arguments, the dtype of an eager tensor it reads, the order of the values it takes; grad mode and
    autocast around a call."""

    ASPECTS = 12

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(32, 5)
        self.flags = [False] * self.ASPECTS
        self.steps = 0
        self.eager = torch.linspace(0.5, 1.5, 16)     # a plain attribute: an eager tensor of the forward
        self.dtypes: list[torch.dtype] = []

    def forward(self, x):
        if self.steps:
            k = (self.steps - 1) % self.ASPECTS
            self.flags[k] = not self.flags[k]       # one difference from the step before
        self.steps += 1
        f = self.flags
        h = self.b(x) if f[0] else self.a(x)
        h = (self.a if f[7] else self.c)(h)
        g = F.softmax(h, dim=1 if f[1] else 2) * (0.5 if f[2] else 2.0)
        g = (g * (self.eager.double() if f[3] else self.eager)).float()
        g = g.clamp(min=0.2) if f[8] else g.clamp(max=0.2)
        g = torch.tanh(g) if f[9] else torch.sigmoid(g)
        with torch.set_grad_enabled(not f[10]):
            g = g + h.abs().mean()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=f[11]):
            side = self.c(h)        # (its dtype is what autocast decides; bfloat16 rounding stays out of the loss)
        self.dtypes.append(side.dtype)
        both = torch.cat([g, h] if f[4] else [h, g], dim=-1)
        both = both[:, 1:] if f[5] else both[:, :-1]
        return self.head(both.mean(dim=1))


def test_calls_that_differ_from_the_step_befores_are_recorded_as_made(fast_recording, replayed_eagerly) -> None:
    """A segment takes the calls of its module's last segment as they are where each matches, argument by
    argument (`Segment.follow`): a step whose calls differ in a constant, in the values or parameter a call
    takes, or in an eager tensor's dtype computes its own, as eager does."""
    def forward(m, x, y):
        loss = F.cross_entropy(m(x), y, reduction="sum" if m.flags[6] else "mean")
        loss.backward()
        return loss

    steps = 2 * _Varying.ASPECTS + 1
    losses, lazy_losses, ref, model = _train(_Varying, forward, steps=steps)
    _assert_same(ref, model, losses, lazy_losses)
    assert model.dtypes == ref.dtypes and torch.bfloat16 in ref.dtypes
    assert METRICS.fast_segments == steps and not METRICS.fast_demotions


def test_fast_and_dispatch_paths_give_the_same_step(fast_recording) -> None:
    fast_run = _train(Block, _ce, opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    fast.uninstall()
    try:
        slow_run = _train(Block, _ce, opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    finally:
        fast.install()
    torch.testing.assert_close(torch.tensor(fast_run[1]), torch.tensor(slow_run[1]), rtol=1e-6, atol=1e-6)
    for a, b in zip(fast_run[3].state_dict().values(), slow_run[3].state_dict().values()):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-6, atol=1e-6)


def test_gradients_accumulate_over_micro_batches(fast_recording) -> None:
    def two_micro_batches(m, x, y):
        for half in (slice(0, 2), slice(2, 4)):
            loss = F.cross_entropy(m(x[half]), y[half]) / 2
            loss.backward()
        return loss

    losses, lazy_losses, ref, model = _train(Block, two_micro_batches)
    _assert_same(ref, model, losses, lazy_losses)
    assert pydisc.metrics()["fast_segments"] == 6


class Gated(nn.Module):
    """A read in the forward (as HF's mask checks do), and, with `count_positive`, an op whose result's size
    depends on data."""

    def __init__(self, count_positive: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)
        self.count_positive = count_positive

    def forward(self, x):
        h = self.a(x).mean(dim=1)
        if bool((h.abs() < 1e6).all()):
            h = h * 2
        out = self.b(torch.tanh(h))
        return out + torch.nonzero(h > 0).shape[0] if self.count_positive else out


def test_a_read_in_the_forward_is_computed_apart_without_demoting(fast_recording) -> None:
    losses, lazy_losses, ref, model = _train(Gated, _ce)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_reads"] == 3, m


class Branching(nn.Module):
    """A read whose value differs between steps with the same calls before it (the batch's sign), and
    decides what the forward calls after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x):
        h = self.a(x).mean(dim=1)
        if bool(x.mean() > 0):
            h = h * 2.0
        else:
            h = torch.sin(h) * 0.5
        return self.b(torch.tanh(h))


def test_a_read_followed_from_the_step_before_is_computed_again(fast_recording, replayed_eagerly) -> None:
    """A segment follows its module's last one's calls past a read (`Segment.follow` keeps reads), and computes
    the read again at every step: where its value differs, so do the calls after it, as in eager."""
    signs = iter([1, 1, -1, -1, 1, -1, -1, 1])

    def batch(g):
        x = torch.randn(4, 6, 16, generator=g).abs() + 0.1
        return x * next(signs), torch.randint(0, 5, (4,), generator=g)

    losses, lazy_losses, ref, model = _train(Branching, _ce, steps=8, batch=batch)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_reads"] == 8, m
    assert fast.FAST.scripts[model][(True, torch.device("cpu"))], "the read's segment kept its calls"


def test_a_read_of_random_values_demotes_and_matches_the_step(fast_recording) -> None:
    model = pydisc.lazy(nn.Linear(8, 8))
    x = torch.randn(4, 8)
    h = F.dropout(model(x), 0.5)
    seen = h.sum().item()           # must be the values the step uses, not another draw
    loss = h.sum()
    loss.backward()
    pydisc.mark_step()
    assert loss.item() == pytest.approx(seen, rel=1e-6)
    assert "a value read before mark_step that depends on random numbers" in pydisc.metrics()["fast_demotions"]


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 3        # not the derivative: only autograd.Function's own backward gives this


def _custom_function(m, x, y):
    loss = F.cross_entropy(Double.apply(m(x)), y)
    loss.backward()
    return loss


def _tensor_hook(m, x, y):
    out = m(x)
    out.register_hook(lambda g: g * 5)
    loss = F.cross_entropy(out, y)
    loss.backward()
    return loss


def _retained(m, x, y):
    loss = F.cross_entropy(m(x), y)
    loss.backward(retain_graph=True)
    return loss


class BatchNormed(nn.Module):
    """BatchNorm as a module (its `num_batches_tracked.add_(1)`, then F.batch_norm), F.batch_norm on
    statistics of the model's own, and a running average written by hand: buffers the forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.out = nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 5)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.register_buffer("average", torch.zeros(8))

    def forward(self, x):
        h = self.bn(self.lin(x).mean(dim=1))
        h = F.batch_norm(h, self.mean, self.var, training=self.training, momentum=0.3)
        if self.training:
            self.average.mul_(0.9).add_(h.detach().mean(dim=0), alpha=0.1)
        return self.out(h)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "replayed"])
def test_buffers_the_forward_writes_are_written_by_the_fast_step(planned: bool, fast_recording,
                                                                 monkeypatch) -> None:
    """BatchNorm's running statistics: F.batch_norm writes them without marking the write in its schema
    or bumping their version counters. The fast recorder's meta run missed the write, and the step left
    F.batch_norm's statistics as they were (a module's BatchNorm demoted at its `add_` first). Now the
    step writes the buffers, planned and compiled or replayed by torch, without demoting."""
    monkeypatch.setattr(CONFIG, "disable", not planned)
    losses, lazy_losses, ref, model = _train(BatchNormed, _ce, steps=4)
    _assert_same(ref, model, losses, lazy_losses)
    assert model.mean.abs().sum() > 0 and model.bn.num_batches_tracked.item() == 4
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_segments"] == 4, m
    if planned:
        assert m["executions"] >= 3 and m["fallback_ops"] == {}, m
    # in eval mode, nothing is written
    ref.eval()
    model.eval()
    x = torch.randn(4, 6, 16)
    with torch.enable_grad():
        torch.testing.assert_close(model(x).cpu(), ref(x), rtol=1e-5, atol=1e-5)
    pydisc.mark_step()
    _assert_same(ref, model, [], [])


@pytest.mark.parametrize("make,forward,reason", [
    (Block, _custom_function, "autograd.Function (Double)"),
    (Block, _tensor_hook, "tensor hooks"),
    (Block, _retained, "backward with arguments"),
], ids=["autograd-function", "tensor-hook", "retain-graph"])
def test_what_the_fast_path_cannot_follow_is_demoted_and_equals_eager(make, forward, reason, fast_recording,
                                                                      replayed_eagerly) -> None:
    losses, lazy_losses, ref, model = _train(make, forward)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    # (two steps in a row demoted: the third is recorded op by op from the start, fast.GIVE_UP_AFTER)
    assert m["fast_demotions"].get(reason) == 2 and m["fast_skipped"] == 1, (m["fast_demotions"], m["fast_skipped"])


def test_sizes_read_after_an_in_place_view_op_are_eagers(fast_recording, replayed_eagerly) -> None:
    """`h.unsqueeze_(0)` demotes the segment; the sizes code reads from `h` afterwards are those of the
    tensor it now stands for (they were the wrapper's own, as before the op: `h.shape` read (3, 4)
    where eager reads (3, 1, 4), and code branching on it would have taken another path)."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x) * 2
            h.unsqueeze_(0)
            h.transpose_(0, 1)
            return (h * torch.arange(4.0)).sum(), (tuple(h.shape), h.dim(), h.stride(), len(h))

    torch.manual_seed(0)
    ref = Model()
    model = pydisc.lazy(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    (loss, seen), (ref_loss, want) = model(x), ref(x)
    loss.backward()
    ref_loss.backward()
    pydisc.mark_step()
    assert seen == want == ((3, 1, 4), 3, (4, 12, 1), 3)
    torch.testing.assert_close(model.lin.weight.grad.cpu(), ref.lin.weight.grad)
    assert pydisc.metrics()["fast_demotions"].get("an in-place op that changes sizes") == 1


def test_eager_errors_are_raised(fast_recording) -> None:
    model = pydisc.lazy(nn.Linear(8, 4))
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        model(torch.randn(3, 8)).backward()
    pydisc.mark_step()
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        model(torch.randn(3, 7))
    pydisc.mark_step()
    for _ in range(2):      # and the steps after record fast again (the first one, with other sizes
        loss = model(torch.randn(3, 8)).sum()   # than the step before's, by the dispatcher)
        loss.backward()
        pydisc.mark_step()
    assert pydisc.metrics()["fast_segments"] >= 1


@pytest.mark.parametrize("name", ["gpt2", pytest.param("bert", marks=pytest.mark.long)])
def test_hf_models_train_like_eager_on_the_fast_path(name: str, fast_recording, monkeypatch) -> None:
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import hf_models
    from pydisc.config import CONFIG

    monkeypatch.setattr(CONFIG, "compile_after", 2)
    run = hf_models.train_side_by_side(name, steps=4)
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["fast_demotions"] == {} and m["fast_segments"] >= 3, (m["fast_demotions"], m["fast_segments"])
    assert m["fallback_ops"] == {} and m["plans_compiled"] == 1, (m["fallback_ops"], m["plans_compiled"])
    # and the dispatch recorder's step, from the same weights and batches, gives the same model
    fast.uninstall()
    try:
        slow = hf_models.train_side_by_side(name, steps=4)
    finally:
        fast.install()
    assert slow.metrics["fast_segments"] == 0
    torch.testing.assert_close(torch.tensor(run.lazy_losses), torch.tensor(slow.lazy_losses), rtol=1e-5, atol=1e-5)
    for (key, a), b in zip(run.lazy_model.named_parameters(), slow.lazy_model.parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), rtol=1e-4, atol=1e-4, msg=key)


def _autocast_ce(dtype):
    def forward(m, x, y):
        with torch.autocast("cpu", dtype=dtype):
            logits = m(x)
            assert logits.dtype == dtype
            loss = F.cross_entropy(logits, y)      # autocast runs it in float32
        assert loss.dtype == torch.float32
        loss.backward()
        return loss
    return forward


def test_autocast_is_followed_and_trains_like_eager_and_the_dispatch_path(fast_recording) -> None:
    """Under autocast each call is recorded with autocast's state and replayed under it, so the casts
    (and their backward) are eager's; metadata from fake tensors of the device, which autocast casts."""
    forward = _autocast_ce(torch.bfloat16)
    losses, lazy_losses, ref, model = _train(Block, forward)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_segments"] == 3, m["fast_demotions"]
    # bf16 keeps 8 bits of mantissa: eager and the compiled step round in different places
    _assert_same(ref, model, losses, lazy_losses, tol=2e-2)
    for p in model.parameters():
        assert p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
    fast.uninstall()
    try:
        slow = _train(Block, forward)
    finally:
        fast.install()
    torch.testing.assert_close(torch.tensor(lazy_losses), torch.tensor(slow[1]), rtol=1e-3, atol=1e-3)
    for a, b in zip(model.state_dict().values(), slow[3].state_dict().values()):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-3, atol=1e-3)


def test_autocast_float16_with_grad_scaler_on_the_fast_path(fast_recording) -> None:
    def make(p):
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    ref = Block()
    model = pydisc.lazy(copy.deepcopy(ref))
    runs = []
    for m in (ref, model):
        opt, scaler = make(m.parameters()), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(4, 6, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if m is model:
                pydisc.mark_step()
            losses.append(loss.item())
        runs.append((losses, scaler.get_scale()))
    assert runs[1][1] == runs[0][1]
    _assert_same(ref, model, runs[0][0], runs[1][0], tol=2e-2)
    assert pydisc.metrics()["fast_demotions"] == {} and pydisc.metrics()["fast_segments"] == 3


def test_the_per_module_switch_overrides_the_default() -> None:
    previous = fast.FAST.default
    fast.uninstall()
    try:
        METRICS.reset()
        chosen = _train(Block, _ce, steps=2)                # default off: the dispatcher records
        assert pydisc.metrics()["fast_segments"] == 0
        _assert_same(*chosen[2:], *chosen[:2])

        losses, lazy_losses, ref, model = _train(Block, _ce, steps=2, fast_record=True)
        _assert_same(ref, model, losses, lazy_losses)
        assert pydisc.metrics()["fast_segments"] == 2 and fast.FAST.default == "off"

        fast.install()                                      # default on: a module can still opt out
        METRICS.reset()

        losses, lazy_losses, ref, model = _train(Block, _ce, steps=2, fast_record=False)
        _assert_same(ref, model, losses, lazy_losses)
        assert pydisc.metrics()["fast_segments"] == 0
        with pytest.raises(TypeError, match="fast_record must be True, False or None"):
            pydisc.lazy(nn.Linear(2, 2), fast_record="yes")
    finally:
        fast.uninstall()
        fast.set_default(previous)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_models_under_autocast_train_like_eager_and_end_compiled(name: str, fast_recording, monkeypatch) -> None:
    """bf16 autocast on the CPU. T5's step is one torch.func cannot differentiate (its attention's float
    position bias under autocast, in torch 2.13): the fused step's planning fails, that step runs
    eagerly (with autograd, right), and the process records op by op from then on, which compiles."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import hf_models
    from pydisc.config import CONFIG

    monkeypatch.setattr(CONFIG, "compile_after", 2)
    run = hf_models.train_side_by_side(name, steps=5, autocast=torch.bfloat16)
    hf_models.assert_trains_like_eager(run, rtol=2e-2, atol=2e-2)
    m = run.metrics
    assert run.compiled_steps[-1], run.compiled_steps
    assert m["fast_segments"] >= 2, m["fast_segments"]
    assert set(m["fast_demotions"]) <= {"planning failed: RuntimeError"}, m["fast_demotions"]
    if name == "gpt2":
        assert m["fast_demotions"] == {} and m["plans_compiled"] == 1


@pytest.mark.parametrize("scope,segments", [("cpu", 2), ("cuda", 0), ("all", 2), ("off", 0)])
def test_the_default_scope_says_which_devices_record_fast(scope: str, segments: int) -> None:
    """PYDISC_FAST_RECORD's scope (default "all"): CPU modules here."""
    previous = fast.FAST.default
    fast.set_default(scope)
    try:
        METRICS.reset()
        dynamic.clear()
        losses, lazy_losses, ref, model = _train(Block, _ce, steps=2)
        _assert_same(ref, model, losses, lazy_losses)
        assert pydisc.metrics()["fast_segments"] == segments
    finally:
        fast.set_default(previous)


# ---- classes of steps the fast path once got wrong (each equal to eager now, most by demoting) ----

class _Two(nn.Module):
    """Two layers and a parameter, whose forward is the function it is given: called through the module,
    whose forward hook opens the segment (its layers called directly would record op by op)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.s = nn.Parameter(torch.full((6,), 2.0))
        self.register_buffer("n", torch.zeros(6))

    def forward(self, x, fn):
        return fn(self, x)


class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w):
        return torch.round(w * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


def _setitem_requiring_grad(m, x):
    buf = x.new_zeros(x.shape[0], 6)
    buf[:, :3] = m.a(x)[:, :3]          # written in place, not returned: buf requires grad from here
    return m.b(buf)


def _write_through_a_view_of_a_parameter(m, x):
    h = m.a(x)
    with torch.no_grad():
        m.b.weight.view(-1).mul_(0.5)
    return m.b(h)


def _setitem_with_a_tensor_index(m, x):
    h = m.a(x)
    h[:, torch.tensor(3)] = 0.0         # no meta run: it is a write, not a read
    return m.b(h)


def _tensor_in_a_slice(m, x):
    h = m.a(x)
    return m.b(h[:, :torch.tensor(3)].sum(dim=1, keepdim=True).expand(-1, 6))


def _parameter_outside_autograd(m, x):
    h = m.a(x)
    with torch.no_grad():
        h.mul_(m.s)                     # s gets no gradient in eager: None, not zeros
    return m.b(h.type_as(m.s))


def _function_on_a_parameter(m, x):
    x = x * 1.0                         # (the segment is open when the Function is applied)
    return m.b(torch.tanh(F.linear(x, _STE.apply(m.a.weight), m.a.bias)))


@pytest.mark.parametrize("forward", [_setitem_requiring_grad, _write_through_a_view_of_a_parameter,
                                     _setitem_with_a_tensor_index, _tensor_in_a_slice,
                                     _parameter_outside_autograd, _function_on_a_parameter],
                         ids=lambda f: f.__name__.strip("_"))
def test_steps_once_wrong_on_the_fast_path_equal_eager(forward, fast_recording, replayed_eagerly) -> None:
    def step(m, x, y):
        loss = m(x, forward).square().sum()
        loss.backward()
        return loss

    def batch(g):
        return torch.randn(5, 4, generator=g), None

    losses, lazy_losses, ref, model = _train(
        _Two, step, steps=2, batch=batch, opt=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))
    _assert_same(ref, model, losses, lazy_losses)
    assert (model.s.grad is None) == (ref.s.grad is None)
    m = pydisc.metrics()
    assert m["fast_segments"] + sum(m["fast_demotions"].values()) == 2, m     # each step began on the fast path


class _CheckpointedAfterAHook(nn.Module):
    """An embedding whose output demotes the forward, then a layer under a non-reentrant
    `torch.utils.checkpoint` that takes that output and a value the forward made before. `demote`: a tensor
    hook on the output, or (a frozen embedding, as under LoRA) `requires_grad_()` on it, as HF's
    `enable_input_require_grads` does for gradient checkpointing."""

    def __init__(self, demote: str) -> None:
        super().__init__()
        self.demote = demote
        self.emb, self.a, self.head = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10)
        self.emb.weight.requires_grad_(demote == "tensor hooks")
        self.register_buffer("freq", torch.linspace(0.5, 1.5, 8))

    def forward(self, ids):
        cos = torch.cos(self.freq * torch.arange(ids.shape[1]).float()[:, None])
        h = self.emb(ids)
        if self.demote == "tensor hooks":
            h.register_hook(lambda g: g * 2)
        else:
            h.requires_grad_()
        h = torch.utils.checkpoint.checkpoint(lambda h, cos: h + torch.tanh(self.a(h) * cos), h, cos,
                                              use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("demote", ["tensor hooks", "requires_grad_"])
def test_a_demoted_forward_under_a_non_reentrant_checkpoint_equals_eager(demote: str, fast_recording) -> None:
    """The checkpoint keeps the values it is given (here a demoted forward's, which forward to their
    ATen-level tensors) and recomputes the layer from them in the backward, where torch functions are off
    and pydisc's handler does not see them: autograd took them for tensors that need no gradient, saved
    fewer tensors than in the forward, and the checkpoint raised `CheckpointError` (HF Llama with
    `gradient_checkpointing_enable()`, whose embedding hook demoted; with LoRA's frozen embeddings that hook
    still demotes, and makes the value require grad after the demotion)."""
    def forward(m, ids, labels):
        loss = F.cross_entropy(m(ids).flatten(0, 1), labels.flatten())
        loss.backward()
        return loss

    losses, lazy_losses, ref, model = _train(lambda: _CheckpointedAfterAHook(demote), forward, steps=3,
                                             batch=lambda g: (torch.randint(0, 10, (3, 5), generator=g),) * 2)
    _assert_same(ref, model, losses, lazy_losses)
    assert pydisc.metrics()["fast_demotions"][demote] >= 1


def test_two_backwards_through_a_detached_value_equal_eager(fast_recording) -> None:
    """A GAN's step: the first backward goes through `fake.detach()`, the second through `fake`."""
    class GAN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.G, self.D = nn.Linear(3, 4), nn.Linear(4, 1)

        def forward(self, x, which):
            return self.G(x) if which == "G" else self.D(x)

    def step(m, z, y):
        fake = m(z, "G")
        m(fake.detach(), "D").square().mean().backward()
        g_loss = (1 - m(fake, "D")).square().mean()
        g_loss.backward()
        return g_loss

    losses, lazy_losses, ref, model = _train(GAN, step, steps=2, batch=lambda g: (torch.randn(5, 3, generator=g), None))
    _assert_same(ref, model, losses, lazy_losses)


def test_mark_step_between_forward_and_backward_equals_eager(fast_recording, replayed_eagerly) -> None:
    def step(m, x, y):
        out = m(x)
        if m is not ref_holder[0]:
            pydisc.mark_step()          # the forward's values must still be differentiable after it
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss

    ref_holder = []

    def make():
        ref_holder.append(Block())
        return ref_holder[-1]

    losses, lazy_losses, ref, model = _train(make, step, steps=2)
    _assert_same(ref, model, losses, lazy_losses)


def test_a_read_of_attention_with_dropout_is_the_steps_value(fast_recording, replayed_eagerly) -> None:
    """sdpa's dropout draws inside an op whose name says nothing of it: found by its ATen tag."""
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 2)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)).mean()

    reads = []

    def step(m, x, y):
        torch.manual_seed(10)
        loss = m(x)
        reads.append(loss.item())       # logged before backward
        loss.backward()
        return loss

    losses, lazy_losses, ref, model = _train(Attn, step, steps=2, batch=lambda g: (torch.randn(2, 5, 8, generator=g), None))
    _assert_same(ref, model, losses, lazy_losses)
    assert reads[1::2] == pytest.approx(lazy_losses, rel=1e-6)


def test_a_non_contiguous_parameter_gets_its_gradient_right(fast_recording) -> None:
    class T(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pt = nn.Parameter(torch.randn(3, 6).t())     # strides (1, 6)

        def forward(self, x):
            return torch.tanh(x @ self.pt)

    def step(m, x, y):
        loss = m(x).square().sum()
        loss.backward()
        m.pt.grad.contiguous().view(-1)      # as _flatten_dense_tensors does
        return loss

    losses, lazy_losses, ref, model = _train(T, step, steps=2, batch=lambda g: (torch.randn(5, 6, generator=g), None))
    _assert_same(ref, model, losses, lazy_losses)


def test_an_error_in_a_step_leaves_the_next_steps_right(fast_recording) -> None:
    model = pydisc.lazy(nn.Linear(4, 2))
    mask = torch.ones(3, 4)
    loss = (model(torch.randn(3, 4)) * mask[:, :2]).sum()
    mask.mul_(2)                        # an eager input changed before backward: refused, as documented
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()
    pydisc.mark_step()
    ref = copy.deepcopy(nn.Linear(4, 2))
    ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    x = torch.randn(3, 4)
    for m in (ref, model):
        m(x).square().sum().backward()
    pydisc.mark_step()
    torch.testing.assert_close(model.weight.grad.cpu(), ref.weight.grad, rtol=1e-5, atol=1e-5)


class _Unchanging(nn.Module):
    """Calls eager answers with their argument itself (dropout of rate 0 or in eval mode, `contiguous()`
    of a contiguous value, a cast to its own dtype), between two linear layers."""

    def __init__(self, identities: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)
        self.identities = identities
        self.returned_itself: list[bool] = []

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.identities:
            same = [F.dropout(h, 0.0, training=True), F.dropout(h, 0.5, training=False), h.contiguous(),
                    h.to(h.dtype), h.float(), h.type_as(h)]
            self.returned_itself = [y is h for y in same]
            h = same[-1]
        return self.b(h).mean(dim=1)


def test_calls_that_return_their_argument_are_not_entries(fast_recording, replayed_eagerly) -> None:
    runs = {}
    for identities in (False, True):
        METRICS.reset()
        losses, lazy_losses, ref, model = _train(lambda: _Unchanging(identities), _ce)
        _assert_same(ref, model, losses, lazy_losses)
        assert model.returned_itself == ref.returned_itself == ([True] * 6 if identities else []), \
            (model.returned_itself, ref.returned_itself)
        runs[identities] = pydisc.metrics()
        assert runs[identities]["fast_demotions"] == {} and runs[identities]["fast_segments"] == 3
    assert runs[True]["fast_entries"] == runs[False]["fast_entries"], (runs[True]["fast_entries"],
                                                                      runs[False]["fast_entries"])


def test_a_segment_end_collects_cycles_only_where_they_hold_its_values(fast_recording, replayed_eagerly,
                                                                       monkeypatch) -> None:
    """A segment's end runs the cyclic GC where values of the forward may be held by reference cycles
    alone (they would become outputs of the step); not every step where some library leaves cycles of
    its own, nor because of pydisc's own bookkeeping (a call returning its argument)."""
    collections = []

    class _GC:
        def __getattr__(self, name):
            return getattr(gc, name)

        @staticmethod
        def collect(generation=2):
            collections.append(generation)
            return gc.collect(generation)

    monkeypatch.setattr(segment, "gc", _GC())

    class Cyclic(_Unchanging):
        def forward(self, x):
            junk = [x]
            junk.append(junk)       # a cycle of the library's own, holding no value of the forward
            if self.keep_in_cycle:
                holder = {"h": self.a(x)}
                holder["self"] = holder     # a value of the forward held by a cycle alone
            return super().forward(x)

    def make():
        m = Cyclic(identities=True)
        m.keep_in_cycle = False
        return m

    losses, lazy_losses, ref, model = _train(make, _ce, steps=6)
    _assert_same(ref, model, losses, lazy_losses)
    assert len(collections) <= 2, collections     # until the values alive at the end are the same
    model.keep_in_cycle = ref.keep_in_cycle = True
    del collections[:]
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))
    for _ in range(3):
        _ce(model, x, y)
        pydisc.mark_step()
    # the cycle holding a value is collected at each end (another value is alive than at the last end)
    assert len(collections) >= 1, collections
    assert pydisc.metrics()["fast_demotions"] == {}


def test_a_second_model_is_not_taken_for_the_first_with_other_sizes(fast_recording, replayed_eagerly) -> None:
    """Every forward recorded at `__torch_function__` is one "fused" entry: a second model trained after a
    first, with inputs of the same rank and other sizes, was taken for the first one's graph with changed
    sizes, flagged dynamic, and recorded op by op from then on."""
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(6, 5)

        def forward(self, x):
            return self.inner(x).mean(dim=1)

    _train(Pool, _ce, batch=lambda g: (torch.randn(4, 7, 6, generator=g), torch.randint(0, 5, (4,), generator=g)))
    METRICS.reset()
    losses, lazy_losses, ref, model = _train(Block, _ce)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    # (its first step, whose inputs have other sizes than the step before's, goes through the dispatcher)
    assert m["fast_segments"] == 2 and m["dynamic_eager_steps"] == 0 and m["fast_demotions"] == {}, {
        k: m[k] for k in ("fast_segments", "dynamic_eager_steps", "fast_demotions", "recompiles")}


@pytest.mark.parametrize("fast_record", [True, False])
def test_recording_and_replaying_make_no_reference_cycles(fast_record, fast_recording, replayed_eagerly) -> None:
    """The cyclic GC pauses while a step records: a reference cycle that pydisc makes around a step's
    tensors (a nested function that calls itself, capturing them) keeps them alive past the step. Recording
    (on both paths, with a read mid-forward and an op run eagerly while recording) and replaying the step
    in torch leave no cyclic garbage that holds a tensor."""
    torch.manual_seed(0)
    model = pydisc.lazy(Gated(count_positive=True), fast_record=fast_record)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))

    def step():
        _ce(model, x, y)
        opt.step()
        opt.zero_grad()
        pydisc.mark_step()

    step()                                          # recipes, optimizer state
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(2):
            step()
        gc.collect()
        held = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert held == [], held


def test_a_recompile_of_a_fast_step_names_the_call_that_changed(fast_recording) -> None:
    """A constant of one call in a forward recorded at `__torch_function__` changes: the plan is made again,
    and the reason names that call and the values, not the whole forward's signature."""
    class Capped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 5)
            self.cap = 1.5

        def forward(self, x):
            return self.b(torch.clamp(self.a(x), max=self.cap)).mean(dim=1)

    torch.manual_seed(0)
    ref = Capped()
    model = pydisc.lazy(copy.deepcopy(ref))
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))
    for cap in (1.5, 1.5, 1.5, 0.25):
        for m in (ref, model):
            m.cap = cap
            m.zero_grad()
            _ce(m, x, y)
        pydisc.mark_step()
    torch.testing.assert_close(model.a.weight.grad.cpu(), ref.a.weight.grad, rtol=1e-5, atol=1e-6)
    reasons = pydisc.metrics()["recompiles"]
    assert any("call #1 (torch.clamp) argument changed" in r and "1.5" in r and "0.25" in r for r in reasons), reasons


class _HookedInTraining(nn.Module):
    def forward(self, x):
        if self.training:
            x.register_hook(lambda g: g * 0.5)
        return x


def test_a_module_demoted_twice_in_a_row_records_op_by_op_in_that_mode(fast_recording, replayed_eagerly) -> None:
    """A layer that hooks its output in training, which a segment cannot follow: each step was recorded
    fast, then again op by op. After two such steps in a row the module's training forwards are recorded
    op by op at once; in eval mode (no hook) its forwards are recorded fast again."""
    def make():
        return nn.Sequential(nn.Linear(16, 16), _HookedInTraining(), nn.ReLU(), nn.Linear(16, 5))

    def forward(m, x, y):
        loss = F.cross_entropy(m(x).mean(dim=1), y)
        loss.backward()
        return loss

    losses, lazy_losses, ref, model = _train(make, forward, steps=5)
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert sum(m["fast_demotions"].values()) == 2 and m["fast_skipped"] == 3 and m["fast_segments"] == 0, m
    for net in (ref, model):
        net.eval()
    x, y = torch.randn(4, 6, 16), torch.randint(0, 5, (4,))
    for net in (ref, model):
        net.zero_grad()
        forward(net, x, y)
    pydisc.mark_step()
    torch.testing.assert_close(model[0].weight.grad.cpu(), ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    assert m["fast_segments"] == 1 and m["fast_skipped"] == 3, m


def test_the_handler_leaves_the_class_once_a_demoted_segments_values_are_gone(fast_recording) -> None:
    """A demoted segment's values forward their calls through the `__torch_function__` handler, which must
    stay on the lazy tensor class while one is alive, and only then: it costs every call on a lazy tensor
    about 2 us (the optimizer's, `zero_grad`'s, `mark_step`'s), at every later step."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    model = pydisc.lazy(copy.deepcopy(ref))
    x = torch.randn(4, 8)
    h = model(x)
    kept = h * 2
    F.dropout(h, 0.5).sum().item()      # a read of random values: demotes
    kept.sum().backward()
    del h
    pydisc.mark_step()
    assert sum(pydisc.metrics()["fast_demotions"].values()) == 1
    assert _handler_on_class()      # `kept` is alive: its calls are forwarded
    torch.testing.assert_close((kept + 1).cpu(), ref(x).detach() * 2 + 1)
    torch.testing.assert_close(model.weight.grad.cpu(), torch.full((8, 1), 2.0) * x.sum(0))
    del kept
    pydisc.mark_step()
    assert not _handler_on_class()


def _handler_on_class() -> bool:
    return LazyTensor.__dict__.get("__torch_function__") is fast._INSTALLED


class _Summed(nn.Module):
    """Two parameters whose sum is used: the backward of `a + b` gives one tensor as both gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(16, 5) * 0.3), nn.Parameter(torch.randn(16, 5) * 0.3)

    def forward(self, x):
        return x.mean(dim=1) @ (self.a + self.b)


@pytest.mark.parametrize("make", [_Summed, lambda: nn.LSTM(16, 5, batch_first=True)], ids=["sum", "lstm"])
def test_parameters_given_one_gradient_tensor_get_gradients_of_their_own(make, fast_recording,
                                                                          replayed_eagerly) -> None:
    """A backward formula that gives one tensor as the gradient of two parameters (`a + b`, an LSTM's two
    biases): each parameter's `.grad` is a tensor of its own, as eager's, so an in-place write into one
    (scaling gradients by hand, SGD's Nesterov step) leaves the other alone. The planned step once gave
    both the same tensor, and the write reached both."""
    def forward(m, x, y):
        out = m(x)
        out = out[0].mean(dim=1) if isinstance(out, tuple) else out
        loss = F.cross_entropy(out, y)
        loss.backward()
        for p in m.parameters():
            p.grad.mul_(0.5)
        return loss

    losses, lazy_losses, ref, model = _train(make, forward, steps=4)
    _assert_same(ref, model, losses, lazy_losses)
    assert pydisc.metrics()["fast_segments"] == 4
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-6)


# ---- every reason the fast path gives a step up for: triggered, counted, and equal to eager ----------

class _Counting(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Tensors(list):
    pass


def _scaled(x, options: dict):
    """A function of a library that takes part in torch's override protocol, with a dict argument."""
    if torch.overrides.has_torch_function((x,)):
        return torch.overrides.handle_torch_function(_scaled, (x,), x, options)
    return x * options["scale"]


def _zeros_sized(size, like=None):
    """... and one whose overridable call passes no tensor on (its dispatch argument is only `like`)."""
    if like is not None and torch.overrides.has_torch_function((like,)):
        return torch.overrides.handle_torch_function(_zeros_sized, (like,), size)
    return torch.zeros(size)


def _carried(m, x):
    """A value kept for the next step (truncated backpropagation), made by a step that was demoted."""
    h = m.a(x)
    out = h + m.carry if "carry" in m.__dict__ else h
    m.carry = h.detach()
    if "demoted" not in m.__dict__:
        m.demoted = True
        h.retain_grad()
    return m.b(out)


def _eager_weight(m, x):
    w = m.__dict__.setdefault("w", torch.full((6,), 0.5, requires_grad=True))   # not the module's: eager
    return m.b(m.a(x) * w)


def _step_of(forward):
    def step(m, x):
        loss = m(x, forward).square().sum()
        loss.backward()
        return loss
    return step


def _backward_outside_the_segment(m, x):
    reg = m.s.square().sum() * 0.01      # before the forward: recorded op by op
    loss = m(x, lambda m, x: m.b(m.a(x) * m.s)).square().sum()
    reg.backward()
    loss.backward()
    return loss + reg


def _history(m, x):
    s2 = m.s * 2                         # before the forward, with autograd's history
    loss = m(x, lambda m, x: m.b(m.a(x) * s2)).square().sum()
    loss.backward()
    return loss


def _no_backward(m, x):
    return m(x, lambda m, x: m.b(m.a(x))).square().sum()     # a loss kept past mark_step, no backward


def _view_before(f):
    """A step that makes a view of the buffer `n` before the forward, which gives `f(m, h, view)` to the
    second layer."""
    def step(m, x):
        view = m.n[:3]
        loss = m(x, lambda m, x: m.b(f(m, m.a(x), view))).square().sum()
        loss.backward()
        return loss
    return step


def _without_grad(fn):
    with torch.no_grad():
        return fn()


def _h(f):
    """A forward that does `f` to the first layer's output `h` and gives what the second layer makes of the result."""
    def forward(m, x):
        h = m.a(x)
        return m.b(f(m, h))
    return forward


def _set(attribute, value):
    def f(m, h):
        setattr(h, attribute, value(h))
        return h
    return f


_DEMOTIONS = [
    ("a call returning no tensor", _h(lambda m, h: h if torch.is_same_size(h, h) else -h)),
    ("a call without tensors", _h(lambda m, h: h + _zeros_sized(h.shape, like=h))),
    ("a dict argument", _h(lambda m, h: _scaled(h, {"scale": 2.0}))),
    ("a functorch transform or a dispatch mode", _h(lambda m, h: _under_a_mode(lambda: h * 2))),
    ("a move to another device", _h(lambda m, h: h if h.detach().to("meta").device.type == "meta" else -h)),
    ("a move to another device", _h(lambda m, h: h if h.detach().to(torch.ones(1, device="meta")).is_meta else -h)),
    ("a tensor in a slice", _h(lambda m, h: h[:, :torch.tensor(3)].sum(dim=1, keepdim=True).expand(-1, 6))),
    ("tensors in a _Tensors", _h(lambda m, h: torch.cat(_Tensors([h[:, :3], h[:, 3:]]), dim=1))),
    ("an argument that cannot be hashed", _h(lambda m, h: h * h.new_tensor(np.full(6, 2.0, dtype=np.float32)))),
    ("a value of a demoted step", _carried),
    ("a value of the step used where the fast recorder cannot follow it",
     _h(lambda m, h: h + _in_a_thread(lambda: h.detach() * 2))),
    ("a value of the step used where the fast recorder cannot follow it",
     _h(lambda m, h: setattr(m.s, "grad", h.detach()[0].clone()) or h * m.s)),
    ("a view of a parameter or input kept past the backward", _h(lambda m, h: setattr(m, "kept", m.a.weight.t()) or h)),
    ("a write into a value that has views", _h(lambda m, h: _written_with_a_view(h))),
    ("torch.autograd.grad", _h(lambda m, h: h + torch.autograd.grad(m.b(h).sum(), h, create_graph=True)[0])),
    ("a value that requires grad kept past the backward, outside the loss's graph",
     _h(lambda m, h: setattr(m, "kept", h * 3) or h.detach())),
    ("an eager tensor that requires grad", _eager_weight),
    ("an eager tensor on another device", _h(lambda m, h: torch.empty(6, device="meta").copy_(h[0]).is_meta and h)),
    ("no meta kernel: Tensor.__getitem__", _h(lambda m, h: h + h[h > 0].sum())),
    ("grad_fn", _h(lambda m, h: h if h.grad_fn is not None else -h)),
    ("grad", _h(lambda m, h: h if h.grad is None else -h)),
    ("a .grad written", _h(_set("grad", lambda h: torch.zeros(5, 6)))),
    ("retain_grad", _h(lambda m, h: h.retain_grad() or h)),
    ("requires_grad_", _h(lambda m, h: h.detach().requires_grad_())),
    ("requires_grad written", _h(lambda m, h: setattr(m.s, "requires_grad", True) or h * m.s)),
    (".data written", _h(_set("data", lambda h: h.data * 2))),
    ("a write into a tensor the step did not make", _h(lambda m, h: _without_grad(lambda: m.s.mul_(0.9)) * h)),
    ("a value read before mark_step in a forward that wrote an input", _h(lambda m, h: h * float(m.n.add_(1).sum()))),
    ("a read of an input the forward wrote", _h(lambda m, h: m.n.add_(1).data_ptr() and h + m.n)),
]
_STEPS = [
    ("backward of a value the segment did not make", _backward_outside_the_segment),
    ("an input with autograd history", _history),
    ("a value that requires grad kept past mark_step", _no_backward),
    # an input written, and a view of it made before the forward (a second input on its storage) read
    ("a write into an input whose storage another input shares",
     _view_before(lambda m, h, view: h * m.n.add_(1) + view.sum())),
    ("a write into an input whose storage another input shares",
     _view_before(lambda m, h, view: h * view.sum() + m.n.add_(1))),
]


def _under_a_mode(fn):
    with _Counting():
        return fn()


def _written_with_a_view(h):
    v = h[:, :3]
    h.mul_(2)
    return h + v.sum(dim=1, keepdim=True)


def _in_a_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.parametrize("reason,step", [(r, _step_of(f)) for r, f in _DEMOTIONS] + _STEPS,
                         ids=[r for r, _ in _DEMOTIONS + _STEPS])
def test_each_cause_of_demotion_is_counted_and_the_step_equals_eager(reason, step, fast_recording,
                                                                     replayed_eagerly) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, lazy_losses, ref, model = _train(
            _Two, lambda m, x, y: step(m, x), steps=3, batch=lambda g: (torch.randn(5, 4, generator=g), None),
            opt=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))
    _assert_same(ref, model, losses, lazy_losses)
    assert not [w.message for w in caught if "pydisc" in str(w.message)]    # (planned, not run eagerly instead)
    for name in ("w", "carry"):
        if name in ref.__dict__:
            a, b = ref.__dict__[name], model.__dict__[name]
            torch.testing.assert_close((b.grad if a.grad is not None else b).cpu(), a.grad if a.grad is not None else a)
    assert pydisc.metrics()["fast_demotions"].get(reason, 0) >= 1, pydisc.metrics()["fast_demotions"]


@pytest.mark.parametrize("flag", [(), (True,)], ids=["default", "true"])
def test_requires_grad_asked_of_a_value_that_requires_it_does_not_demote(flag, fast_recording,
                                                                         replayed_eagerly) -> None:
    """`h.requires_grad_()` on a value of the forward that requires grad already is eager's no-op (HF's
    `enable_input_require_grads`, which `gradient_checkpointing_enable()` turns on, hooks the embeddings
    so): it demoted every such model to the dispatcher."""
    step = _step_of(_h(lambda m, h: h.requires_grad_(*flag) * 2))
    losses, lazy_losses, ref, model = _train(
        _Two, lambda m, x, y: step(m, x), steps=3, batch=lambda g: (torch.randn(5, 4, generator=g), None),
        opt=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {} and m["fast_segments"] == 3


@pytest.mark.cuda
def test_autocast_of_another_device_demotes(fast_recording, replayed_eagerly) -> None:
    def forward(m, x):
        with torch.autocast("cuda", dtype=torch.float16):
            return m.b(m.a(x))

    losses, lazy_losses, ref, model = _train(
        _Two, lambda m, x, y: _step_of(forward)(m, x), steps=2,
        batch=lambda g: (torch.randn(5, 4, generator=g), None))
    _assert_same(ref, model, losses, lazy_losses)
    assert pydisc.metrics()["fast_demotions"].get("autocast on another device", 0) >= 1


@pytest.mark.parametrize("reason,forward,error", [
    ("backward of a value eager refuses", lambda m, x: m(x, lambda m, x: m.b(m.a(x))), "implicitly created"),
    ("backward of a value eager refuses", lambda m, x: m(x, lambda m, x: m.b(m.a(x))).sum().detach(), "does not require grad"),
], ids=["not-a-scalar", "no-grad"])
def test_a_backward_eager_refuses_raises_eagers_error(reason, forward, error, fast_recording, replayed_eagerly) -> None:
    torch.manual_seed(0)
    ref = _Two()
    model = pydisc.lazy(copy.deepcopy(ref))
    x = torch.randn(5, 4)
    for m in (ref, model):
        with pytest.raises(RuntimeError, match=error):
            forward(m, x).backward()
    pydisc.mark_step()
    assert pydisc.metrics()["fast_demotions"].get(reason) == 1


def test_a_functorch_transform_inside_the_forward_is_an_error_then_op_by_op(fast_recording, replayed_eagerly) -> None:
    """`torch.vmap` inside a forward hands its ops to the dispatcher without the handler: their results would
    carry no gradient. The step raises, saying what to do; the model's next forwards record op by op and
    train as eager."""
    def forward(m, x):
        h = m.a(x)
        return m.b(torch.vmap(torch.mul)(h, h))

    torch.manual_seed(0)
    ref = _Two()
    model = pydisc.lazy(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="fast_record=False"):
        model(torch.randn(5, 4, generator=g), forward)
    pydisc.mark_step()
    assert pydisc.metrics()["fast_demotions"] == {"a functorch transform or a dispatch mode": 1}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for _ in range(2):
        x = torch.randn(5, 4, generator=g)
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            _step_of(forward)(m, x)
            opt.step()
        pydisc.mark_step()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
    assert pydisc.metrics()["fast_skipped"] == 2


def test_a_planning_failure_of_a_fused_step_records_op_by_op_from_then_on(fast_recording, monkeypatch) -> None:
    def fails(program, *args, **kwargs):
        exc = RuntimeError("injected")
        exc.pydisc_entry = next(i for i, e in enumerate(program.entries) if isinstance(e[0], fast.FusedStep))
        raise exc

    monkeypatch.setattr(plan, "functional_graph", fails)
    with pytest.warns(UserWarning, match="could not build a functional graph"):
        losses, lazy_losses, ref, model = _train(
            _Two, lambda m, x, y: _step_of(lambda m, x: m.b(m.a(x)))(m, x), steps=3,
            batch=lambda g: (torch.randn(5, 4, generator=g), None))
    _assert_same(ref, model, losses, lazy_losses)
    m = pydisc.metrics()
    assert m["fast_demotions"] == {"planning failed: RuntimeError": 1} and m["fast_segments"] == 1, m


# Causes tested by name in other tests (of this file, or "path::test"), and the checks no step can reach
# (None: what would reach them is refused earlier).
_TESTED_ELSEWHERE = {
    "tensor hooks": "test_what_the_fast_path_cannot_follow_is_demoted_and_equals_eager",
    "autograd.Function (%s)": "test_what_the_fast_path_cannot_follow_is_demoted_and_equals_eager",
    "backward with arguments": "test_what_the_fast_path_cannot_follow_is_demoted_and_equals_eager",
    "a value read before mark_step that depends on random numbers": "test_a_read_of_random_values_demotes_and_matches_the_step",
    "an in-place op that changes sizes": "test_sizes_read_after_an_in_place_view_op_are_eagers",
    "a value read before mark_step": "test_strict_mode_refuses_a_read_in_a_fast_forward",
    "backward of a value eager refuses": "test_a_backward_eager_refuses_raises_eagers_error",
    "planning failed: %s": "test_a_planning_failure_of_a_fused_step_records_op_by_op_from_then_on",
    "autocast on another device": "test_autocast_of_another_device_demotes",    # (on a CUDA machine)
    "the random generator's state read or set":
        "tests/frontend/test_random_state.py::test_the_generator_reseeded_or_rewound_mid_step_gives_eagers_numbers",
    "dynamic shapes: no template takes the fast step":
        "tests/driver/test_fast_match.py::test_a_fast_step_no_template_takes_goes_back_to_the_dispatcher",
    # a segment's values lose their ids when it ends (close, demote, abandon), and one is open at a time
    "a value of another segment": None,
    # no segment starts in a step with symbolic sizes, and a step's inputs are made before it starts
    "a symbolic size": None,
    # a device named in the call demotes first (`a move to another device`): the meta run's own check
    "a call that makes a tensor on another device": None,
}


def test_strict_mode_refuses_a_read_in_a_fast_forward(fast_recording, replayed_eagerly, monkeypatch) -> None:
    monkeypatch.setattr(CONFIG, "strict", True)
    model = pydisc.lazy(_Two())
    with pytest.raises(StrictModeError, match="read before mark_step"):
        model(torch.randn(5, 4), _h(lambda m, h: h * float(h.sum())))
    pydisc.mark_step()
    assert pydisc.metrics()["fast_demotions"] == {"a value read before mark_step": 1}


def _prefix(reason: str) -> str:
    return reason.split("%s")[0].rstrip(" :(")


def test_every_cause_of_demotion_has_a_test() -> None:
    """The reasons the sources give (`Demote(...)`, `demote(...)`, `refuse(...)` and the autograd calls the
    handler does not follow) are each triggered by a test above, or by the test `_TESTED_ELSEWHERE` names."""
    root = Path(pydisc.__file__).parent
    pattern = re.compile(r'(?:Demote|demote|refuse)\(\s*"([^"]+)"')
    found = set()
    for path in root.rglob("*.py"):
        found.update(pattern.findall(path.read_text()))
    found.update(reason for func, reason in fast._AUTOGRAD_STATE.items()
                 if func not in (fast._REQUIRES_GRAD, fast._IS_LEAF))     # (those two are answered, not demoted)
    found.add("a value that requires grad kept past mark_step")           # (the other arm of a conditional)
    tested = [_prefix(r) for r, _ in _DEMOTIONS + _STEPS] + [_prefix(r) for r in _TESTED_ELSEWHERE]
    # (a reason with a `%s` is covered by a test of any of its forms: "no meta kernel: Tensor.__getitem__")
    assert not sorted(r for r in found if not any(t.startswith(_prefix(r)) for t in tested))
    for reason, test in _TESTED_ELSEWHERE.items():
        if test is None:
            continue
        path, _, name = test.rpartition("::")
        if path:        # the test's own text, from its `def` to the next one
            text = (root.parent / path).read_text()
            start = text.index("def %s(" % name)
            source = text[start:text.find("\ndef ", start + 1)]
        else:           # (with its decorators, where its cases are)
            source = inspect.getsource(globals()[name])
        assert reason.split("%s")[0] in source, (reason, test)


def test_which_parameters_get_gradients_follows_requires_grad_changed_between_steps(fast_recording) -> None:
    """The same forward, its calls and their order unchanged, with a layer frozen for two steps and then
    trained again (as fine-tuning schedules unfreeze): the frozen layer's parameters get no gradient and
    keep their values, as in eager; the others train as eager does. (`Segment.leaves` is kept per calls
    and their recipes, which hold whether each argument requires grad.)"""
    def forward(m, x, y):
        step = len(forward.grads.setdefault(id(m), []))
        m.qkv.requires_grad_(step not in (2, 3))
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        grads = [None if p.grad is None else p.grad.detach().clone().cpu() for p in m.qkv.parameters()]
        forward.grads[id(m)].append(grads)
        return loss

    forward.grads = {}
    losses, lazy_losses, ref, model = _train(Block, forward, steps=6)
    _assert_same(ref, model, losses, lazy_losses)
    eager_grads, lazy_grads = forward.grads[id(ref)], forward.grads[id(model)]
    assert [[g is None for g in step] for step in lazy_grads] == [[g is None for g in step] for step in eager_grads]
    assert all(g is None for step in lazy_grads[2:4] for g in step)
    for step_e, step_l in zip(eager_grads, lazy_grads):
        for a, b in zip(step_e, step_l):
            if a is not None:
                torch.testing.assert_close(b, a)
    assert pydisc.metrics()["fast_demotions"] == {}
