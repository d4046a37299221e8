"""Train a small character-level GPT on Python standard-library source with pydisc and eager side by side.

The text is the source of a few modules of the running Python's standard library, its lines stripped
of their indentation (examples/_data.py); nothing is downloaded. The model is a GPT in miniature:
token and learned position embeddings, pre-norm blocks of causal self-attention (a lower-triangular
mask buffer) and a GELU MLP, a final LayerNorm and an output head tied to the token embedding. Both
copies start from the same weights, see the same batches of fixed context length (one shape, so pydisc
compiles a plan for step 1 and one for step 2, when AdamW's state exists, and reuses it afterwards),
and train with AdamW and gradient clipping.

At the end both models generate text from the same prompt. Generation runs on the *lazy* model in
eval mode under no_grad, one mark_step per token. The input is always a (1, context) window: the
prompt and generated tokens are written left-aligned into it and the next token is read at the last
filled position (causal attention ignores what lies to the right), and once the window is full it
slides. So every token runs the same compiled plan instead of compiling one per prompt length. The
next token is picked on the host from the logits: greedily, then by sampling with a temperature.

Exit status: 1 when the first steps' losses differ by more than 1e-3 relative, or greedy generation
by the pydisc model differs in its first 16 characters from an eager copy with the same trained weights.

    python examples/gpt_char.py                    # ~1-2 minutes on 2 CPU cores
    python examples/gpt_char.py --steps 600 --layers 4 --device cuda
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
from _data import CharVocab, stdlib_text  # noqa: E402

MAX_RELATIVE_LOSS_DIFF = 1e-3
CHECKED_STEPS = 10        # losses compared step by step before rounding drift can build up
CHECKED_GREEDY_CHARS = 16


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        weights = scores.masked_fill(~self.causal[:t, :t], float("-inf")).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, context) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight                     # weight tying
        for name, p in self.named_parameters():                # GPT-2's initialisation
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(data: torch.Tensor, context: int, batch_size: int, steps: int, seed: int = 0):
    """Random windows of context+1 characters: inputs and next-character targets, all one shape."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
        window = torch.stack([data[s: s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def train_step(model, opt, x, y, lazy: bool) -> float:
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if lazy:
        pydisc.mark_step()
    return loss.item()


@torch.no_grad()
def generate(model: GPT, prompt: list[int], length: int, lazy: bool, temperature: float = 0.0,
             seed: int = 0) -> list[int]:
    """Extend `prompt` by `length` tokens; temperature 0 is greedy. The model always sees one
    (1, context) window (see the module docstring), so a lazy model runs one compiled plan per token."""
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(length):
        visible = tokens[-model.context:]
        window = torch.zeros(1, model.context, dtype=torch.long)
        window[0, :len(visible)] = torch.tensor(visible)
        logits = model(window.to(device))
        if lazy:
            pydisc.mark_step()
        last = logits[0].cpu()[len(visible) - 1]     # read on the host: no per-position graph
        if temperature == 0.0:
            tokens.append(int(last.argmax()))
        else:
            tokens.append(int(torch.multinomial(F.softmax(last / temperature, dim=-1), 1, generator=g)))
    model.train()
    return tokens[len(prompt):]


def progress(step: int, steps: int, eager_loss: float, lazy_loss: float, width: int = 30) -> None:
    """A one-line bar redrawn in place; nothing when the output is not a terminal (logs get the table)."""
    if not sys.stdout.isatty():
        return
    done = width * step // steps
    sys.stdout.write("\r[%s%s] %d/%d  eager %.4f  pydisc %.4f" % ("#" * done, "." * (width - done), step, steps,
                                                                  eager_loss, lazy_loss))
    sys.stdout.flush()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--generate", type=int, default=120, help="characters to generate at the end (0: none)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    text = stdlib_text()
    vocab = CharVocab.build(text)
    data = torch.tensor(vocab.encode(text), dtype=torch.long)
    print("data: %d characters of Python standard-library source, %d distinct" % (len(text), len(vocab)))

    torch.manual_seed(0)
    eager = GPT(len(vocab), args.context, args.dim, args.heads, args.layers).to(device)
    lazy = pydisc.lazy(copy.deepcopy(eager), device=device)
    assert lazy.head.weight is lazy.tok.weight, "pydisc.lazy must keep tied weights tied"
    make_opt = lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)  # noqa: E731
    opt_e, opt_l = make_opt(eager.parameters()), make_opt(lazy.parameters())
    n_params = sum(p.numel() for p in eager.parameters())
    print("model: GPT, %d layers, dim %d, %d heads, context %d, %d parameters (head tied to the embedding)"
          % (args.layers, args.dim, args.heads, args.context, n_params))

    losses_e, losses_l, seconds_e, seconds_l, log = [], [], [], [], []
    log_every = max(1, args.steps // 10)
    for step, (x, y) in enumerate(batches(data, args.context, args.batch_size, args.steps), start=1):
        x, y = x.to(device), y.to(device)
        for model, opt, losses, seconds, is_lazy in ((eager, opt_e, losses_e, seconds_e, False),
                                                     (lazy, opt_l, losses_l, seconds_l, True)):
            started = time.perf_counter()
            losses.append(train_step(model, opt, x, y, is_lazy))
            seconds.append(time.perf_counter() - started)
        progress(step, args.steps, losses_e[-1], losses_l[-1])
        if step == 1 or step % log_every == 0 or step == args.steps:
            log.append(step)
    if sys.stdout.isatty():
        print()
    print("%6s  %12s  %12s  %10s" % ("step", "eager loss", "pydisc loss", "|diff|"))
    for step in log:
        e, p = losses_e[step - 1], losses_l[step - 1]
        print("%6d  %12.6f  %12.6f  %10.2e" % (step, e, p, abs(e - p)))
    warm = slice(2, None) if args.steps > 2 else slice(None)
    print("timing: eager %.1f ms/step, pydisc %.1f ms/step (median after 2 warm-up steps); "
          "slowest pydisc step %.1f s (it compiles)" % (1e3 * statistics.median(seconds_e[warm]),
                                                        1e3 * statistics.median(seconds_l[warm]), max(seconds_l)))

    failures = []
    drift = max(abs(e - p) / abs(e) for e, p in list(zip(losses_e, losses_l))[:CHECKED_STEPS])
    if not drift <= MAX_RELATIVE_LOSS_DIFF:
        failures.append("losses diverge (max relative diff %.2e over the first %d steps)" % (drift, CHECKED_STEPS))

    if args.generate:
        prompt_text = "def __init__(self, "
        prompt = vocab.encode(prompt_text)
        # Training drifts apart by rounding over many steps, so generation is checked on the same
        # weights: the pydisc model against an eager copy of its trained state.
        reference = copy.deepcopy(eager)
        reference.load_state_dict({k: v.cpu() for k, v in lazy.state_dict().items()})
        greedy_l = vocab.decode(generate(lazy, prompt, args.generate, lazy=True))
        greedy_r = vocab.decode(generate(reference.to(device), prompt, args.generate, lazy=False))
        greedy_e = vocab.decode(generate(eager, prompt, args.generate, lazy=False))
        sampled = vocab.decode(generate(lazy, prompt, args.generate, lazy=True, temperature=0.8, seed=1))
        print("\ngreedy, pydisc:                     %r" % (prompt_text + greedy_l))
        print("greedy, eager with the same weights: %r" % (prompt_text + greedy_r))
        print("greedy, eager-trained model:         %r" % (prompt_text + greedy_e))
        print("sampled (T=0.8, pydisc):             %r" % (prompt_text + sampled))
        if greedy_l[:CHECKED_GREEDY_CHARS] != greedy_r[:CHECKED_GREEDY_CHARS]:
            failures.append("greedy generation differs from eager on the same weights in the first %d characters"
                            % CHECKED_GREEDY_CHARS)
    print("check: max relative loss diff over the first %d steps %.2e: %s"
          % (CHECKED_STEPS, drift, "FAIL" if failures else "ok"))
    print()
    print(pydisc.metrics_report())
    for failure in failures:
        print("FAILED: " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
