"""HF transformers models (tiny configs built offline, random init) trained under pydisc against eager
with AdamW: losses and parameters equal, and every step after the first two compiled, with nothing run
eagerly (no fallback at all: matmuls, convolutions and attention all compile)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import hf_models  # noqa: E402
import pydisc  # noqa: E402
from pydisc.config import CONFIG  # noqa: E402

CASES = [(name, "sdpa") for name in ("bert", "gpt2", "llama", "t5", "bart", "vit")] + \
    [("bert", "eager"), ("gpt2", "eager")]
# on the CPU by default: one encoder-decoder (T5) and one model with written-out attention (GPT-2)
# are enough there; the others run with --long (and all of them on CUDA)
_LONG_ON_CPU = {("bart", "sdpa"), ("bert", "eager")}
CPU_CASES = [pytest.param(*c, marks=[pytest.mark.long] if c in _LONG_ON_CPU else []) for c in CASES]


@pytest.fixture
def compile_on_second_sighting(monkeypatch):
    """As users run (PYDISC_COMPILE_AFTER=2): the optimizer's first step, which creates its state, runs
    eagerly and only the steady step compiles, once per model."""
    monkeypatch.setattr(CONFIG, "compile_after", 2)


@pytest.mark.parametrize("name,attn", CPU_CASES, ids=["%s-%s" % c for c in CASES])
def test_hf_model_trains_like_eager_compiled(name: str, attn: str, compile_on_second_sighting, fresh_plans) -> None:
    run = hf_models.train_side_by_side(name, steps=5, attn=attn)
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["fallback_ops"] == {}, m["fallback_ops"]
    assert m["plans_compiled"] == 1 and m["graph_cache_hits"] == 2, (m["plans_compiled"], m["graph_cache_hits"])
    assert m["executions"] >= 3 and m["compile_failures"] == {}


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.long)], ids=["fast", "dispatch"])
def test_hf_model_logged_and_clipped_inside_the_step_trains_like_eager(fast: bool, compile_on_second_sighting,
                                                                      fresh_plans, monkeypatch) -> None:
    """The loss read and the gradients clipped between backward() and the optimizer step, before
    mark_step(), as training scripts do, with the default PYDISC_COMPILE_AFTER: the values read and the
    training are eager's. (On the fast recorder the first run of a new step graph raised at the read.)"""
    from pydisc.frontend.fast_state import FAST

    monkeypatch.setattr(FAST, "default", "all" if fast else "off")
    run = hf_models.train_side_by_side("gpt2", steps=4, read_in_step=True)
    assert len(run.lazy_reads) == 4
    hf_models.assert_trains_like_eager(run)
    assert run.metrics["compile_failures"] == {}


@pytest.mark.parametrize("name,frozen", [("gpt2_dropout", False), ("llama", False), ("llama", True)],
                         ids=["gpt2_dropout", "llama", "llama-frozen-embeddings"])
def test_hf_model_with_gradient_checkpointing_trains_like_eager(name: str, frozen: bool, compile_on_second_sighting,
                                                               fresh_plans) -> None:
    """As fine-tuned to save memory: `gradient_checkpointing_enable()` (a non-reentrant
    `torch.utils.checkpoint` per layer) and, for GPT-2, dropout 0.1. Before:
    - GPT-2: the checkpoint's recomputation in the backward draws the forward's dropout masks again (it
      puts torch's generator back); pydisc drew them all at mark_step, the recomputation's after the
      forward's, and the gradients were those of other masks, silently (parameters 7.5e-3 off after 5
      steps). Reading or setting the generator's state now runs the draws pending first (random_state.py),
      and such a forward is recorded by the dispatcher;
    - Llama: `CheckpointError`. HF's hook that makes the embeddings' output require grad demoted the
      fast-recorded forward, and the recomputation met the demoted forward's values without pydisc's
      handler. That hook is now eager's no-op on the fast path (the forward stays there), and such values
      carry their targets' `requires_grad` (test_fast_record.py has both);
    - Llama with frozen embeddings (as LoRA trains): the hook still demotes (the output needed no gradient)
      and makes the value require grad after the demotion: `CheckpointError` until its wrapper's flag
      followed that too."""
    run = hf_models.train_side_by_side(name, steps=4, checkpointing=True, frozen_embeddings=frozen)
    hf_models.assert_trains_like_eager(run)
    if name == "gpt2_dropout":
        assert run.metrics["random_state_runs"] > 0
    elif not frozen:  # (torch 2.11's non-reentrant checkpoint saves its inputs with an autograd.Function: demotes)
        assert "requires_grad_" not in run.metrics["fast_demotions"]
    assert run.metrics["compile_failures"] == {}


@pytest.mark.cuda
@pytest.mark.parametrize("name,attn", CASES, ids=["%s-%s" % c for c in CASES])
def test_hf_model_trains_like_eager_compiled_on_cuda(name: str, attn: str, compile_on_second_sighting) -> None:
    """On CUDA, matmuls and the fused attention kernels stay in torch (cuBLAS, flash/efficient
    attention) by design; everything around them compiles."""
    run = hf_models.train_side_by_side(name, steps=5, attn=attn, device="cuda")
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["fallback_ops"] == {}, m["fallback_ops"]
    assert m["plans_compiled"] == 1 and m["executions"] >= 3, (m["plans_compiled"], m["executions"])


LENGTHS = [8, 12, 16, 10, 14, 9, 11, 13, 15, 7, 12, 16, 10, 14, 9, 11, 13, 15, 8, 12]


@pytest.mark.parametrize("name", ["gpt2", pytest.param("bert", marks=pytest.mark.long), "gpt2_dropout", "t5", "llama"])
def test_hf_model_with_a_new_length_every_step_compiles_once(name: str, compile_on_second_sighting,
                                                              fresh_plans) -> None:
    """DISC's own case: the sequence length changes every step and one executable serves them all,
    from the fifth step on (the first two steps are new graphs, the third shows the length change, the
    fourth is recorded with symbolic sizes). T5 divides its relative positions, computed from the length
    alone, by a Python float; Llama's rotary embeddings slice the features (their gradient). The steps
    of a length seen before, the last ten, are recorded at `__torch_function__` (driver/fast_match.py);
    BERT's and T5's forwards read `mask.all()`."""
    run = hf_models.train_side_by_side(name, lengths=LENGTHS)
    hf_models.assert_trains_like_eager(run)
    m = run.metrics
    assert m["plans_compiled"] <= 2 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert m["fast_segments"] >= 10 and not m["fast_demotions"], (m["fast_segments"], m["fast_demotions"])
    assert run.compiled_share >= 0.8, (run.compiled_steps, m["recompiles"])
    allowed = {"aten.bernoulli.p"} if name == "gpt2_dropout" else set()     # dropout's mask, torch's generator
    assert set(m["fallback_ops"]) <= allowed, m["fallback_ops"]


NEW_TOKENS = 32


def _decode_by_hand(model, prompt, cache: bool, lazy: bool) -> torch.Tensor:
    """Greedy decoding, one forward and (under pydisc) one mark_step per token, the ids fed back."""
    ids, past = prompt.clone(), None
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(ids if past is None or not cache else ids[:, -1:], past_key_values=past, use_cache=cache)
            past = out.past_key_values if cache else None
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if lazy:
                pydisc.mark_step()
                token = token.cpu()
            ids = torch.cat([ids, token], 1)
    return ids


@pytest.mark.parametrize("name,cache", [("gpt2", True), ("gpt2", False), ("llama", True)],
                         ids=["gpt2-cache", "gpt2-no-cache", "llama-cache"])
def test_greedy_decoding_by_hand_compiles_one_plan_for_every_length(name: str, cache: bool,
                                                                     compile_on_second_sighting,
                                                                     fresh_plans) -> None:
    """Each token's step reads a KV cache one longer than the last (or ids one longer, without a
    cache): the cache's length, a dim of a tensor the previous step made, becomes dynamic."""
    torch.manual_seed(0)
    eager = hf_models.MODELS[name]().eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (2, 6))
    pydisc.reset_metrics()
    got = _decode_by_hand(lazy, prompt, cache, lazy=True)
    assert torch.equal(got, _decode_by_hand(eager, prompt, cache, lazy=False))
    m = pydisc.metrics()
    assert m["plans_compiled"] <= 3 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert m["dynamic_matches"] >= NEW_TOKENS - 5, m["recompiles"]
    assert m["fallback_ops"] == {}


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_greedy_with_the_default_cache_compiles_one_plan(name: str, compile_on_second_sighting,
                                                                  fresh_plans) -> None:
    """HF generate() calls the model once per token and reads each token's result, without a
    mark_step: a read without grad that ran everything pending ends the step. T5's generate passes the
    encoder's `ModelOutput` to every decoder call (the input hook made it a plain dict: KeyError)."""
    torch.manual_seed(0)
    eager = hf_models.MODELS[name]().eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (2, 6))
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    pydisc.reset_metrics()
    got = lazy.generate(prompt, **settings)
    m = pydisc.metrics()
    assert torch.equal(got.cpu(), eager.generate(prompt, **settings))
    assert m["plans_compiled"] <= 3 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert m["dynamic_matches"] >= NEW_TOKENS - 6, m["recompiles"]
    assert m["fallback_ops"] == {}


def test_generate_called_again_and_again_plans_nothing_after_the_first_calls(compile_on_second_sighting,
                                                                           fresh_plans) -> None:
    """generate() called again with the same lengths (a service answering prompts of one length): HF's
    causal mask has the prompt's and the new tokens' total length, so the template of the decoding steps
    guards `length + 1 < total`, and the last token's step matches no template. That step recurs at each
    call with the same sizes: it is planned for them, once. (It was counted as one of the misses in a row
    that call for a new template, so every other call recorded and planned a new template from whatever
    step came next, which did not cover it either: two calls in three ran some steps eagerly, forever.)"""
    torch.manual_seed(0)
    eager = hf_models.gpt2().eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (1, 6))
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=2)
    want = eager.generate(prompt, **settings)
    pydisc.reset_metrics()
    planned = []        # per call: (templates, plans missed in the cache, steps run eagerly)
    for _ in range(7):
        got = lazy.generate(prompt, **settings)
        pydisc.mark_step()
        assert torch.equal(got.cpu(), want)
        m = pydisc.metrics()
        planned.append((m["dynamic_templates"], m["graph_cache_misses"], m["dynamic_eager_steps"],
                        m["steps_before_compile"]))
    assert planned[-1] == planned[-3], (planned, pydisc.metrics()["recompiles"])
    assert planned[-1][0] <= 2, planned


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_a_padded_batch_compiles_one_plan(name: str, compile_on_second_sighting, fresh_plans) -> None:
    """Prompts of different lengths, left-padded, with their attention mask: HF's mask code compares the
    mask's length (a step input's dynamic dim) with the cache's (`keys.shape[-2]`, read before the
    step's attention reads the cache). Both are symbols of the step, so the comparison relates them
    rather than pinning the mask's length to a number (which compiled each length)."""
    torch.manual_seed(0)
    eager = hf_models.MODELS[name]().eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    prompt[0, :2], mask[0, :2] = 2, 0
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    pydisc.reset_metrics()
    got = lazy.generate(prompt, attention_mask=mask, **settings)
    m = pydisc.metrics()
    assert torch.equal(got.cpu(), eager.generate(prompt, attention_mask=mask, **settings))
    assert m["plans_compiled"] <= 3 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert m["dynamic_matches"] >= NEW_TOKENS - 6, m["recompiles"]
    assert m["fallback_ops"] == {}


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_on_cuda_matches_eager(name: str, compile_on_second_sighting, fresh_plans) -> None:
    torch.manual_seed(0)
    eager = hf_models.MODELS[name]().eval().cuda()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (2, 6), device="cuda")
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2)
    pydisc.reset_metrics()
    got = lazy.generate(prompt, **settings)
    m = pydisc.metrics()
    assert torch.equal(got.cpu(), eager.generate(prompt, **settings).cpu())
    assert m["plans_compiled"] <= 3 and m["dynamic_templates"] == 1, (m["plans_compiled"], m["recompiles"])
    assert m["dynamic_matches"] >= NEW_TOKENS - 6, m["recompiles"]
    # (the attention mask's last column, sliced from a cluster input one longer than the sequence, ran
    # eagerly here before SizeBindings read a size from a dim that is it plus a constant)
    assert m["fallback_ops"] == {}, m["fallback_ops"]
