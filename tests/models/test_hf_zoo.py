"""More of HF transformers' architectures (tiny configs built offline, default attention) trained side by
side with eager on the fast recorder, with Nesterov SGD and gradients scaled in place, the outputs kept
to the step's end: losses, parameters and momentum buffers equal eager's. As in
test_nn_zoo.py, the steps are recorded and planned as usual and the plans replayed in torch
(`CONFIG.disable`), so no IREE compile is spent; test_hf_models.py compiles the common ones. Where the
fast recorder must hand a step to the dispatcher, the reason is the one expected, and the results
still equal eager's."""
from __future__ import annotations

import copy

import pytest
import torch

import pydisc
from pydisc.config import CONFIG

transformers = pytest.importorskip("transformers")
V = 96
T = transformers
_SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# name -> (model, batch kind, the fast recorder's expected demotion or None)
ZOO = {
    "distilbert": (lambda: T.DistilBertForMaskedLM(T.DistilBertConfig(
        vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0,
        max_position_embeddings=64)), "mlm", None),
    "albert": (lambda: T.AlbertForMaskedLM(T.AlbertConfig(**_SMALL, embedding_size=16, **_NO_DROPOUT)), "mlm", None),
    "deberta_v2": (lambda: T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        **_SMALL, **_NO_DROPOUT, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"],
        max_relative_positions=16)), "mlm", None),
    "modernbert": (lambda: T.ModernBertForMaskedLM(T.ModernBertConfig(
        **_SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        global_attn_every_n_layers=2, local_attention=8)), "mlm", None),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(**_SMALL, **_NO_DROPOUT, pad_token_id=1)), "mlm", None),
    "electra": (lambda: T.ElectraForMaskedLM(T.ElectraConfig(**_SMALL, **_NO_DROPOUT, embedding_size=16)), "mlm",
                None),
    "mobilebert": (lambda: T.MobileBertForMaskedLM(T.MobileBertConfig(
        vocab_size=V, hidden_size=32, embedding_size=16, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, true_hidden_size=32, intra_bottleneck_size=32, num_feedforward_networks=1,
        **_NO_DROPOUT)), "mlm", None),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**_SMALL, rotary_pct=0.5)), "clm", None),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)), "clm", None),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**_SMALL, num_key_value_heads=2)), "clm", None),
    "phi": (lambda: T.PhiForCausalLM(T.PhiConfig(
        **_SMALL, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5)), "clm", None),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=8)), "clm", None),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**_SMALL, num_key_value_heads=2, pad_token_id=0)), "clm", None),
    "stablelm": (lambda: T.StableLmForCausalLM(T.StableLmConfig(**_SMALL, num_key_value_heads=2)), "clm", None),
    "gptj": (lambda: T.GPTJForCausalLM(T.GPTJConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)), "clm", None),
    "codegen": (lambda: T.CodeGenForCausalLM(T.CodeGenConfig(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0)), "clm", None),
    "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**_SMALL, num_key_value_heads=2, head_dim=8)), "clm", None),
    "falcon": (lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0)), "clm", None),
    # the sliding-window cache in the outputs (kept, as training loops keep `outputs`) holds the last
    # keys: a slice the loss does not read, with its graph
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**_SMALL, num_key_value_heads=2, sliding_window=8)),
                "clm", "a value that requires grad kept past the backward, outside the loss's graph"),
    # its GeLU is a custom autograd.Function
    "bloom": (lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)),
              "clm", "autograd.Function (GeLUFunction)"),
    "mt5": (lambda: T.MT5ForConditionalGeneration(T.MT5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0)), "s2s", None),
    "whisper": (lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
        max_target_positions=32, dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])), "audio", None),
    "swin": (lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
        num_labels=5, **_NO_DROPOUT, drop_path_rate=0.0)), "image", None),
    "deit": (lambda: T.DeiTForImageClassification(T.DeiTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        num_labels=5, **_NO_DROPOUT)), "image", None),
    "dinov2": (lambda: T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        num_labels=5, **_NO_DROPOUT)), "image", None),
    "convnext": (lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5, image_size=32)), "image",
        None),
    # BatchNorm in training: the running statistics and num_batches_tracked are written by the fast step
    "resnet": (lambda: T.ResNetForImageClassification(T.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)), "image", None),
    # ... with squeeze-excitation, depthwise convolutions and AvgPool2d(hidden_dim, ceil_mode=True)
    "efficientnet": (lambda: T.EfficientNetForImageClassification(T.EfficientNetConfig(
        image_size=32, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128, num_labels=5,
        dropout_rate=0.0, drop_connect_rate=0.0)), "image", None),
    # weight-normalised positional convolution, CTC loss; its feature encoder sets requires_grad on a value
    "wav2vec2": (lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, hidden_dropout=0.0, activation_dropout=0.0,
        attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0)), "speech",
        "requires_grad written"),
    "clip": (lambda: T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4), projection_dim=16)), "clip",
        # logits_per_image (kept in the outputs) is a transpose of the logits the loss reads, made apart
        "a value that requires grad kept past the backward, outside the loss's graph"),
}


def _batch(kind: str, g: torch.Generator) -> dict:
    ids = torch.randint(3, V, (2, 12), generator=g)
    if kind == "mlm":
        labels = torch.full((2, 12), -100)
        chosen = torch.rand(2, 12, generator=g) < 0.3
        chosen[:, 0] = True
        labels[chosen] = ids[chosen]
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, -3:] = 0
        return {"input_ids": ids.masked_fill(chosen, 4), "attention_mask": mask, "labels": labels}
    if kind == "clm":
        return {"input_ids": ids, "labels": ids}
    if kind == "s2s":
        return {"input_ids": ids, "labels": torch.randint(3, V, (2, 6), generator=g)}
    if kind == "audio":
        return {"input_features": torch.randn(2, 8, 32, generator=g), "labels": torch.randint(3, V, (2, 6), generator=g)}
    if kind == "speech":
        return {"input_values": torch.randn(2, 400, generator=g), "labels": torch.randint(3, V, (2, 5), generator=g)}
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)}
    return {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g), "return_loss": True}


# wav2vec2's CTC gradients: eager's own float32 gradient of the first convolution is 1.1e-5 off its float64
# one after one step (of 0.5 at most); over 3 steps the momentum buffers of two float32 runs differ by 4e-5
_MOMENTUM_ATOL = {"wav2vec2": 1e-4}


@pytest.mark.parametrize("name", list(ZOO))
def test_hf_architectures_train_like_eager_on_the_fast_path(name: str, monkeypatch) -> None:
    monkeypatch.setattr(CONFIG, "disable", True)
    transformers.logging.set_verbosity_error()
    make, kind, demotion = ZOO[name]
    torch.manual_seed(0)
    ref = make().train()
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True) for m in (ref, model)]
    pydisc.reset_metrics()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        inputs = _batch(kind, g)
        losses, outputs = [], []
        for m, opt in zip((ref, model), opts):
            outputs.append(m(**inputs))     # kept to the step's end, as training loops keep them
            loss = outputs[-1].loss
            loss.backward()
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)        # written in place between backward and step, as clipping does
            opt.step()
            opt.zero_grad()
            if m is model:
                pydisc.mark_step()
            losses.append(loss.detach().cpu())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (key, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5, msg=key)
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        if p_ref not in opts[0].state:
            assert p not in opts[1].state       # frozen (whisper's positions)
            continue
        torch.testing.assert_close(opts[1].state[p]["momentum_buffer"].cpu(), opts[0].state[p_ref]["momentum_buffer"],
                                   rtol=1e-4, atol=_MOMENTUM_ATOL.get(name, 1e-5))
    m = pydisc.metrics()
    if demotion is None:
        assert m["fast_segments"] == 3 and not m["fast_demotions"], m["fast_demotions"]
    else:
        assert set(m["fast_demotions"]) == {demotion}, m["fast_demotions"]


# the text models (but BLOOM, whose GeLU always demotes); Mistral and Falcon in every run, the rest with --long
_TEXT = [pytest.param(name, marks=() if name in ("mistral", "falcon") else pytest.mark.long)
         for name, (_, kind, _) in ZOO.items() if kind in ("clm", "mlm") and name != "bloom"]


@pytest.mark.parametrize("name", _TEXT)
def test_text_models_keep_the_fast_path_at_new_lengths(name: str, monkeypatch) -> None:
    """Trained with lengths that recur, one template serves every step and the steps of lengths seen before
    are recorded fast, parameters equal to eager's after every step. Mistral's sliding-window mask and
    Falcon's causal mask are eager boolean tensors made in the forward from `torch.arange` over the length;
    the attention call turns each into an additive float mask inside torch (driver/fast_match.py makes
    that again at each step). Before, no template took their fast steps and both went back to the
    dispatcher after two."""
    monkeypatch.setattr(CONFIG, "disable", True)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    ref = ZOO[name][0]().train()
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=True)
    # (SGD: Adam divides by the root of near-zero second moments, which turns rounding into 1e-4 differences)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
    pydisc.reset_metrics()
    g = torch.Generator().manual_seed(1)
    for step, n in enumerate((8, 12, 10, 8, 12, 10, 12, 8, 10, 9, 12, 8)):
        ids = torch.randint(3, V, (2, n), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        if ZOO[name][1] == "mlm":
            batch["attention_mask"] = torch.ones(2, n, dtype=torch.long)
        for m, opt in zip((ref, model), opts):
            m(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        pydisc.mark_step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg="step %d" % step)
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 1, m["recompiles"]
    assert m["fast_segments"] >= 7 and not m["fast_demotions"], (m["fast_segments"], m["fast_demotions"])
