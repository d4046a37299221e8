"""Train a small BERT-style encoder with masked-language modelling, pydisc and eager side by side.

The sentences are docstring and comment lines of a few standard-library modules (examples/_data.py),
split into lowercase words; nothing is downloaded. The encoder has token and position embeddings, a
padding attention mask, dropout, post-norm LayerNorm blocks with a GELU feed-forward network, and an
MLM head tied to the token embedding. 15% of the real tokens of every sentence are selected (80% of
them replaced by [MASK], 10% by a random word, 10% kept) and predicted; AdamW with linear warm-up.

Batches are padded to their longest sentence, so the sequence length changes every step: the
dynamic-shape showcase. pydisc sees the length change, records one step with a symbolic length and
compiles it once; every later length reuses that executable (the metrics report counts templates,
matches and the steps that ran eagerly while switching). `--bucket 16` rounds lengths up instead.
The labels enter the step through `pydisc.to_lazy`, so that their length can vary too.

Dropout draws random numbers, and pydisc and eager draw them from different streams, so with dropout
on the two copies see different masks every step and their losses differ step by step. Hence two modes:

    python examples/bert_mlm.py                   # check: dropout 0.0, losses compared step by step
                                                  # (exit 1 when the first steps differ by > 1e-3)
    python examples/bert_mlm.py --dropout 0.1     # convergence with dropout on: both curves must fall
                                                  # (exit 1 unless both final losses beat the first ones
                                                  # and stay within 10% of each other)
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
from _data import stdlib_sentences  # noqa: E402

PAD, MASK, UNK = 0, 1, 2
SPECIALS = ["[PAD]", "[MASK]", "[UNK]"]
IGNORE = -100
MAX_RELATIVE_LOSS_DIFF = 1e-3
CHECKED_STEPS = 10
MAX_FINAL_LOSS_RATIO = 1.10     # with dropout on: the two smoothed final losses agree within 10%


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn_drop, self.drop = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        # key_padding: (b, 1, 1, t), True at [PAD] keys; every sentence has real tokens, so no row is all -inf
        weights = self.attn_drop(scores.masked_fill(key_padding, float("-inf")).softmax(dim=-1))
        x = self.ln1(x + self.drop(self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))))
        return self.ln2(x + self.drop(self.ffn(x)))


class BertMLM(nn.Module):
    def __init__(self, vocab: int, max_len: int, dim: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, dim)
        self.emb_ln, self.emb_drop = nn.LayerNorm(dim), nn.Dropout(dropout)
        self.layers = nn.ModuleList(EncoderLayer(dim, heads, dropout) for _ in range(layers))
        self.head_transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.tok.weight                     # tied, as in BERT
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        key_padding = (ids == PAD)[:, None, None, :]
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        x = self.emb_drop(self.emb_ln(x))
        for layer in self.layers:
            x = layer(x, key_padding)
        return self.head(self.head_transform(x))


def build_vocab(sentences: list[list[str]], min_count: int) -> dict[str, int]:
    counts = Counter(w for s in sentences for w in s)
    words = sorted(w for w, c in counts.items() if c >= min_count)
    return {w: i for i, w in enumerate(SPECIALS + words)}


def make_batches(sentences: list[list[int]], vocab_size: int, batch_size: int, steps: int, bucket: int,
                 seed: int = 0):
    """`steps` masked batches: (ids, labels), padded to the batch's longest sentence rounded up to a
    multiple of `bucket`. Masking is drawn here, on the host, so both copies see identical batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(sentences), generator=g).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):   # drop the last partial batch
            chosen = [sentences[j] for j in order[i: i + batch_size]]
            length = bucket * math.ceil(max(map(len, chosen)) / bucket)
            ids = torch.full((batch_size, length), PAD, dtype=torch.long)
            for row, s in enumerate(chosen):
                ids[row, :len(s)] = torch.tensor(s)
            real = ids != PAD
            selected = real & (torch.rand(ids.shape, generator=g) < 0.15)
            for row in range(batch_size):                       # at least one prediction per sentence
                if not selected[row].any():
                    selected[row, torch.randint(0, len(chosen[row]), (1,), generator=g)] = True
            labels = torch.where(selected, ids, torch.full_like(ids, IGNORE))
            action = torch.rand(ids.shape, generator=g)
            random_words = torch.randint(len(SPECIALS), vocab_size, ids.shape, generator=g)
            ids = torch.where(selected & (action < 0.8), torch.full_like(ids, MASK), ids)
            ids = torch.where(selected & (action >= 0.8) & (action < 0.9), random_words, ids)
            out.append((ids, labels))
            if len(out) == steps:
                break
    return out


def train_step(model, opt, sched, ids, labels, lazy: bool) -> float:
    if lazy:
        labels = pydisc.to_lazy(labels)    # a step input like `ids`: its length may vary
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    if lazy:
        pydisc.mark_step()
    return loss.item()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="0.0 (default): step-by-step check against eager; > 0: convergence check")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-words", type=int, default=32)
    p.add_argument("--bucket", type=int, default=1, help="pad lengths up to a multiple of this")
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    words = stdlib_sentences(max_words=args.max_words)
    vocab = build_vocab(words, min_count=2)
    sentences = [[vocab.get(w, UNK) for w in s] for s in words]
    batches = make_batches(sentences, len(vocab), args.batch_size, args.steps, args.bucket)
    lengths = Counter(ids.shape[1] for ids, _ in batches)
    print("data: %d sentences from standard-library docstrings and comments, vocabulary %d words"
          % (len(sentences), len(vocab)))
    print("padded lengths: %d distinct, %d..%d" % (len(lengths), min(lengths), max(lengths)))

    max_len = args.bucket * math.ceil(args.max_words / args.bucket)
    torch.manual_seed(0)
    eager = BertMLM(len(vocab), max_len, args.dim, args.heads, args.layers, args.dropout).to(device)
    lazy = pydisc.lazy(copy.deepcopy(eager), device=device)
    warmup = max(1, args.steps // 10)
    schedule = lambda step: min(1.0, (step + 1) / warmup)  # noqa: E731
    copies = []
    for model in (eager, lazy):
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        copies.append((model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)))
    print("model: %d layers, dim %d, dropout %.2f, %d parameters; AdamW lr %g, %d warm-up steps"
          % (args.layers, args.dim, args.dropout, sum(p.numel() for p in eager.parameters()), args.lr, warmup))

    losses_e, losses_l, seconds_e, seconds_l = [], [], [], []
    log_every = max(1, args.steps // 10)
    print("%6s  %6s  %12s  %12s  %10s" % ("step", "length", "eager loss", "pydisc loss", "|diff|"))
    for step, (ids, labels) in enumerate(batches, start=1):
        ids, labels = ids.to(device), labels.to(device)
        for (model, opt, sched), losses, seconds, is_lazy in zip(copies, (losses_e, losses_l),
                                                                 (seconds_e, seconds_l), (False, True)):
            started = time.perf_counter()
            losses.append(train_step(model, opt, sched, ids, labels, is_lazy))
            seconds.append(time.perf_counter() - started)
        if step == 1 or step % log_every == 0 or step == args.steps:
            e, p = losses_e[-1], losses_l[-1]
            print("%6d  %6d  %12.6f  %12.6f  %10.2e" % (step, ids.shape[1], e, p, abs(e - p)))
    warm = slice(args.steps // 5, None) if args.steps >= 10 else slice(None)
    print("timing: eager %.1f ms/step, pydisc %.1f ms/step (median of the last 80%% of steps)"
          % (1e3 * statistics.median(seconds_e[warm]), 1e3 * statistics.median(seconds_l[warm])))

    failures = []
    if args.dropout == 0.0:
        drift = max(abs(e - p) / abs(e) for e, p in list(zip(losses_e, losses_l))[:CHECKED_STEPS])
        ok = drift <= MAX_RELATIVE_LOSS_DIFF
        print("check (dropout off): max relative loss diff over the first %d steps %.2e: %s"
              % (CHECKED_STEPS, drift, "ok" if ok else "FAIL"))
        if not ok:
            failures.append("losses diverge (max relative diff %.2e)" % drift)
    else:
        window = max(1, min(10, args.steps // 4))
        first_e, first_l = statistics.mean(losses_e[:window]), statistics.mean(losses_l[:window])
        last_e, last_l = statistics.mean(losses_e[-window:]), statistics.mean(losses_l[-window:])
        ratio = max(last_e, last_l) / min(last_e, last_l)
        print("check (dropout %.2f): mean loss of the first/last %d steps: eager %.3f -> %.3f, "
              "pydisc %.3f -> %.3f (final ratio %.3f)" % (args.dropout, window, first_e, last_e, first_l, last_l, ratio))
        if args.steps >= 20:   # a few steps cannot show convergence; they still show both run
            if not (last_e < first_e and last_l < first_l):
                failures.append("loss did not fall with dropout on")
            if not ratio <= MAX_FINAL_LOSS_RATIO:
                failures.append("final losses differ by more than %d%%" % round(100 * (MAX_FINAL_LOSS_RATIO - 1)))
    print()
    print(pydisc.metrics_report())
    for failure in failures:
        print("FAILED: " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
