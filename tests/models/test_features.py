"""Training features, each against eager PyTorch on a tiny model: optimizers, gradient clipping,
gradient accumulation, LR schedulers, autocast (+ GradScaler), dropout, weight tying, frozen parameters,
checkpoints. Losses and parameters must agree within float32 tolerances (looser for bf16/fp16).

The models reuse a few shapes so that the process-wide compile cache serves most tests."""
from __future__ import annotations

import collections
import copy
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])]
IN, HIDDEN, CLASSES, BATCH = 16, 32, 4, 8


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 20, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)]


@dataclass
class Trainee:
    """One copy of a model with what trains it."""
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: object = None
    scaler: object = None
    losses: list = field(default_factory=list)
    extras: list = field(default_factory=list)   # whatever a step wants to keep (gradient norms, ...)


def plain_step(t: Trainee, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(t.model(x), y)
    loss.backward()
    t.opt.step()
    t.opt.zero_grad()
    if t.sched is not None:
        t.sched.step()
    return loss


@dataclass
class SideBySide:
    eager: Trainee
    lazy: Trainee
    compiles: list[int]     # pydisc.metrics()["compiles"] after each step
    plans: list[int]        # graph_cache_misses (planned steps) after each step


def train_side_by_side(make_model: Callable[[], nn.Module], setup: Callable[[nn.Module], Trainee],
                       batches, step: Callable = plain_step, device: str = "cpu") -> SideBySide:
    if device == "cuda":   # compare against strict fp32, as IREE computes it
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    pydisc.reset_metrics()
    torch.manual_seed(0)
    eager_model = make_model().to(device)
    lazy_model = pydisc.lazy(copy.deepcopy(eager_model), device=device)
    eager, lazy = setup(eager_model), setup(lazy_model)
    compiles, plans = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        for t in (eager, lazy):
            t.losses.append(step(t, x, y))
        pydisc.mark_step()
        m = pydisc.metrics()
        compiles.append(m["compiles"])
        plans.append(m["graph_cache_misses"])
    return SideBySide(eager, lazy, compiles, plans)


def assert_losses_equal(run: SideBySide, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    eager = torch.tensor([float(v) for v in run.eager.losses])
    lazy = torch.tensor([float(v) for v in run.lazy.losses])
    torch.testing.assert_close(lazy, eager, rtol=rtol, atol=atol)


def assert_state_equal(eager: nn.Module, lazy: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    lazy_state = lazy.state_dict()
    assert lazy_state.keys() == eager.state_dict().keys()
    for name, e in eager.state_dict().items():
        torch.testing.assert_close(lazy_state[name].cpu(), e.cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m: name + ": " + m)


def with_optimizer(make_opt: Callable) -> Callable[[nn.Module], Trainee]:
    return lambda model: Trainee(model, make_opt(model.parameters()))


# ---- optimizers --------------------------------------------------------------------------------

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "sgd_momentum_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_no_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    # its step reads its per-parameter one-element `eta` and `mu`, then writes their next values
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=2, weight_decay=1e-3),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_eager(name: str, device: str) -> None:
    run = train_side_by_side(tiny_mlp, with_optimizer(OPTIMIZERS[name]), data(4), device=device)
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    for pe, pl in zip(run.eager.model.parameters(), run.lazy.model.parameters()):
        for key, value in run.eager.opt.state[pe].items():
            torch.testing.assert_close(run.lazy.opt.state[pl][key].cpu(), value.cpu(), rtol=1e-5, atol=1e-7)
    assert run.plans[-1] == run.plans[1], "steps after the second planned again: %s" % run.plans


# torch's other optimizers: no template, their steps recorded as torch runs them (RAdam's ops change with
# the step count until its variance estimate is trusted, so its steps plan again; not asserted here)
OTHER_OPTIMIZERS = {
    # (eps 1e-4: its centered variance is near 0 for some elements, where eps 1e-8 turns a parameter's
    # last-bit difference (a learning rate lifted into a step input is multiplied, then added, where
    # eager adds with `alpha`) into momentum that differs by 3e-2 after three steps)
    "rmsprop_centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, centered=True, momentum=0.5, eps=1e-4),
    "adadelta": lambda p: torch.optim.Adadelta(p),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
}


@pytest.mark.parametrize("name", list(OTHER_OPTIMIZERS))
def test_other_optimizers_match_eager(name: str) -> None:
    run = train_side_by_side(tiny_mlp, with_optimizer(OTHER_OPTIMIZERS[name]), data(4))
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    for pe, pl in zip(run.eager.model.parameters(), run.lazy.model.parameters()):
        for key, value in run.eager.opt.state[pe].items():     # (RMSprop's momentum: 3e-5 off, above)
            torch.testing.assert_close(run.lazy.opt.state[pl][key].cpu(), value.cpu(), rtol=1e-4, atol=1e-4)


def test_lbfgs_with_a_closure_matches_eager() -> None:
    """LBFGS calls the closure (forward and backward) several times within one step and reads the loss
    and the gradients' norms as Python numbers between them."""
    def lbfgs_step(t: Trainee, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def closure():
            t.opt.zero_grad()
            loss = F.cross_entropy(t.model(x), y)
            loss.backward()
            return loss
        return t.opt.step(closure)

    make = lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3, history_size=3)  # noqa: E731
    run = train_side_by_side(tiny_mlp, with_optimizer(make), data(2), step=lbfgs_step)
    # (quasi-Newton steps turn rounding differences of 1e-7 into ~1e-5)
    assert_losses_equal(run, rtol=1e-4, atol=1e-4)
    assert_state_equal(run.eager.model, run.lazy.model, rtol=1e-3, atol=1e-4)


GRADS_AFTER_STEP = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_nesterov_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "adam_weight_decay": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    "adagrad_weight_decay": lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=0.1),
    "adamax_maximize": lambda p: torch.optim.Adamax(p, lr=1e-2, maximize=True),
}


@pytest.mark.parametrize("name", list(GRADS_AFTER_STEP))
def test_gradients_read_after_the_optimizer_step_are_eagers(name: str) -> None:
    """pydisc runs a lazy group's step with torch's foreach implementation where eager's CPU default is the
    per-parameter loop; where the two differ in what they write besides parameters and state (SGD with
    Nesterov momentum adds the momentum into `.grad` in its foreach form), `.grad` read after `step()`
    must still be eager's."""
    def step(t: Trainee, x, y):
        loss = F.cross_entropy(t.model(x), y)
        loss.backward()
        t.opt.step()
        t.extras.append([p.grad.clone() for p in t.model.parameters()])
        t.opt.zero_grad()
        return loss

    run = train_side_by_side(tiny_mlp, with_optimizer(GRADS_AFTER_STEP[name]), data(3), step)
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    for grads_e, grads_l in zip(run.eager.extras, run.lazy.extras):
        for ge, gl in zip(grads_e, grads_l):
            torch.testing.assert_close(gl.cpu(), ge, rtol=1e-5, atol=1e-7)


# ---- gradient clipping -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", [True, False])
def test_clip_grad_norm_matches_eager(foreach: bool, device: str) -> None:
    def step(t: Trainee, x, y):
        loss = F.cross_entropy(t.model(x), y)
        loss.backward()
        # max_norm far below the gradients' norm, so clipping scales every step
        t.extras.append(torch.nn.utils.clip_grad_norm_(t.model.parameters(), max_norm=0.05, foreach=foreach))
        t.opt.step()
        t.opt.zero_grad()
        return loss

    run = train_side_by_side(tiny_mlp, with_optimizer(OPTIMIZERS["sgd_momentum_nesterov"]), data(4), step, device)
    assert_losses_equal(run)
    norms_e = torch.stack([n.cpu() for n in run.eager.extras])
    norms_l = torch.stack([n.cpu() for n in run.lazy.extras])
    assert (norms_e > 0.05).all(), "the test must clip: %s" % norms_e
    torch.testing.assert_close(norms_l, norms_e, rtol=1e-5, atol=1e-6)
    assert_state_equal(run.eager.model, run.lazy.model)


# ---- gradient accumulation ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_over_micro_batches(device: str) -> None:
    micro = 3

    def step(t: Trainee, x, y):
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):   # uneven chunks: 3, 3, 2 rows
            loss = F.cross_entropy(t.model(xs), ys) / micro
            loss.backward()
            total = total + loss.detach()
        t.opt.step()
        t.opt.zero_grad()
        return total

    run = train_side_by_side(tiny_mlp, with_optimizer(OPTIMIZERS["adamw"]), data(4), step, device)
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    assert run.plans[-1] == run.plans[1]


# ---- LR schedulers -----------------------------------------------------------------------------

SCHEDULERS = {
    "step_lr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-4),
    # OneCycleLR also cycles SGD's momentum every step
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler_matches_eager_without_recompiling(name: str) -> None:
    def setup(model):
        opt = OPTIMIZERS["sgd_momentum_nesterov"](model.parameters())
        return Trainee(model, opt, SCHEDULERS[name](opt))

    run = train_side_by_side(tiny_mlp, setup, data(5))
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    assert run.eager.opt.param_groups[0]["lr"] == run.lazy.opt.param_groups[0]["lr"]
    assert run.compiles[-1] == run.compiles[1], "compiles kept growing after step 2: %s" % run.compiles
    assert run.plans[-1] == run.plans[1], "planned again after step 2: %s" % run.plans


def test_one_cycle_adam_betas_do_not_recompile() -> None:
    # OneCycleLR cycles Adam's beta1 too: a Python float that changes every step
    def setup(model):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Trainee(model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6))

    run = train_side_by_side(tiny_mlp, setup, data(5))
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, run.lazy.model)
    assert run.plans[-1] == run.plans[1], "planned again after step 2: %s" % run.plans


# ---- autocast and GradScaler -------------------------------------------------------------------

def test_autocast_bfloat16_matches_eager_autocast() -> None:
    def step(t: Trainee, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = t.model(x)
            assert logits.dtype == torch.bfloat16
            loss = F.cross_entropy(logits, y)    # autocast runs it in float32
        loss.backward()
        t.opt.step()
        t.opt.zero_grad()
        return loss

    run = train_side_by_side(tiny_mlp, with_optimizer(OPTIMIZERS["sgd_momentum_nesterov"]), data(4), step)
    # bf16 keeps 8 bits of mantissa: a relative error of ~4e-3 per rounding, a few roundings deep
    assert_losses_equal(run, rtol=2e-2, atol=1e-2)
    assert_state_equal(run.eager.model, run.lazy.model, rtol=2e-2, atol=5e-3)
    for p in run.lazy.model.parameters():
        assert p.dtype == torch.float32


def test_autocast_float16_with_grad_scaler_skips_the_step_with_an_inf() -> None:
    inf_step = 2
    init_scale = 2.0 ** 10

    def setup(model):
        return Trainee(model, OPTIMIZERS["sgd_momentum_nesterov"](model.parameters()),
                       scaler=torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=100))

    def step(t: Trainee, x, y):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(t.model(x), y)
        t.scaler.scale(loss).backward()
        if len(t.losses) == inf_step:
            next(t.model.parameters()).grad.add_(float("inf"))    # an overflow in one gradient
        t.scaler.step(t.opt)          # reads found_inf (.item()): runs the part of the step it needs
        t.scaler.update()
        t.opt.zero_grad()
        t.extras.append(t.scaler.get_scale())
        return loss

    run = train_side_by_side(tiny_mlp, setup, data(4), step)
    assert_losses_equal(run, rtol=2e-2, atol=1e-2)
    assert_state_equal(run.eager.model, run.lazy.model, rtol=2e-2, atol=5e-3)
    expected = [init_scale, init_scale, init_scale / 2, init_scale / 2]
    assert run.eager.extras == expected
    assert run.lazy.extras == expected


def test_grad_scaler_skipped_step_leaves_parameters_unchanged() -> None:
    torch.manual_seed(0)
    model = pydisc.lazy(tiny_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    (x, y), = data(1)
    for inject in (False, True):
        before = [p.detach().cpu() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if inject:
            model[2].bias.grad.add_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        pydisc.mark_step()
        changed = [not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters())]
        assert all(changed) if not inject else not any(changed), (inject, changed)
    assert scaler.get_scale() == 2.0 ** 9


# ---- dropout -----------------------------------------------------------------------------------

def _lazy_dropout(seed: int, n: int, p: float) -> torch.Tensor:
    torch.manual_seed(seed)
    out = F.dropout(pydisc.to_lazy(torch.ones(n)), p=p, training=True) * 1.0
    pydisc.mark_step()
    return out.cpu()


def test_dropout_is_reproducible_with_the_same_seed() -> None:
    a, b, c = _lazy_dropout(7, 4096, 0.5), _lazy_dropout(7, 4096, 0.5), _lazy_dropout(8, 4096, 0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_and_scale(p: float) -> None:
    n = 1_000_000
    out = _lazy_dropout(0, n, p)
    kept = out != 0
    rate = kept.double().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma, rate
    torch.testing.assert_close(out[kept], torch.full((int(kept.sum()),), 1 / (1 - p)))


def test_dropout_in_training_gives_independent_masks_per_step() -> None:
    torch.manual_seed(0)
    model = pydisc.lazy(nn.Sequential(nn.Linear(IN, HIDDEN), nn.Dropout(0.5)))
    x = torch.randn(BATCH, IN)
    outs = []
    for _ in range(2):
        outs.append(model(x))
        pydisc.mark_step()
    zero_a, zero_b = outs[0].cpu() == 0, outs[1].cpu() == 0
    assert not torch.equal(zero_a, zero_b)
    model.eval()
    with torch.no_grad():
        out = model(x)
    pydisc.mark_step()
    assert (out.cpu() != 0).all()


# ---- weight tying, frozen parameters -----------------------------------------------------------

def test_weight_tying_trains_like_eager() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 20, (BATCH, 5), generator=g), torch.randint(0, 20, (BATCH * 5,), generator=g))
               for _ in range(4)]

    def step(t: Trainee, ids, targets):
        loss = F.cross_entropy(t.model(ids).flatten(0, 1), targets)
        loss.backward()
        t.opt.step()
        t.opt.zero_grad()
        return loss

    run = train_side_by_side(TiedLM, with_optimizer(OPTIMIZERS["adamw"]), batches, step)
    lazy = run.lazy.model
    assert lazy.head.weight is lazy.emb.weight
    assert len(list(lazy.parameters())) == 3          # emb/head weight once, mix weight and bias
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, lazy)


def _train_like_eager(eager: nn.Module, lazy: nn.Module, optimizer: str, steps: int) -> None:
    """Train both side by side with `optimizer` ("sgd" with momentum, "adam") on the same batches: losses,
    parameters and buffers equal."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(BATCH, IN, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
               for _ in range(steps)]
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)}[optimizer]
    trainees = [Trainee(m, make(m)) for m in (eager, lazy)]
    for x, y in batches:
        for t in trainees:
            t.losses.append(plain_step(t, x, y))
        pydisc.mark_step()
    assert_losses_equal(SideBySide(trainees[0], trainees[1], [], []))
    assert_state_equal(eager, lazy)


class _SharedMemory(nn.Module):
    """Two Parameter objects over one memory (`nn.Parameter(t)` twice; `b.data = a.data` gives the same),
    and a buffer that views part of it: an optimizer's update of one is seen by the other in eager."""

    def __init__(self) -> None:
        super().__init__()
        t = torch.randn(IN, IN)
        self.a, self.b = nn.Parameter(t), nn.Parameter(t)
        self.register_buffer("row", t[0])
        self.out = nn.Linear(IN, 3)

    def forward(self, x):
        return self.out(torch.tanh(x @ self.a) + (x @ self.b) * 0.5 + self.row)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "dispatch"])
def test_parameters_that_share_memory_train_like_eager(optimizer: str, fast: bool) -> None:
    """lazy() gave each of two tensors over one memory a storage of its own, so a step's update of one
    did not reach the other: losses 2.5e-2 off eager's from the second step on."""
    torch.manual_seed(0)
    eager = _SharedMemory()
    torch.manual_seed(0)
    lazy = pydisc.lazy(_SharedMemory(), fast_record=fast)
    _train_like_eager(eager, lazy, optimizer, steps=4)
    assert torch.equal(lazy.a.cpu(), lazy.b.cpu()) and torch.equal(lazy.row.cpu(), lazy.a.cpu()[0])


class _Halves(nn.Module):
    """Two submodules whose parameters are distinct objects over one memory (`second.weight` made of
    `first.weight.data`), with a buffer of the second viewing a row of it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(IN, IN), nn.Linear(IN, IN)
        self.second.weight = nn.Parameter(self.first.weight.data)
        self.second.register_buffer("row", self.first.weight.data[1])
        self.out = nn.Linear(IN, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.second(self.first(x))) + self.second.row)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "dispatch"])
def test_parameters_that_share_memory_made_lazy_by_separate_calls_train_like_eager(optimizer: str,
                                                                                  fast: bool) -> None:
    """Separate `lazy()` calls (one per submodule) gave tensors over one memory storages of their own:
    the optimizer's update of one never reached the other, losses 1.7e-2 off eager's from the second step on."""
    torch.manual_seed(0)
    eager = _Halves()
    torch.manual_seed(0)
    lazy = _Halves()
    for m in (lazy.first, lazy.second, lazy.out):
        pydisc.lazy(m, fast_record=fast)
    _train_like_eager(eager, lazy, optimizer, steps=5)
    assert lazy.first.weight._storage is lazy.second.weight._storage is lazy.second.row._storage
    assert torch.equal(lazy.second.row.cpu(), lazy.first.weight.cpu()[1])


@pytest.mark.parametrize("eager_steps", [0, 2])
def test_optimizer_and_hooks_built_before_lazy_keep_working(eager_steps: int) -> None:
    """`lazy()` converts the Parameter objects in place: an optimizer (and its state after eager steps),
    tensor hooks and attributes made before it see the lazy parameters; training matches eager."""
    torch.manual_seed(0)
    eager_model = tiny_mlp()
    lazy_model = copy.deepcopy(eager_model)
    trainees = [Trainee(m, torch.optim.Adam(m.parameters(), lr=1e-2)) for m in (eager_model, lazy_model)]
    held = [list(m.parameters()) for m in (eager_model, lazy_model)]
    seen: list[list[str]] = [[], []]
    removed = []
    for k, m in enumerate((eager_model, lazy_model)):
        m[0].weight.register_hook(lambda g, k=k: seen[k].append("grad"))
        m[2].bias.register_post_accumulate_grad_hook(lambda p, k=k: seen[k].append("accumulated"))
        removed.append(m[4].weight.register_hook(lambda g, k=k: seen[k].append("removed")))
        m[0].weight.tag = "mine"
    batches = data(eager_steps + 3)
    for x, y in batches[:eager_steps]:
        for t in trainees:
            t.losses.append(plain_step(t, x, y))
    pydisc.lazy(lazy_model)
    for handle in removed:                          # handles made before lazy() still remove their hook
        handle.remove()
    assert all(a is b for a, b in zip(lazy_model.parameters(), held[1], strict=True))
    assert pydisc.is_lazy(lazy_model[0].weight) and lazy_model[0].weight.tag == "mine"
    executions = pydisc.metrics()["executions"]
    for x, y in batches[eager_steps:]:
        for t in trainees:
            t.losses.append(plain_step(t, x, y))
        pydisc.mark_step()
    assert pydisc.metrics()["executions"] > executions
    run = SideBySide(trainees[0], trainees[1], [], [])
    assert_losses_equal(run)
    assert_state_equal(eager_model, lazy_model)
    assert seen[1] == seen[0] and seen[0].count("grad") == len(batches)


def test_optimizer_of_parameters_lazy_could_not_keep_raises() -> None:
    """Where torch refuses to convert a parameter in place (a weak reference to it), lazy() warns, and an
    optimizer built before it stops at its first step instead of training the old tensors."""
    import weakref

    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher = weakref.ref(model[0].weight)
    with pytest.warns(pydisc.PydiscWarning, match="could not convert a parameter"):
        pydisc.lazy(model)
    x, y = data(1)[0]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="Build the optimizer after pydisc.lazy"):
        opt.step()
    pydisc.mark_step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()    # one built after lazy() steps
    pydisc.mark_step()
    assert watcher() is not None


def test_frozen_parameters_stay_frozen() -> None:
    def make():
        model = tiny_mlp()
        model[0].requires_grad_(False)
        return model

    run = train_side_by_side(make, with_optimizer(OPTIMIZERS["adamw"]), data(4))
    torch.manual_seed(0)
    initial = tiny_mlp()[0]
    lazy = run.lazy.model
    assert not lazy[0].weight.requires_grad and lazy[0].weight.grad is None
    torch.testing.assert_close(lazy[0].weight.cpu(), initial.weight, rtol=0, atol=0)
    torch.testing.assert_close(lazy[0].bias.cpu(), initial.bias, rtol=0, atol=0)
    assert_losses_equal(run)
    assert_state_equal(run.eager.model, lazy)


# ---- checkpoints -------------------------------------------------------------------------------

def test_checkpoint_mid_training_continues_like_eager(tmp_path) -> None:
    def setup(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        return Trainee(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))

    run = train_side_by_side(tiny_mlp, setup, data(2))
    for kind, t in (("eager", run.eager), ("lazy", run.lazy)):
        torch.save({"model": t.model.state_dict(), "opt": t.opt.state_dict(), "sched": t.sched.state_dict()},
                   tmp_path / ("%s.pt" % kind))

    resumed = {}
    for kind in ("eager", "lazy"):
        ckpt = torch.load(tmp_path / ("%s.pt" % kind))
        torch.manual_seed(123)                       # other weights, overwritten by the checkpoint
        model = tiny_mlp()
        if kind == "lazy":
            model = pydisc.lazy(model)
        model.load_state_dict(ckpt["model"])
        t = setup(model)
        t.opt.load_state_dict(ckpt["opt"])
        t.sched.load_state_dict(ckpt["sched"])
        resumed[kind] = t
    # the lazy checkpoint holds the same numbers as the eager one, loadable by plain PyTorch
    eager_ckpt, lazy_ckpt = torch.load(tmp_path / "eager.pt"), torch.load(tmp_path / "lazy.pt")
    for name, value in eager_ckpt["model"].items():
        torch.testing.assert_close(lazy_ckpt["model"][name].cpu(), value, rtol=1e-5, atol=1e-6)

    # continue the uninterrupted runs and the resumed ones on the same batches
    for x, y in data(3, seed=5):
        for t in (run.eager, run.lazy, resumed["eager"], resumed["lazy"]):
            t.losses.append(plain_step(t, x, y))
        pydisc.mark_step()
    tail = lambda t: torch.tensor([float(v) for v in t.losses[-3:]])  # noqa: E731
    torch.testing.assert_close(tail(resumed["eager"]), tail(run.eager), rtol=0, atol=0)
    torch.testing.assert_close(tail(resumed["lazy"]), tail(run.eager), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tail(resumed["lazy"]), tail(run.lazy), rtol=1e-6, atol=1e-7)
    assert_state_equal(resumed["eager"].model, resumed["lazy"].model)
    assert_state_equal(run.lazy.model, resumed["lazy"].model)
    assert resumed["lazy"].opt.param_groups[0]["lr"] == run.eager.opt.param_groups[0]["lr"]


# ---- bugs found by these tests (minimal repros) ------------------------------------------------

def test_slices_of_one_eager_tensor_reuse_the_plan() -> None:
    model = pydisc.lazy(nn.Linear(IN, CLASSES))
    dataset = torch.randn(4 * BATCH, IN)
    pydisc.reset_metrics()
    with torch.no_grad():
        for i in range(4):
            model(dataset[i * BATCH:(i + 1) * BATCH])   # same shape, offsets 0, 8, 16, 24
            pydisc.mark_step()
    assert pydisc.metrics()["graph_cache_misses"] == 1      # today: 4, one plan per offset


class _WritesItsFirstInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, 3)

    def forward(self, a, b, scale=None):
        a.mul_(2)
        out = self.lin(a + b)
        return out if scale is None else out * scale


@pytest.mark.parametrize("call", ["positional", "keyword"])
def test_an_input_passed_twice_is_one_tensor_in_the_step_as_in_eager(call: str) -> None:
    """A forward that writes one input in place changes the other where both are the same tensor. Each
    argument had a lazy storage of its own: `m(x, x)` computed `2x + x`."""
    torch.manual_seed(0)
    eager = _WritesItsFirstInput()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    for step in range(3):
        for model in (eager, lazy):
            torch.manual_seed(step)
            x, scale = torch.randn(BATCH, IN), torch.randn(3)
            with torch.no_grad():
                out = model(x, x) if call == "positional" else model(x, b=x, scale=scale)
            pydisc.mark_step()
            if model is eager:
                want, want_x = out, x
        torch.testing.assert_close(out.cpu(), want)
        torch.testing.assert_close(x, want_x)
    assert pydisc.metrics()["executions"] > 0


def test_the_same_input_twice_gets_the_gradient_of_both_uses() -> None:
    torch.manual_seed(0)
    model = nn.Bilinear(IN, IN, 3)
    lazy = pydisc.lazy(copy.deepcopy(model))
    x = torch.randn(BATCH, IN, requires_grad=True)
    x_lazy = x.detach().clone().requires_grad_(True)
    model(x, x).square().sum().backward()
    lazy(x_lazy, x_lazy).square().sum().backward()
    pydisc.mark_step()
    torch.testing.assert_close(x_lazy.grad, x.grad)


def test_containers_passed_to_a_lazy_module_keep_their_types() -> None:
    """The input hook makes the tensors inside a module's arguments lazy: the containers around them
    keep their types (it made every dict plain, and HF T5's generate then failed on
    `encoder_outputs[0]`), and a container with nothing to convert is passed as it is."""
    Pair = collections.namedtuple("Pair", "a b")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, pair, ordered, default, plain, untouched):
            assert type(pair) is Pair and type(ordered) is collections.OrderedDict
            assert type(default) is collections.defaultdict and default["missing"] == []
            assert list(ordered) == ["z", "a"] and type(plain) is dict
            untouched.append("seen")                      # the caller's own list, as in eager
            return self.lin(pair.a + pair.b + ordered["z"] + default["x"] + plain["p"])

    eager = Model()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    outs, lists = [], []
    for m in (eager, lazy):
        untouched = ["a string"]
        default = collections.defaultdict(list, x=x * 3)
        outs.append(m(Pair(x, x * 2), collections.OrderedDict(z=x, a=1), default, {"p": x}, untouched))
        lists.append(untouched)
    pydisc.mark_step()
    torch.testing.assert_close(outs[1].cpu(), outs[0])
    assert lists[0] == lists[1] == ["a string", "seen"]


# The two repros below (fixed in 23e81cb) run in a fresh interpreter: should they regress, a failed
# step that stays recorded would fail every later test of the session instead of just these.

def _run_isolated(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_eager_input_modified_after_its_consumer_already_ran() -> None:
    _run_isolated("""
        import torch, pydisc
        scale = torch.ones(())
        a = pydisc.to_lazy(torch.ones(3)) * scale     # a lazy op reads the eager tensor
        b = pydisc.to_lazy(torch.ones(3)) + 1         # an unrelated pending op
        assert a.sum().item() == 3.0                  # partial run: what `a` needs; `b` stays pending
        scale.add_(1)                                 # nothing pending reads `scale` any more
        pydisc.mark_step()                            # RuntimeError: eager tensor modified in place
        assert b.cpu().tolist() == [2.0, 2.0, 2.0]
    """)


def test_failed_step_does_not_poison_later_steps() -> None:
    _run_isolated("""
        import torch, pydisc
        x = torch.ones(3)
        a = pydisc.to_lazy(torch.ones(3)) * x
        x.add_(1)
        try:
            pydisc.mark_step()
            raise AssertionError("expected the in-place check to refuse the step")
        except RuntimeError as e:
            assert "modified in place" in str(e)
        del a
        y = pydisc.to_lazy(torch.ones(2)) + 1
        pydisc.mark_step()                            # raises the same RuntimeError again
        assert y.cpu().tolist() == [2.0, 2.0]
    """)


@pytest.mark.parametrize("fast", [False, True], ids=["dispatch", "fast"])
def test_inputs_that_require_grad_get_eager_gradients(fast: bool) -> None:
    """A step input that requires grad gets the gradient eager's backward gives it: a leaf (saliency,
    adversarial inputs) in its `.grad`, a value an eager module made on through that module's graph;
    a lazy module without parameters then still has an output that requires grad."""
    torch.manual_seed(0)
    front, model = nn.Linear(IN, IN), tiny_mlp()
    lazy_front, lazy_model = copy.deepcopy(front), pydisc.lazy(copy.deepcopy(model), fast_record=fast)
    act = pydisc.lazy(nn.Tanh(), fast_record=fast)
    for x, y in data(3):
        x, x_lazy = x.clone().requires_grad_(), x.clone().requires_grad_()
        F.cross_entropy(model(front(x)), y).backward()
        F.cross_entropy(lazy_model(lazy_front(x_lazy)), y).backward()
        torch.tanh(x).sum().backward()
        out = act(x_lazy)
        assert out.requires_grad
        out.sum().backward()
        assert x_lazy.grad is None        # handed on at mark_step
        pydisc.mark_step()
        torch.testing.assert_close(x_lazy.grad, x.grad)
        for p, q in zip(front.parameters(), lazy_front.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
    for p, q in zip(model.parameters(), lazy_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


@pytest.mark.parametrize("compile_after", [1, 2], ids=["planned", "default"])
@pytest.mark.parametrize("fast", [False, True], ids=["dispatch", "fast"])
def test_values_read_between_backward_and_mark_step_are_eagers(fast: bool, compile_after: int,
                                                               monkeypatch) -> None:
    """Logging inside the step: the loss read after `backward()`, a gradient and a parameter after
    `opt.step()`, all before `mark_step()`, as eager gives them, and training goes on as eager; with the
    default PYDISC_COMPILE_AFTER too, where a new step graph first runs in torch (the tests' default
    plans at once). A read runs the pending step from inside a `__torch_dispatch__`, where torch has
    switched autograd off, and the fast recorder's forward is differentiated in that run: it raised
    "element 0 of tensors does not require grad" on the first step of every such loop."""
    from pydisc.config import CONFIG
    from pydisc.driver.step import clear_plans

    monkeypatch.setattr(CONFIG, "compile_after", compile_after)
    clear_plans()       # no plan of an earlier test for this graph: its first run is the subject
    torch.manual_seed(0)
    model = tiny_mlp()
    lazy = pydisc.lazy(copy.deepcopy(model), fast_record=fast)
    opt, lazy_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, lazy))
    for x, y in data(4):
        seen = []
        for m, o in ((model, opt), (lazy, lazy_opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            got = [loss.item(), float(m[0].weight.grad.abs().sum())]
            o.step()
            got.append(m[0].bias.detach().clone().cpu())
            if m is lazy:
                pydisc.mark_step()
            seen.append(got)
        (loss, grad, bias), (lazy_loss, lazy_grad, lazy_bias) = seen
        assert lazy_loss == pytest.approx(loss, rel=1e-5) and lazy_grad == pytest.approx(grad, rel=1e-5)
        torch.testing.assert_close(lazy_bias, bias)
    for p, q in zip(model.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)
