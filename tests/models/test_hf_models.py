"""HF transformers models (tiny configs built offline, random init) trained under pydisc against eager
with AdamW: losses and parameters equal, and every step after the first two compiled, with nothing run
eagerly (no fallback at all: matmuls, convolutions and attention all compile)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_models  # noqa: E402
from pydisc.config import CONFIG  # noqa: E402

CASES = [(name, "sdpa") for name in ("bert", "gpt2", "llama", "t5", "bart", "vit")] + \
    [("bert", "eager"), ("gpt2", "eager")]


@pytest.fixture
def compile_on_second_sighting(monkeypatch):
    """As users run (PYDISC_COMPILE_AFTER=2): the optimizer's first step, which creates its state, runs
    eagerly and only the steady step compiles, once per model."""
    monkeypatch.setattr(CONFIG, "compile_after", 2)


@pytest.mark.parametrize("name,attn", CASES, ids=["%s-%s" % c for c in CASES])
def test_hf_model_trains_like_eager_compiled(name: str, attn: str, compile_on_second_sighting) -> None:
    run = hf_models.train_side_by_side(name, steps=5, attn=attn)
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["fallback_ops"] == {}, m["fallback_ops"]
    assert m["plans_compiled"] == 1 and m["graph_cache_hits"] == 2, (m["plans_compiled"], m["graph_cache_hits"])
    assert m["executions"] >= 3 and m["compile_failures"] == {}


LENGTHS = [8, 12, 16, 10, 14, 9, 11, 13, 15, 7, 12, 16, 10, 14, 9, 11, 13, 15, 8, 12]


@pytest.fixture
def fresh_plans():
    """A dynamic-shape template serves one model: tests of other models start without it."""
    from pydisc.step import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.mark.parametrize("name", ["gpt2", "bert", "gpt2_dropout"])
def test_hf_model_with_a_new_length_every_step_compiles_once(name: str, compile_on_second_sighting,
                                                              fresh_plans) -> None:
    """DISC's own case: the sequence length changes every step and one executable serves them all,
    from the fifth step on (the first two steps are new graphs, the third shows the length change, the
    fourth is recorded with symbolic sizes)."""
    run = hf_models.train_side_by_side(name, lengths=LENGTHS)
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["plans_compiled"] <= 2 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert run.compiled_share >= 0.8, (run.compiled_steps, m["recompiles"])
    allowed = {"aten.bernoulli.p"} if name == "gpt2_dropout" else set()     # dropout's mask, torch's generator
    assert set(m["fallback_ops"]) <= allowed, m["fallback_ops"]
