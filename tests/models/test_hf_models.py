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
