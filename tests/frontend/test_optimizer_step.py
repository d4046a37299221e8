"""Optimizer steps recorded from a template (frontend/optimizer_step.py): a step whose forward was recorded
fast records, without running torch's step, the very entries and floats torch's step records; the steps
it does not take run torch's step; both train as eager does."""
from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.config import CONFIG
from pydisc.driver import dynamic
from pydisc.frontend import fast, optimizer_step
from pydisc.frontend.lazy_tensor import RECORDER
from pydisc.metrics import METRICS


@pytest.fixture
def fast_recording():
    previous = fast.FAST.default
    fast.install()
    METRICS.reset()
    dynamic.clear()
    yield
    fast.uninstall()
    fast.set_default(previous)


@pytest.fixture
def replayed_eagerly(monkeypatch):
    """Recording is the subject: steps replay in torch at mark_step (PYDISC_DISABLE), not through IREE."""
    monkeypatch.setattr(CONFIG, "disable", True)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _one_cycle(opt):
    # cycles the learning rate and, with it, SGD's momentum or Adam's beta1 at every step
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)


OPTIMIZERS = {
    "sgd-momentum-steplr": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                            lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7)),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1), None),
    "sgd-nesterov-decay": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), None),
    "sgd-maximize-dampening": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.8, dampening=0.1, maximize=True,
                                                         weight_decay=0.1), None),
    "sgd-one-cycle": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), _one_cycle),
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2), None),
    "adam-decay-maximize": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, maximize=True), None),
    "adamw-amsgrad": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01, amsgrad=True), None),
    "adamw-one-cycle": (lambda p: torch.optim.AdamW(p, lr=1e-2), _one_cycle),
}


def _record(make_opt, make_schedule, stamp: bool, steps: int = 6):
    """Train a lazy MLP `steps` steps; per step its trace's structural key and lifted floats, then the
    parameters, the optimizer's state and how many steps were stamped."""
    gc.collect()
    METRICS.reset()
    dynamic.clear()     # (the first run's input sizes would make the second's first step another)
    torch.manual_seed(0)
    model = pydisc.lazy(_mlp())
    opt = make_opt(model.parameters())
    schedule = make_schedule(opt) if make_schedule else None
    g = torch.Generator().manual_seed(1)
    traces = []
    recordable = optimizer_step._recordable
    if not stamp:
        optimizer_step._recordable = lambda: False
    try:
        for _ in range(steps):
            x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if schedule is not None:
                schedule.step()
            trace = RECORDER.trace
            traces.append((trace.structure_key(()), list(trace.scalars)))
            pydisc.mark_step()
    finally:
        optimizer_step._recordable = recordable
    state = [[v.detach().clone() for v in s.values()] for s in opt.state.values()]
    return traces, [p.detach().clone() for p in model.parameters()], state, METRICS.optimizer_steps_stamped


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_stamped_step_records_what_torchs_step_records(name, fast_recording, replayed_eagerly) -> None:
    make_opt, make_schedule = OPTIMIZERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # an LR scheduler's "optimizer.step() overridden" among them
        traces, params, state, stamped = _record(make_opt, make_schedule, stamp=True)
    ref_traces, ref_params, ref_state, ref_stamped = _record(make_opt, make_schedule, stamp=False)
    # torch's step records the first step (state made) and the second (the template); the rest are stamped
    assert ref_stamped == 0 and stamped >= 4, stamped
    # (from the second step: the first steps of the two runs are torch's alike, and the first step a
    # process records puts its inputs in another order)
    for k, (got, want) in enumerate(zip(traces, ref_traces)):
        if k == 0:
            continue
        assert got[0] == want[0], "step %d: other entries than torch's step records" % k
        assert got[1] == want[1], "step %d: other floats than torch's step lifts" % k
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    for a, b in zip(state, ref_state):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def _train_against_eager(make_opt, interfere, steps: int = 5, device: str = "cpu"):
    """A lazy MLP and an eager copy trained side by side; `interfere(opt, k)` before each step's `step()`
    (for both). Returns the stamped count per step, and the plans made for the steps (before the
    comparison at the end, whose reads are steps of their own)."""
    torch.manual_seed(0)
    ref = _mlp().to(device)
    model = pydisc.lazy(copy.deepcopy(ref))
    o_ref, o = make_opt(ref.parameters()), make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    counts = []
    for k in range(steps):
        x, y = torch.randn(5, 6, generator=g).to(device), torch.randint(0, 3, (5,), generator=g).to(device)
        for m, opt in ((ref, o_ref), (model, o)):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            closure = interfere(opt, k)
            opt.step(closure) if closure is not None else opt.step()
        counts.append(METRICS.optimizer_steps_stamped)
        pydisc.mark_step()
    pydisc.synchronize()
    planned = METRICS.graph_cache_misses
    tol = 1e-6 if device == "cpu" else 1e-5
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=tol, atol=tol)
    return counts, planned


def _closure(opt, k):
    return (lambda: None) if k == 3 else None


def _hook(opt, k):
    if k == 3:
        opt.register_step_pre_hook(lambda o, args, kwargs: None)


def _tensor_lr(opt, k):
    if k == 3:
        for group in opt.param_groups:
            group["lr"] = torch.tensor(0.05)


def _eager_state(opt, k):
    if k == 3:      # a checkpoint of eager tensors loaded: the state is no longer lazy tensors
        saved = opt.state_dict()
        for state in saved["state"].values():
            for name, v in state.items():
                state[name] = torch.tensor(v.tolist(), dtype=v.dtype)
        opt.load_state_dict(saved)


@pytest.mark.parametrize("interfere", [_closure, _hook, _tensor_lr, _eager_state])
@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.Adam(p, lr=1e-2)], ids=["sgd", "adam"])
def test_steps_it_does_not_take_run_torchs_step_and_equal_eager(make_opt, interfere, fast_recording,
                                                                replayed_eagerly) -> None:
    counts, _ = _train_against_eager(make_opt, interfere)
    assert counts[2] == 1, counts           # stamped from the third step on
    assert counts[3] == counts[2], counts   # the step interfered with is torch's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_stamped_step_is_planned_once_and_trains_like_eager(device, fast_recording) -> None:
    """Compiled: the stamped steps reuse the plan of the step torch's step recorded, and train as eager."""
    counts, planned = _train_against_eager(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
                                           lambda o, k: None, steps=5, device=device)
    assert counts[-1] == 3, counts
    assert planned == 2, planned     # the first step (state made) and the second: no other plan


def test_a_scheduler_made_after_stamping_began_schedules_and_warns_of_nothing(fast_recording, replayed_eagerly) -> None:
    torch.manual_seed(0)
    model = pydisc.lazy(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(6):
            if k == 3:
                schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if k >= 3:
                schedule.step()
            lrs.append(RECORDER.trace.scalars[-1])      # SGD's last lifted float: -lr
            pydisc.mark_step()
    assert METRICS.optimizer_steps_stamped == 4
    assert lrs == [-0.1, -0.1, -0.1, -0.1, -0.05, -0.025]
    # a copy of the optimizer is torch's again (its state and groups, not pydisc's `step`)
    copied = copy.deepcopy(opt)
    assert "step" not in copied.__dict__ and copied.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("where", ["capture", "stamp"])
def test_a_failure_inside_pydisc_runs_torchs_step_warns_once_and_is_counted(where, fast_recording, replayed_eagerly,
                                                                          monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(optimizer_step, "_template", broken) if where == "capture" else \
        monkeypatch.setattr(optimizer_step.Template, "stamp", broken)
    with pytest.warns(pydisc.PydiscWarning, match="injected failure"):
        counts, _ = _train_against_eager(lambda p: torch.optim.Adam(p, lr=1e-2), lambda o, k: None)
    assert counts[-1] == 0, counts
    assert METRICS.compile_failures == {"optimizer template: RuntimeError": 1 if where == "capture" else 3}
