"""torch.nn's own modules, and patterns of ops user code writes, trained side by side with eager on the
fast recorder: losses, parameters, optimizer state and the gradients read after the optimizer step
equal eager's. The steps are planned as usual (make_fx, functionalization, the fused forward's
backward) and the plans replayed in torch (`CONFIG.disable`), so no IREE compile is spent: this
covers recording and planning, where the bugs it was written for lived (one gradient tensor given to
an LSTM's two biases; SGD's Nesterov step writing `.grad`)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.config import CONFIG

B = 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x)[0]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, x.flip(1))


class Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Bilinear(16, 16, 8)

    def forward(self, x):
        return self.b(x, x.flip(1))


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x) + 0
        h.mul_(2)
        h += self.b(x)
        h[:, 0] = 0
        h = h * 3
        return h.clamp_(max=1.5)


class Masks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h, m = self.a(x), x[..., :1] > 0
        return torch.where(m, h, h * 0.5).masked_fill(~m, -1.0) + h.masked_fill(m, 0.0).softmax(-1)


class Indexing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        idx = torch.arange(16).flip(0).expand(h.shape[0], h.shape[1], 16)
        return h.gather(-1, idx) + torch.zeros_like(h).scatter_add(-1, idx, h) + \
            h[:, [0, 2, 2]].sum(1, keepdim=True) + h.index_select(1, torch.tensor([1, 0, 1, 3, 4, 5]))


class Sorting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return h.cumsum(-1) + h.sort(-1)[0] + h.topk(4, -1)[0].sum(-1, keepdim=True) + h.logcumsumexp(1) + \
            h.amax(1, keepdim=True)


class Products(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.w = nn.Linear(16, 16), nn.Parameter(torch.randn(16, 16) * 0.1)

    def forward(self, x):
        h = self.a(x)
        att = torch.einsum("bqd,bkd->bqk", h, x)
        return torch.baddbmm(h, att.softmax(-1), x, beta=0.5, alpha=2.0) + torch.bmm(att, h) @ self.w


class Distances(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        return F.cosine_similarity(h, x, dim=-1).unsqueeze(-1) * h + F.normalize(h, dim=-1) + \
            torch.cdist(h, x).mean(-1, keepdim=True) + F.pairwise_distance(h, x).unsqueeze(-1)


SEQ, IMAGE, TOKENS = (B, 6, 16), (B, 4, 6, 6), "tokens"
ZOO = {
    "multihead-attention": (Attention, SEQ),
    "transformer-encoder-layer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), SEQ),
    "transformer-encoder-layer-norm-first-gelu": (lambda: nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"), SEQ),
    "transformer-decoder-layer": (Decoder, SEQ),
    "lstm": (lambda: Recurrent(nn.LSTM(16, 8, batch_first=True)), SEQ),
    "gru-2-layers-bidirectional": (lambda: Recurrent(nn.GRU(16, 8, num_layers=2, bidirectional=True,
                                                            batch_first=True)), SEQ),
    "conv1d-groupnorm-silu": (lambda: nn.Sequential(nn.Conv1d(6, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU()),
                              SEQ),
    "conv2d-instancenorm-mish": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3), nn.InstanceNorm2d(8, affine=True),
                                                       nn.Mish()), IMAGE),
    "conv2d-channels-last-hardswish": (lambda: nn.Sequential(nn.Conv2d(4, 8, 3), nn.Hardswish()), "channels_last"),
    "layernorm-without-affine-prelu": (lambda: nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16, elementwise_affine=False),
                                                             nn.PReLU()), SEQ),
    "rmsnorm-gelu-tanh": (lambda: nn.Sequential(nn.Linear(16, 16), nn.RMSNorm(16), nn.GELU(approximate="tanh")), SEQ),
    "embedding-bag": (lambda: nn.EmbeddingBag(20, 8, mode="mean"), TOKENS),
    "embedding-padding-idx": (lambda: nn.Sequential(nn.Embedding(20, 8, padding_idx=0), nn.Linear(8, 8)), TOKENS),
    "weight-norm": (lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)), nn.Tanh()), SEQ),
    "conv-transpose-upsample-adaptive-pool": (lambda: nn.Sequential(
        nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Upsample(scale_factor=2, mode="bilinear"), nn.AdaptiveAvgPool2d(3)),
        (B, 4, 3, 3)),
    "pixel-shuffle-elu": (lambda: nn.Sequential(nn.Conv2d(4, 16, 1), nn.PixelShuffle(2), nn.ELU()), (B, 4, 3, 3)),
    "unfold-fold": (lambda: nn.Sequential(nn.Conv2d(4, 4, 1), nn.Unfold(2), nn.Fold((5, 5), 2)), (B, 4, 5, 5)),
    "glu-log-softmax": (lambda: nn.Sequential(nn.Linear(16, 32), nn.GLU(), nn.LogSoftmax(-1)), SEQ),
    "bilinear": (Bilinear, SEQ),
    "in-place-ops-and-setitem": (InPlace, SEQ),
    "where-masked-fill": (Masks, SEQ),
    "gather-scatter-index": (Indexing, SEQ),
    "cumsum-sort-topk": (Sorting, SEQ),
    "einsum-bmm-baddbmm": (Products, SEQ),
    "cosine-cdist-normalize": (Distances, SEQ),
}


def _batch(shape, g: torch.Generator) -> torch.Tensor:
    if shape == TOKENS:
        return torch.randint(0, 20, (B, 6), generator=g)
    if shape == "channels_last":
        return torch.randn(*IMAGE, generator=g).to(memory_format=torch.channels_last)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("name", list(ZOO))
def test_torch_nn_modules_train_like_eager_on_the_fast_path(name: str, monkeypatch) -> None:
    monkeypatch.setattr(CONFIG, "disable", True)
    make, shape = ZOO[name]
    pydisc.reset_metrics()
    torch.manual_seed(0)
    ref = make()
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=True)
    # Nesterov momentum and gradients scaled in place between backward and step: both write `.grad`
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True) for m in (ref, model)]
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = _batch(shape, g)
        losses, grads = [], []
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            out = m(x)
            loss = (out ** 2).mean() + out.sum() * 0.01
            loss.backward()
            for p in m.parameters():
                p.grad.mul_(0.5)
            opt.step()
            if m is model:
                pydisc.mark_step()
            losses.append(loss.detach().cpu())
            grads.append([p.grad.cpu() for p in m.parameters()])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for (key, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-6, msg=key)
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(opts[1].state[p]["momentum_buffer"].cpu(), opts[0].state[p_ref]["momentum_buffer"],
                                   rtol=1e-4, atol=1e-6)
    m = pydisc.metrics()
    assert m["fast_segments"] >= 2 and not m["fast_demotions"], m     # the fast path, planned at least once
    assert m["graph_cache_misses"] >= 1, m
