"""Plans built in the background (PYDISC_BACKGROUND_COMPILE) while the steps run eagerly, against eager."""
import sys
import threading

import pytest
import torch

import pydisc
from pydisc.driver import background
from pydisc.config import CONFIG
from pydisc.driver.step import clear_plans
from pydisc.frontend.fast_state import FAST


@pytest.fixture
def gated(monkeypatch):
    """Plans built in the background (on any device), held until the test opens the gate."""
    monkeypatch.setattr(CONFIG, "background_compile", "all")
    monkeypatch.setattr(CONFIG, "compile_after", 2)
    gate = threading.Event()
    build = background.build_plan

    def held(*args):
        assert gate.wait(60)
        return build(*args)

    monkeypatch.setattr(background, "build_plan", held)
    clear_plans()
    pydisc.reset_metrics()
    yield gate
    gate.set()
    clear_plans()


def _train(lazy: bool, steps: int, gate=None, open_at=None, sizes=(5,), device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(device)
    if lazy:
        model = pydisc.lazy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses, seen = [], []
    for k in range(steps):
        x = torch.randn(sizes[k % len(sizes)], 6, generator=g).to(device)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if lazy:
            pydisc.mark_step()
            if k == open_at:
                gate.set()
                pydisc.wait_for_compiles()
            seen.append((pydisc.metrics()["recorded_ops"], pydisc.metrics()["executions"]))
    return torch.stack([v.cpu() for v in losses]), [p.detach().cpu() for p in model.parameters()], seen


def _assert_same(got, expected):
    """Losses and final parameters of a pydisc run against eager's."""
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    for p, q in zip(got[1], expected[1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_steps_run_eagerly_while_the_plan_is_built(gated, device):
    expected, params, _ = _train(False, 10, device=device)
    losses, lazy_params, seen = _train(True, 10, gated, open_at=5, device=device)
    _assert_same((losses, lazy_params), (expected, params))
    m = pydisc.metrics()
    # steps 0 and 1 are new graphs (eager), step 2 starts the build and runs eagerly, 3-5 pass through
    # (nothing recorded) until the plan is ready; 6-9 record and run compiled
    assert m["steps_before_compile"] == 2 and m["background_compiles"] == 1 and m["plans_compiled"] == 1
    assert m["steps_while_compiling"] == 4
    assert seen[3][0] == seen[5][0] == seen[2][0], seen        # passed through: nothing recorded
    assert seen[5][1] == 0 < seen[6][1] < seen[9][1], seen     # compiled from step 6 on
    assert m["graph_cache_hits"] == 4


def test_a_dynamic_template_is_built_in_the_background(gated):
    switch_interval = sys.getswitchinterval()
    sizes = (5, 7, 3, 6, 4)
    expected, params, _ = _train(False, 12, sizes=sizes)
    losses, lazy_params, seen = _train(True, 12, gated, open_at=6, sizes=sizes)
    _assert_same((losses, lazy_params), (expected, params))
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 1 and m["background_compiles"] == 1 and m["plans_compiled"] == 1, m
    assert seen[6][1] == 0 < seen[11][1], seen       # the template ran compiled once it was ready
    assert sys.getswitchinterval() == switch_interval   # the process's own, put back


def test_a_plan_that_fails_to_build_leaves_its_graph_eager(gated, monkeypatch):
    def broken(*args):
        raise RuntimeError("injected planning failure")

    monkeypatch.setattr(background, "build_plan", broken)
    expected, params, _ = _train(False, 8)
    with pytest.warns(pydisc.PydiscWarning, match="injected planning failure"):
        losses, lazy_params, seen = _train(True, 8, gated, open_at=3)
    _assert_same((losses, lazy_params), (expected, params))
    assert pydisc.metrics()["executions"] == 0 and pydisc.metrics()["compile_failures"]


def test_varying_sizes_that_record_slower_than_eager_keep_eager_before_any_template(gated, monkeypatch):
    """Sizes that vary, recorded op by op (the fast recorder off): the second step (new sizes) says that
    dims are dynamic, and the step after it runs plainly in torch, timed, before a template is recorded;
    recording took longer (the bound set to 0, so that the outcome does not depend on timing), so eager is
    kept: no template, nothing compiled. (With the fast recorder, steps of new sizes are not probed:
    tests/driver/test_fast_match.py.)"""
    from pydisc.driver import step_choice

    monkeypatch.setattr(CONFIG, "step_choice", "all")
    monkeypatch.setattr(FAST, "default", "off")     # (PYDISC_FAST_RECORD=0)
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    monkeypatch.setattr(step_choice, "RECORDING_BOUND", 0.0)
    sizes = (5, 7, 3, 6, 4)
    expected, params, _ = _train(False, 12, sizes=sizes)
    losses, lazy_params, seen = _train(True, 12, sizes=sizes)
    _assert_same((losses, lazy_params), (expected, params))
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 0 and m["background_compiles"] == 0 and m["plans_compiled"] == 0, m
    assert "-> eager, not compiled" in m["step_choice"], m["step_choice"]
    assert seen[-1][0] == seen[1][0], seen     # nothing recorded after the second step


def test_the_probe_runs_again_when_steps_turn_to_the_dispatch_recorder(monkeypatch):
    """The recording probe judges the steps it timed: the first steps of a fixed size are fast-recorded
    and pass it; then sizes vary and never come again, so the steps record op by op (the fast recorder
    records steps of sizes seen before). The first `OFF_PATH_STEPS` of them are not probed (sizes that
    come again would be recorded fast), nor the one recorded symbolically for the template; after that
    they are probed again, and this time (the bound set to 0 after the first probe, so that the outcome
    does not depend on timing) eager is kept."""
    from pydisc.driver import step_choice

    monkeypatch.setattr(CONFIG, "step_choice", "all")
    monkeypatch.setattr(CONFIG, "fast_record", "cpu")
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    monkeypatch.setattr(step_choice, "RECORDING_BOUND", 1e9)
    end_probe = step_choice._end_probe

    def then_strict(s):
        end_probe(s)
        monkeypatch.setattr(step_choice, "RECORDING_BOUND", 0.0)
    monkeypatch.setattr(step_choice, "_end_probe", then_strict)
    clear_plans()
    pydisc.reset_metrics()
    sizes = (5, 5, 5, 5) + tuple(range(7, 7 + step_choice.OFF_PATH_STEPS + 4))
    steps = len(sizes) + 4
    expected, params, _ = _train(False, steps, sizes=sizes)
    losses, lazy_params, seen = _train(True, steps, sizes=sizes)
    _assert_same((losses, lazy_params), (expected, params))
    m = pydisc.metrics()
    assert m["fast_entries"] > 0, m
    assert "-> eager, not compiled" in m["step_choice"], m["step_choice"]
    # the template's step (recorded symbolically, once) never counts: probed at the 10th and 11th new
    # sizes, the step after them plain, nothing recorded from then on
    k = 4 + step_choice.OFF_PATH_STEPS + 2
    assert seen[-1][0] == seen[k][0] > seen[k - 1][0], seen
    clear_plans()


def test_the_probe_skips_steps_that_passed_through_while_plans_were_built(gated, monkeypatch):
    """A decode loop (each token's step ends at its read, one mark_step per decode) whose token plans
    are built in the background: a decode that meets a new token graph records the tokens before it,
    and the rest pass through while its plan is built; the probe waits for a decode recorded whole."""
    from pydisc.driver import step_choice

    monkeypatch.setattr(CONFIG, "step_choice", "all")
    monkeypatch.setattr(CONFIG, "compile_after", 1)
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    monkeypatch.setattr(step_choice, "RECORDING_BOUND", 1e9)
    probed = []
    start_probe = step_choice._start_probe
    monkeypatch.setattr(step_choice, "_start_probe",
                        lambda s, recorded, device: (probed.append(len(rounds) - 1), start_probe(s, recorded, device)))
    gated.set()
    torch.manual_seed(0)
    model = pydisc.lazy(torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Tanh(), torch.nn.Linear(8, 11)))
    rounds = []
    with torch.no_grad():
        for r in range(6):
            before = pydisc.metrics()["recorded_ops"]
            ids = [r % 11]
            for k in range(4):
                logits = model(torch.tensor(ids[-1:]))
                if r == 1 and k == 2:
                    logits = logits * 1.5       # a token graph not seen before, mid-decode
                ids.append(int(logits[-1].argmax()))
            rounds.append(pydisc.metrics()["recorded_ops"] - before)
            pydisc.wait_for_compiles()
            pydisc.mark_step()
    full = max(rounds)
    assert rounds[0] < full and rounds[1] < full, rounds     # the decodes that passed through in part
    assert probed and rounds[probed[0]] == full, (probed, rounds)
