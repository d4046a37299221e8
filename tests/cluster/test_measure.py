"""Measured choice between a compiled cluster and its ops run eagerly (PYDISC_MEASURE)."""
import time

import pytest
import torch

import pydisc
from pydisc.config import CONFIG
from pydisc.exec import choices
from pydisc.plan import CompiledCluster
from pydisc.step import clear_plans


@pytest.fixture
def measure_cpu(monkeypatch, request):
    monkeypatch.setattr(CONFIG, "measure", "all")
    monkeypatch.setattr(CONFIG, "dynamic", False)
    # each test its own file of measured choices in the (shared) compile cache
    monkeypatch.setattr(choices, "FILE_NAME", "speed_choices-%s.json" % request.node.name)
    choices.forget()
    clear_plans()
    pydisc.reset_metrics()
    yield
    clear_plans()
    choices.forget()


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
def slow_compiled_default_measure(monkeypatch):
    """The default PYDISC_MEASURE, with compiled calls made slower than eager, deterministically."""
    monkeypatch.setattr(CONFIG, "measure", "cuda")
    monkeypatch.setattr(CONFIG, "dynamic", False)
    monkeypatch.setattr(CompiledCluster, "run_compiled", _slowed(CompiledCluster.run_compiled, 0.02))
    clear_plans()
    pydisc.reset_metrics()
    yield
    clear_plans()


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
