"""Tiny HF transformers models built offline (random init, default attention unless told), their
batches, and a side-by-side trainer: the same model trained eagerly and under pydisc."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import pydisc

VOCAB = 96


def _quiet() -> None:
    import transformers
    transformers.logging.set_verbosity_error()


def bert(attn: str = "sdpa"):
    from transformers import BertConfig, BertForMaskedLM
    _quiet()
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation=attn)
    return BertForMaskedLM(cfg)


def gpt2(attn: str = "sdpa", dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel
    _quiet()
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                     embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=1,
                     attn_implementation=attn)
    return GPT2LMHeadModel(cfg)


def gpt2_dropout(attn: str = "sdpa"):
    """GPT-2 as fine-tuned: dropout 0.1 everywhere (the steps reseed torch's generator, so both sides
    draw the same masks)."""
    return gpt2(attn, dropout=0.1)


def llama(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM
    _quiet()
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def t5(attn: str = "sdpa"):
    from transformers import T5Config, T5ForConditionalGeneration
    _quiet()
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                   attn_implementation=attn)
    return T5ForConditionalGeneration(cfg)


def bart(attn: str = "sdpa"):
    from transformers import BartConfig, BartForConditionalGeneration
    _quiet()
    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=2, attn_implementation=attn)
    return BartForConditionalGeneration(cfg)


def vit(attn: str = "sdpa"):
    from transformers import ViTConfig, ViTForImageClassification
    _quiet()
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation=attn)
    return ViTForImageClassification(cfg)


def lm_batch(g: torch.Generator, batch: int, length: int, model: str) -> dict:
    """Keyword arguments of one training step's forward for `model` (a key of MODELS)."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    if model == "bert":
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[0, length - length // 4:] = 0            # the first sentence is padded
        labels = torch.full((batch, length), -100)
        chosen = torch.rand(batch, length, generator=g) < 0.3
        chosen[:, 0] = True
        labels[chosen] = ids[chosen]
        ids = ids.masked_fill(chosen, 4)              # [MASK]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if model in ("t5", "bart"):
        targets = torch.randint(3, VOCAB, (batch, max(2, length // 2)), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long),
                "labels": targets}
    if model == "vit":  # (images)
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (batch,), generator=g)}
    return {"input_ids": ids, "labels": ids}


MODELS: dict[str, Callable] = {"bert": bert, "gpt2": gpt2, "gpt2_dropout": gpt2_dropout, "llama": llama, "t5": t5,
                               "bart": bart, "vit": vit}


def adamw(params):
    """AdamW with eps 1e-6: gradients that are zero in exact arithmetic (a key bias: softmax ignores a
    shift shared by a row's scores) are rounding noise in eager and compiled alike, and with eps 1e-8
    Adam turns noise of 1e-9 into updates of lr's size, different on each side."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


@dataclass
class Run:
    eager_losses: list = field(default_factory=list)
    lazy_losses: list = field(default_factory=list)
    eager_model: object = None
    lazy_model: object = None
    metrics: dict = field(default_factory=dict)
    step_seconds: list = field(default_factory=list)     # pydisc: each step, recording to mark_step
    eager_seconds: list = field(default_factory=list)
    compiled_steps: list = field(default_factory=list)   # per pydisc step: did a compiled cluster run
    # with `read_in_step`: per step, (the loss, the gradient norm clip_grad_norm_ returned) read
    # between backward() and mark_step()
    eager_reads: list = field(default_factory=list)
    lazy_reads: list = field(default_factory=list)

    @property
    def compiled_share(self) -> float:
        return sum(self.compiled_steps) / max(1, len(self.compiled_steps))


def train_side_by_side(name: str, steps: int = 5, lengths: list[int] | None = None, attn: str = "sdpa",
                       batch: int = 2, optimizer: Callable = adamw, device: str = "cpu",
                       autocast: torch.dtype | None = None, read_in_step: bool = False,
                       checkpointing: bool = False, frozen_embeddings: bool = False) -> Run:
    """Train MODELS[name] eagerly and under pydisc from the same weights on the same batches (one
    length per step: `lengths`, default 12 throughout), both on `device`, the forward under
    `torch.autocast(device, autocast)` if given; with `read_in_step`, as training scripts log: the loss
    read and the gradients clipped (`clip_grad_norm_`, its norm read) between backward() and the step;
    with `checkpointing`, HF's gradient checkpointing on; with `frozen_embeddings`, the input embeddings
    frozen."""
    lengths = lengths or [12] * steps
    torch.manual_seed(0)
    eager = MODELS[name](attn).train().to(device)
    if checkpointing:       # as fine-tuning scripts save memory: HF's default (torch.utils.checkpoint)
        eager.gradient_checkpointing_enable()
    if frozen_embeddings:   # as adapters (LoRA) train: the embeddings' output then needs no gradient
        eager.get_input_embeddings().weight.requires_grad_(False)
    lazy = pydisc.lazy(copy.deepcopy(eager))
    opt_e, opt_l = optimizer(eager.parameters()), optimizer(lazy.parameters())
    pydisc.reset_metrics()
    run = Run(eager_model=eager, lazy_model=lazy)
    g = torch.Generator().manual_seed(0)
    for step, length in enumerate(lengths):
        inputs = lm_batch(g, batch, length, "gpt2" if name == "gpt2_dropout" else name)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        for model, opt, losses, seconds, reads in (
                (eager, opt_e, run.eager_losses, run.eager_seconds, run.eager_reads),
                (lazy, opt_l, run.lazy_losses, run.step_seconds, run.lazy_reads)):
            torch.manual_seed(1000 + step)      # the same dropout masks on both sides
            executions = pydisc.metrics()["executions"]
            started = time.perf_counter()
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(**inputs).loss
            loss.backward()
            if read_in_step:
                reads.append((loss.item(), float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))))
            opt.step()
            opt.zero_grad()
            if model is lazy:
                pydisc.mark_step()
                run.compiled_steps.append(pydisc.metrics()["executions"] > executions)
            losses.append(float(loss.detach()))
            seconds.append(time.perf_counter() - started)
    run.metrics = pydisc.metrics()
    return run


def assert_trains_like_eager(run: Run, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    torch.testing.assert_close(torch.tensor(run.lazy_losses), torch.tensor(run.eager_losses), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(run.lazy_reads), torch.tensor(run.eager_reads), rtol=rtol, atol=atol)
    lazy = dict(run.lazy_model.named_parameters())
    for name, p in run.eager_model.named_parameters():
        torch.testing.assert_close(lazy[name].detach().cpu(), p.detach().cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: name + ": " + m)
