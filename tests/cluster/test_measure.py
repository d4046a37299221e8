"""Measured choice between a compiled cluster and its ops run eagerly (PYDISC_MEASURE)."""
import gc
import re
import time

import pytest
import torch

import pydisc
from pydisc.config import CONFIG
from pydisc.exec import choices
from pydisc.exec.clusters import CompiledCluster
from pydisc.driver import step_choice
from pydisc.driver.engine import ENGINE
from pydisc.driver.step import clear_plans
from pydisc.frontend.fast_state import GIVE_UP_AFTER
from pydisc.frontend.lazy_tensor import LazyTensor


@pytest.fixture
def own_choices(monkeypatch, request):
    """Each test its own file of measured choices in the (shared) compile cache, and fresh plans."""
    monkeypatch.setattr(CONFIG, "dynamic", False)
    monkeypatch.setattr(choices, "FILE_NAME", "speed_choices-%s.json" % request.node.name)
    # whatever an earlier test of this process left pending (its lazy tensors cannot be released) runs
    # now: these tests count the process's lazy tensors
    try:
        pydisc.mark_step()
    except Exception:
        pass
    gc.collect()
    choices.forget()
    clear_plans()
    pydisc.reset_metrics()
    yield
    clear_plans()
    choices.forget()


@pytest.fixture
def measure_cpu(monkeypatch, own_choices):
    monkeypatch.setattr(CONFIG, "measure", "all")


def _four_steps(device: str = "cpu") -> int:
    """Four steps of one small cluster, each checked against eager; the compiled executions they ran."""
    x = pydisc.to_lazy(torch.randn(4, device=device))
    pydisc.mark_step()
    executions = pydisc.metrics()["executions"]
    expected = (x.cpu() * 3.0 + 1.0).sin() * x.cpu()
    for _ in range(4):
        y = (x * 3.0 + 1.0).sin() * x
        pydisc.mark_step()
        torch.testing.assert_close(y.cpu(), expected)
    return pydisc.metrics()["executions"] - executions


def _slowed(fn, seconds):
    def slow(*args):
        time.sleep(seconds)
        return fn(*args)
    return slow


def test_a_cluster_runs_eagerly_once_eager_is_measured_faster(measure_cpu, monkeypatch):
    # the compiled calls are made slower than the eager ops, deterministically
    monkeypatch.setattr(CompiledCluster, "run_compiled", _slowed(CompiledCluster.run_compiled, 0.02))
    executions = _four_steps()
    m = pydisc.metrics()
    assert m["clusters_eager_faster"] == 1, m["speed_choices"]
    assert len(m["speed_choices"]) == 1 and m["speed_choices"][0].endswith("-> eager")
    # steps 1 and 2 compiled, two timed compiled calls in the measurement, then eager only
    assert executions == 4
    assert not m["fallback_ops"]            # a choice, not a fallback
    assert "kept eager because eager was faster" in pydisc.metrics_report()


def test_the_compiled_cluster_is_kept_when_eager_is_slower(measure_cpu, monkeypatch):
    original = CompiledCluster.measure

    class Slowed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.graph = inner.graph

        def forward(self, *args):
            time.sleep(0.02)
            return self.inner(*args)

    def slow_eager(self, inputs):
        fallback = self.fallback
        self.fallback = Slowed(fallback)
        try:
            return original(self, inputs)
        finally:
            self.fallback = fallback

    monkeypatch.setattr(CompiledCluster, "measure", slow_eager)
    executions = _four_steps()
    m = pydisc.metrics()
    assert m["clusters_eager_faster"] == 0 and m["speed_choices"][0].endswith("-> IREE"), m["speed_choices"]
    # 4 steps, plus the two timed compiled calls of the measurement
    assert executions == 6


@pytest.fixture
def slow_compiled_default_measure(monkeypatch, own_choices):
    """The default PYDISC_MEASURE, with compiled calls made slower than eager, deterministically."""
    monkeypatch.setattr(CONFIG, "measure", "cuda")
    monkeypatch.setattr(CompiledCluster, "run_compiled", _slowed(CompiledCluster.run_compiled, 0.02))


def test_the_default_measures_on_cuda_only(slow_compiled_default_measure):
    assert _four_steps() == 4              # every step compiled, no extra timed calls
    assert pydisc.metrics()["speed_choices"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measured_choice_on_cuda(slow_compiled_default_measure):
    assert _four_steps("cuda") == 4        # steps 1 and 2, and the two timed calls
    m = pydisc.metrics()
    assert m["clusters_eager_faster"] == 1 and m["speed_choices"][0].endswith("-> eager"), m["speed_choices"]


def test_a_measured_choice_is_kept_in_the_cache_and_taken_by_a_later_process(measure_cpu, monkeypatch):
    # first "process": the compiled calls are slowed, eager is measured faster and the choice stored
    slowed = _slowed(CompiledCluster.run_compiled, 0.02)
    monkeypatch.setattr(CompiledCluster, "run_compiled", slowed)
    _four_steps()
    assert pydisc.metrics()["speed_choices"][0].endswith("-> eager")
    # a later "process": nothing in memory, the same cluster at the same sizes; no compiled call at all,
    # no timing, the stored choice is reported
    clear_plans()
    choices.forget()
    pydisc.reset_metrics()
    compiled_calls = []
    monkeypatch.setattr(CompiledCluster, "run_compiled", lambda self, inputs: compiled_calls.append(1) or slowed(self, inputs))
    monkeypatch.setattr(CompiledCluster, "measure", lambda self, inputs: pytest.fail("measured again"))
    assert _four_steps() == 0 and not compiled_calls
    m = pydisc.metrics()
    assert m["clusters_eager_faster"] == 1 and len(m["speed_choices"]) == 1, m["speed_choices"]
    assert m["speed_choices"][0].endswith("-> eager (measured before)")
    # other sizes are another measurement
    clear_plans()
    pydisc.reset_metrics()
    monkeypatch.setattr(CompiledCluster, "measure", lambda self, inputs: compiled_calls.append("measured"))
    x = pydisc.to_lazy(torch.randn(6))
    pydisc.mark_step()
    for _ in range(3):
        y = (x * 3.0 + 1.0).sin() * x
        pydisc.mark_step()
        torch.testing.assert_close(y.cpu(), (x.cpu() * 3.0 + 1.0).sin() * x.cpu())
    assert "measured" in compiled_calls


def _training(steps: int, lazy: bool, seed: int = 0):
    """A small MLP trained with SGD; the losses, and the model."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if lazy:
        model = pydisc.lazy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(4)]
    losses = []
    for k in range(steps):
        x, y = data[k % 4]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if lazy:
            pydisc.mark_step()
    return [float(v) for v in losses], model


@pytest.fixture
def step_choice_cpu(monkeypatch, own_choices):
    """The step choice on, on the CPU; its early probe (a plain eager step against recording) off, unless
    the test turns it on: on these tiny models its outcome would depend on timing."""
    from pydisc.driver import step_choice

    monkeypatch.setattr(CONFIG, "step_choice", "cpu")
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 10 ** 9)


@pytest.mark.parametrize("slower", ["compiled", "eager"])
def test_whole_steps_run_eagerly_where_that_is_measured_faster(step_choice_cpu, monkeypatch, slower):
    # once the step repeats (3 cached runs), windows of 1 + 4 steps are timed compiled and eager (the lazy
    # tensors released: plain torch), twice each; the faster mode is kept, and compiled steps resume on the
    # tensors made lazy again. Either side is slowed deterministically; the training matches eager.
    from pydisc.frontend import lazy_tensor

    if slower == "compiled":
        monkeypatch.setattr(CompiledCluster, "run_compiled", _slowed(CompiledCluster.run_compiled, 0.05))
    else:
        # eager windows run plain torch (the lazy tensors released): a plain weight's forward is slowed
        forward = torch.nn.Linear.forward

        def slow_forward(self, x):
            if lazy_tensor.RECORDER.released and not pydisc.is_lazy(self.weight):
                time.sleep(0.005)
            return forward(self, x)
        monkeypatch.setattr(torch.nn.Linear, "forward", slow_forward)
    expected, _ = _training(30, lazy=False)
    losses, model = _training(30, lazy=True)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    kept = "eager" if slower == "compiled" else "compiled"
    assert "-> " + kept in m["step_choice"], m["step_choice"]
    assert "whole steps" in pydisc.metrics_report()
    steps_compiled = m["steps"]
    # kept eager: the model's lazy tensors were released (made plain in place); a model made lazy later
    # is lazy, and its steps are recorded and measured afresh
    assert all(pydisc.is_lazy(p) == (kept == "compiled") for p in model.parameters())
    losses, model = _training(4, lazy=True, seed=2)
    assert pydisc.metrics()["steps"] > steps_compiled
    assert all(pydisc.is_lazy(p) for p in model.parameters())


@pytest.mark.parametrize("foreach", [False, True])
def test_pass_through_steps_train_bit_for_bit_as_eager(step_choice_cpu, foreach):
    # the eager side of the whole-step choice: every op runs in torch at once; results that do not alias a
    # lazy tensor are plain tensors (optimizer state created in such a step too), parameters stay lazy

    def train(lazy):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 3))
        if lazy:
            model = pydisc.lazy(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
        g = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(4):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            out = model(x)
            torch.nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            outs.append(out)
            if lazy:
                pydisc.mark_step()
        return model, opt, outs

    eager, _, _ = train(False)
    ENGINE.set_passthrough(True)       # clear_plans (the fixture) turns it off again
    lazy, opt, outs = train(True)
    assert pydisc.metrics()["recorded_ops"] == 0
    assert not any(pydisc.is_lazy(o) for o in outs)
    for p, q in zip(lazy.parameters(), eager.parameters()):
        assert pydisc.is_lazy(p) and not pydisc.is_lazy(opt.state[p]["exp_avg"])
        assert torch.equal(p.detach().cpu(), q.detach())


def test_release_makes_lazy_tensors_plain_in_place(step_choice_cpu):
    # after eager is kept, every live lazy tensor becomes a plain tensor, the same Python object: modules,
    # optimizers (state keyed by parameter) and the user's references see it, gradients and attributes
    # stay on it, and training goes on as eager without entering pydisc
    from pydisc.frontend.lazy_tensor import LazyTensor
    from pydisc.frontend.release import release_all

    def train(lazy, steps, release_at=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 3))
        if lazy:
            model = pydisc.lazy(model)
        model[0].weight.tag = "mine"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for k in range(steps):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            opt.zero_grad(set_to_none=False)       # gradients live across the release
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if lazy:
                pydisc.mark_step()
            if k == release_at:
                before = list(model.parameters())
                ENGINE.set_passthrough(True)
                released, kept = release_all()
                ENGINE.set_released(True)
                assert released >= 2 * len(before) and [id(p) for p in model.parameters()] == list(map(id, before))
        return model, opt

    # lazy tensors an earlier test of this process keeps alive (a cache, a weak reference) are not this
    # test's: only the ones its training makes must all be released
    earlier = {id(o) for o in gc.get_objects() if type(o) is LazyTensor}
    eager, _ = train(False, 6)
    model, opt = train(True, 6, release_at=2)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert type(p) is torch.nn.Parameter and type(p.grad) is torch.Tensor
        assert all(type(v) is torch.Tensor for v in opt.state[p].values())
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)       # 3 steps were compiled
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert model[0].weight.tag == "mine"
    gc.collect()        # (cyclic garbage is listed by gc.get_objects until collected)
    left = [o for o in gc.get_objects() if type(o) is LazyTensor and id(o) not in earlier]
    # a swap may leave the lazy half of a released tensor alive with no Python referrer: torch's
    # swap_tensors accepts a leaf whose AccumulateGrad node (of an autograd graph something still holds)
    # keeps its C++ tensor, and that node, poisoned by the swap, keeps the object; no one can reach it
    held = [(tuple(o.shape), o.dtype, [type(r).__name__ for r in gc.get_referrers(o) if r is not left])
            for o in left]
    assert not [h for h in held if h[2]], held


def test_restore_makes_released_tensors_lazy_again_in_place(step_choice_cpu):
    # the probe's way back: released tensors (parameters, their gradients, the optimizer's state, a tied
    # weight) become lazy tensors again, the same objects with their current data, and training goes on
    # recorded and compiled, equal to eager
    from pydisc.frontend.release import release_all, restore

    def train(lazy, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                                    torch.nn.Linear(8, 8))
        model[3].weight = model[0].weight    # tied
        if lazy:
            model = pydisc.lazy(model)
        model[0].weight.tag = "mine"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        released = []
        for k in range(steps):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 8, (6,), generator=g)
            opt.zero_grad(set_to_none=False)       # gradients live across the release and the restore
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if lazy:
                pydisc.mark_step()
                if k == 1:      # steps 2 and 3 run plainly in torch
                    ENGINE.set_passthrough(True); ENGINE.set_released(True)
                    release_all(released)
                    assert released and not any(pydisc.is_lazy(p) for p in model.parameters())
                if k == 3:
                    assert restore(released) == 0
                    ENGINE.set_passthrough(False); ENGINE.set_released(False)
        return model, opt

    eager, _ = train(False, 7)
    before = pydisc.metrics()["executions"]
    model, opt = train(True, 7)
    assert pydisc.metrics()["executions"] > before      # steps 4-6 ran compiled
    assert model[3].weight is model[0].weight and model[0].weight.tag == "mine"
    for p, q in zip(model.parameters(), eager.parameters()):
        assert pydisc.is_lazy(p) and pydisc.is_lazy(p.grad) and isinstance(p, torch.nn.Parameter)
        assert pydisc.is_lazy(opt.state[p]["exp_avg"]) and pydisc.is_lazy(opt.state[p]["exp_avg_sq"])
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_released_steps_pass_inputs_through_untouched(step_choice_cpu, monkeypatch):
    # once steps run eagerly, the module's input hook and pydisc.to_lazy hand over the very objects they
    # were given (a pytree rebuild cost 75 us of a 370 us MLP step; a lazy input would send the ops that
    # read it through pydisc) and mark_step() with nothing recorded is a no-op
    from pydisc.frontend.lazy_tensor import RECORDER
    from pydisc.frontend.release import release_all

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x, extra, scale=None):
            seen.append((x, extra, scale))
            return self.lin(x)

    model = pydisc.lazy(Probe())
    x, extra, scale = torch.randn(3, 4), [torch.ones(2), 3], torch.tensor(2.0)
    model(x, extra, scale=scale).sum().backward()
    assert pydisc.is_lazy(seen[-1][0])
    pydisc.mark_step()
    ENGINE.set_passthrough(True)
    release_all()
    monkeypatch.setattr(RECORDER, "released", True)
    model(x, extra, scale=scale).sum().backward()
    assert seen[-1][0] is x and seen[-1][1] is extra and seen[-1][2] is scale
    assert pydisc.to_lazy(x) is x and pydisc.to_lazy(extra) is extra    # the explicit route too
    monkeypatch.setattr(pydisc, "run_pending", lambda *a: pytest.fail("nothing was recorded"))
    pydisc.mark_step()
    # inputs on another device than the module's are still moved there (a model made lazy for a GPU,
    # fed CPU batches): here, a hook for the meta device
    from pydisc.module import _pre_hook
    assert _pre_hook(torch.device("cpu"))(model, (x, x), {}) is None
    (moved_x, moved_extra), moved_kwargs = _pre_hook(torch.device("meta"))(model, (x, extra), {"scale": scale})
    assert moved_x.device.type == "meta" and moved_extra[0].device.type == "meta" and moved_extra[1] == 3
    assert moved_kwargs["scale"].device.type == "meta"
    (moved_x,), _ = _pre_hook(torch.device("meta"))(model, (x,), {})
    assert moved_x.device.type == "meta" and tuple(moved_x.shape) == (3, 4)


def test_step_choice_windows_take_turns_and_the_fastest_counts(step_choice_cpu, monkeypatch):
    # driven directly: 3 cached steps, then windows of 1 + 4 steps, compiled / eager / compiled / eager,
    # the 4 timed at their ends (the first step of a window, where modes switch, is not: a compiled
    # step captured again there costs once in a training loop); the fastest window of each mode decides.
    # A step that plans after an eager window ends the measurement with the windows timed so far.
    from pydisc.driver import step_choice
    from pydisc.frontend.lazy_tensor import RECORDER

    clock = [0.0]
    monkeypatch.setattr(step_choice, "_now", lambda device, settle=True: clock[0])
    monkeypatch.setattr(step_choice, "release_all", lambda into=None, kept_into=None: (0, 0))
    cpu = torch.device("cpu")

    def run(per_step: list, *, then_plan: bool = False) -> str:
        step_choice.reset()
        pydisc.reset_metrics()
        modes = []
        for k in range(3):
            step_choice.after_mark_step(("plan",), True, cpu)
        for k, seconds in enumerate(per_step):
            mode = "eager" if RECORDER.passthrough else "compiled"
            modes.append(mode)
            # the first step of each window: a capture (compiled) or a release (eager), not timed
            clock[0] += seconds[mode] + (1.0 if k % 5 == 0 else 0.0)
            step_choice.after_mark_step(None if RECORDER.passthrough else ("plan",), True, cpu)
        if then_plan:
            step_choice.after_mark_step(("other",), False, cpu)
        assert modes[:10] == ["compiled"] * 5 + ["eager"] * 5
        return pydisc.metrics()["step_choice"]

    # eager slower in its first window only (a load spike): its second window decides
    steps = [{"compiled": 0.010, "eager": 0.030}] * 10 + [{"compiled": 0.010, "eager": 0.005}] * 10
    assert run(steps).startswith("compiled 10.00 ms, eager 5.00 ms per step -> eager")
    assert RECORDER.passthrough
    steps = [{"compiled": 0.010, "eager": 0.012}] * 20
    assert run(steps) == "compiled 10.00 ms, eager 12.00 ms per step -> compiled"
    assert not RECORDER.passthrough
    # back from the first eager window, the next step plans: decided on one window each
    assert "-> eager" in run([{"compiled": 0.020, "eager": 0.010}] * 10, then_plan=True)


@pytest.mark.parametrize("counter", ["cuda_graph_captures", "cuda_graph_warmups"])
def test_a_compiled_window_that_captured_a_cuda_graph_is_timed_again(step_choice_cpu, monkeypatch, counter):
    # A dynamic-shape template captures a CUDA graph per shape, at that shape's third run, which can fall
    # in a timed compiled window (each length of a variable-length loop at its own step); its first two
    # runs go kernel by kernel. Like a compile, those steps are not what the steps cost: the window is
    # timed again from there, at most `RECAPTURED` times per measurement. Driven directly, a capture (or a
    # run before it) costing 0.5 s in the second timed step of every compiled phase; before, every
    # compiled window held one and eager was kept. (The runs before a capture counted as steps until
    # 2026-12-06: variable-length BERT-base on an H100 chose eager, 29.87 against 29.26 ms, where its
    # compiled steps took 26.43.)
    from pydisc.driver import step_choice
    from pydisc.frontend.lazy_tensor import RECORDER
    from pydisc.metrics import METRICS

    clock = [0.0]
    monkeypatch.setattr(step_choice, "_now", lambda device, settle=True: clock[0])
    monkeypatch.setattr(step_choice, "release_all", lambda into=None, kept_into=None: (0, 0))
    cpu = torch.device("cpu")

    def run(captures_per_phase: int) -> str:
        step_choice.reset()
        pydisc.reset_metrics()
        for k in range(3):
            step_choice.after_mark_step(("plan",), True, cpu)
        phase, in_phase = None, 0
        for _ in range(80):
            mode = "eager" if RECORDER.passthrough else "compiled"
            in_phase = in_phase + 1 if mode == phase else 1
            phase = mode
            clock[0] += 0.012 if mode == "eager" else 0.010
            if mode == "compiled" and 2 <= in_phase < 2 + captures_per_phase:
                setattr(METRICS, counter, getattr(METRICS, counter) + 1)
                clock[0] += 0.5
            step_choice.after_mark_step(None if RECORDER.passthrough else ("plan",), True, cpu)
            if ENGINE.choice.phase == "decided":
                return pydisc.metrics()["step_choice"]
        raise AssertionError("undecided")

    assert run(1) == "compiled 10.00 ms, eager 12.00 ms per step -> compiled"
    assert ENGINE.choice.recaptured == 2
    # captures that keep coming (more shapes than graphs kept): timed as they are, after RECAPTURED
    assert "-> eager" in run(40)
    assert ENGINE.choice.recaptured == step_choice.RECAPTURED


def test_the_probe_skips_steps_of_new_sizes_until_they_keep_coming(step_choice_cpu, monkeypatch):
    # steps recorded op by op only because their sizes were new (`off_path`) are not probed: the next
    # recorded step is, or the `OFF_PATH_STEPS + 1`-th of new sizes in a row (then that is what steps cost)
    from pydisc.driver import step_choice

    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    probed = []
    monkeypatch.setattr(step_choice, "_start_probe", lambda s, recorded, device: probed.append(recorded))
    cpu = torch.device("cpu")

    def steps(off_path: list) -> list:
        step_choice.reset()
        probed.clear()
        for k, off in enumerate(off_path):
            step_choice.after_mark_step(None, False, cpu, recorded=0.001 * (k + 1), off_path=off)
            if probed:
                break
        return probed[:]

    assert steps([False, True, True, True, False]) == [0.005]
    assert steps([False] + [True] * step_choice.OFF_PATH_STEPS + [True]) == [0.001 * (step_choice.OFF_PATH_STEPS + 2)]
    assert steps([False, False]) == [0.002]
    step_choice.reset()


class _HookedMLP(torch.nn.Module):
    """A forward the fast recorder gives up on midway (a tensor hook on an activation, as gradient
    probes and some regularisers add): such a step records fast, then again op by op."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 1.0)
        return self.b(h)


def test_the_probe_skips_steps_the_fast_recorder_gave_up_on_midway(step_choice_cpu, monkeypatch):
    # A step whose forward was demoted recorded it twice: not what the steps to come cost (they record
    # op by op from the start once the module was given up on, fast.arm). The probe, which compares a
    # step's recording with a plain eager step, times a step that was not demoted. (Before, it timed the
    # second demoted step: a hooked MLP's recording 2.73 ms against 1.55 ms for the steps after it.)
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    probed = []     # the demotions so far at each probe, and before its step began
    before = [0]
    monkeypatch.setattr(step_choice, "_start_probe", lambda s, recorded, device: probed.append(
        (sum(pydisc.metrics()["fast_demotions"].values()), before[0])))
    step_choice.reset()
    pydisc.reset_metrics()
    torch.manual_seed(0)
    model = pydisc.lazy(_HookedMLP(), fast_record=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(GIVE_UP_AFTER + 3):
        before[0] = sum(pydisc.metrics()["fast_demotions"].values())
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        pydisc.mark_step()
    step_choice.reset()
    assert pydisc.metrics()["fast_demotions"]["tensor hooks"] == GIVE_UP_AFTER
    assert len(probed) == 1
    at_probe, before_its_step = probed[0]
    assert at_probe == before_its_step == GIVE_UP_AFTER     # the probed step demoted nothing


def _faked_steps(monkeypatch, device: torch.device):
    """The step choice on fake clocks, nothing released: (the clock, `steps(n, compiled, eager, plan)`,
    which runs n steps, each `compiled` or `eager` seconds by the mode it runs in, and returns the modes)."""
    from pydisc.driver import step_choice
    from pydisc.frontend.lazy_tensor import RECORDER

    clock = [0.0]
    monkeypatch.setattr(step_choice, "_now", lambda device, settle=True: clock[0])
    monkeypatch.setattr(step_choice, "_host_clock", lambda: clock[0])
    monkeypatch.setattr(step_choice, "release_all", lambda into=None, kept_into=None: (0, 0))
    monkeypatch.setattr(step_choice, "restore", lambda objects: 0)
    step_choice.reset()
    pydisc.reset_metrics()

    def steps(n: int, compiled: float, eager: float, plan=("plan",)) -> list:
        modes = []
        for _ in range(n):
            modes.append("eager" if RECORDER.passthrough else "compiled")
            clock[0] += eager if RECORDER.passthrough else compiled
            step_choice.after_mark_step(None if RECORDER.passthrough else plan, True, device)
        return modes
    return clock, steps


def test_kept_compiled_steps_are_measured_again_when_their_time_drifts(step_choice_cpu, monkeypatch):
    # The time between the mark_steps of compiled steps kept is watched: a median over WATCH steps DRIFT
    # times faster or slower than the compiled windows were (the load that slowed the eager windows has
    # gone) times the windows again, which can then keep eager; at most RECHECKS times per process. Steps
    # of plans the windows did not run (sampling after training) are not the machine changing.
    from pydisc.driver import step_choice
    from pydisc.frontend.lazy_tensor import RECORDER

    clock, steps = _faked_steps(monkeypatch, torch.device("cpu"))
    steps(3 + 20, compiled=0.030, eager=0.060)   # under load: eager's windows slower
    assert pydisc.metrics()["step_choice"] == "compiled 30.00 ms, eager 60.00 ms per step -> compiled"
    # the steps right after the decision are not noted (here they take 200 ms: captures again); then
    # steps within DRIFT of the windows, one of them after a 10 s pause of the loop (a checkpoint), which
    # the median leaves out: nothing happens
    assert set(steps(step_choice.WATCH + 1, compiled=0.200, eager=0.060)) == {"compiled"}
    assert set(steps(10, compiled=0.035, eager=0.060)) == {"compiled"}
    clock[0] += 10.0
    assert set(steps(step_choice.WATCH - 10, compiled=0.035, eager=0.060)) == {"compiled"}
    assert pydisc.metrics()["step_choice"] == "compiled 30.00 ms, eager 60.00 ms per step -> compiled"
    # another plan's steps, 1 ms each (the loop samples): not noted
    steps(3 * step_choice.WATCH, compiled=0.001, eager=0.060, plan=("sample",))
    assert pydisc.metrics()["step_choice"] == "compiled 30.00 ms, eager 60.00 ms per step -> compiled"
    # the load is gone: compiled steps take 15 ms, eager ones 7: the windows are timed again
    # (back from the other plan, the first step only starts the clock)
    modes = steps(1 + step_choice.WATCH + 20, compiled=0.015, eager=0.007)
    assert modes[:step_choice.WATCH + 1] == ["compiled"] * (step_choice.WATCH + 1) and "eager" in modes
    assert pydisc.metrics()["step_choice"].startswith(
        "measured again (compiled steps took 15.00 ms, against 30.00 in the windows): "
        "compiled 15.00 ms, eager 7.00 ms per step -> eager")
    assert RECORDER.passthrough


def test_on_a_gpu_compiled_steps_kept_are_not_watched(step_choice_cpu, monkeypatch):
    # On a GPU the host queues a step and returns while the device still runs the one before: the time
    # between the mark_steps of a device-bound step is not its time (the chain on the H200: 0.58 ms against
    # 1.87 in the synchronised windows), and it moves with syncs and captures on a machine that does not
    # change. Compiled steps kept there are not measured again, whatever the time between mark_steps.
    from pydisc.driver import step_choice

    monkeypatch.setattr(CONFIG, "step_choice", "all")
    # (a CUDA device only named: the clocks are faked and nothing is captured)
    _, steps = _faked_steps(monkeypatch, torch.device("cuda", 0))
    steps(3 + 20, compiled=0.0019, eager=0.0020)
    assert pydisc.metrics()["step_choice"] == "compiled 1.90 ms, eager 2.00 ms per step -> compiled"
    # queued steps, a third of the windows' time, then four times that: kept, not measured again
    assert set(steps(1 + 3 * step_choice.WATCH, compiled=0.0006, eager=0.0020)) == {"compiled"}
    assert set(steps(3 * step_choice.WATCH, compiled=0.0024, eager=0.0020)) == {"compiled"}
    assert pydisc.metrics()["step_choice"] == "compiled 1.90 ms, eager 2.00 ms per step -> compiled"


@pytest.mark.parametrize("bound", [0.0, 1e9])
def test_a_step_that_records_slower_than_a_plain_eager_step_keeps_eager_without_compiling(
        step_choice_cpu, monkeypatch, bound):
    # After the second recorded step, the lazy tensors are released and the next step runs plainly in torch,
    # timed. Recording took more than RECORDING_BOUND times as long -> eager is kept at once, nothing is
    # compiled; otherwise the tensors are made lazy again and steps record and compile. The bound is set to
    # always (0) or never (1e9) so that the outcome does not depend on timing; the training matches eager.
    from pydisc.driver import step_choice
    from pydisc.frontend import lazy_tensor

    monkeypatch.setattr(CONFIG, "compile_after", 2)     # the default: a new graph runs eagerly once
    monkeypatch.setattr(step_choice, "PROBE_AFTER", 2)
    monkeypatch.setattr(step_choice, "RECORDING_BOUND", bound)
    steps = []    # per step: (recorder in pass-through, parameters lazy) when it began
    mark_step = pydisc.mark_step
    params = []

    def noting_mark_step():
        steps.append((lazy_tensor.RECORDER.passthrough, all(pydisc.is_lazy(p) for p in params)))
        mark_step()
    monkeypatch.setattr(pydisc, "mark_step", noting_mark_step)
    monkeypatch.setattr(pydisc, "lazy", lambda m, _lazy=pydisc.lazy: params.extend(_lazy(m).parameters()) or m)
    # release_all walks every object of the process: once for the probe, and again to keep eager only if a
    # tensor the probe could not release is still alive then (under xdist, one an earlier test of the
    # worker holds); `walks` notes, per walk, whether such a tensor was alive
    walks, kept = [], []
    release_all = step_choice.release_all

    def noting_release_all(*a):
        walks.append(any(ref() is not None for ref in kept))
        out = release_all(*a)
        if len(a) > 1:
            kept.extend(a[1])
        return out
    monkeypatch.setattr(step_choice, "release_all", noting_release_all)
    gc.collect()
    earlier = sum(1 for o in gc.get_objects() if type(o) is LazyTensor)   # an earlier test's, under xdist
    expected, _ = _training(8, lazy=False)
    losses, model = _training(8, lazy=True)
    pydisc.wait_for_compiles()
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    # steps 0 and 1 are new graphs (SGD's momentum buffers are made at the first), run eagerly; step 2 is
    # the plain, timed step
    assert steps[:3] == [(False, True), (False, True), (True, False)], steps
    assert walks[0] is False and all(walks[1:]), walks     # no walk again that could find nothing new
    if bound == 0.0:
        assert steps[3:] == [(True, False)] * 5, steps
        assert "-> eager, not compiled" in m["step_choice"], m["step_choice"]
        kept = re.search(r"released to plain, (\d+) kept lazy", m["step_choice"])
        assert kept and int(kept.group(1)) <= earlier, (m["step_choice"], earlier)   # none of this training's
        assert m["plans_compiled"] == 0 and m["background_compiles"] == 0
        assert not any(pydisc.is_lazy(p) for p in model.parameters())
    else:
        # lazy again: step 3 is step 1's graph again and compiles; the steps after it run compiled
        assert steps[3:] == [(False, True)] * 5, steps
        assert "-> recording" in m["step_choice"], m["step_choice"]
        assert m["plans_compiled"] == 1 and m["executions"] >= 4, m
        assert all(pydisc.is_lazy(p) for p in model.parameters())


def _decoding(rounds: int, lazy: bool, tokens: int = 4):
    """Greedy decoding as HF `generate()` does it: each token's step ends at its read (`.item()` here),
    and the loop calls `mark_step()` once per decode. The tokens of each round, and the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Tanh(), torch.nn.Linear(8, 11))
    if lazy:
        model = pydisc.lazy(model)
    out = []
    with torch.no_grad():
        for r in range(rounds):
            ids = [r % 11]
            for _ in range(tokens):
                logits = model(torch.tensor(ids[-1:]))
                ids.append(int(logits[-1].argmax()))
            out.append(ids)
            if lazy:
                pydisc.mark_step()
    return out, model


def test_steps_that_end_at_reads_are_chosen_by_the_step_between_mark_steps(step_choice_cpu, monkeypatch):
    # the token steps end at reads, not at mark_step; the step choice counts what runs from one mark_step
    # to the next as the step (one decode), compiled against eager; the compiled calls slowed, eager kept
    monkeypatch.setattr(CompiledCluster, "run_compiled", _slowed(CompiledCluster.run_compiled, 0.01))
    expected, _ = _decoding(24, lazy=False)
    got, model = _decoding(24, lazy=True)
    assert got == expected
    m = pydisc.metrics()
    assert "-> eager" in m["step_choice"], m["step_choice"]
    assert not any(pydisc.is_lazy(p) for p in model.parameters())
