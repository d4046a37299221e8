"""Training and inference workloads, eager PyTorch vs torch.compile vs pydisc, measured side by side.

    python bench/workloads.py                       # every workload, on CUDA when there is a GPU
    python bench/workloads.py --only mlp,cnn,chain  # a subset
    python bench/workloads.py --tiny                # tiny sizes: checks the harness in a minute on a CPU

Each workload runs in its own process (`--one NAME`, killed after `--timeout` seconds; its row then
says so). In that process the three modes are built from one seeded model and run the same batches:

- eager: the model as is;
- torch.compile: `torch.compile(model)` with default options (the optimizer step stays eager);
- pydisc: `pydisc.lazy(model)`, `pydisc.mark_step()` after each step.

Warm-up steps first (they compile, and their wall time is reported as `first steps`), then `--blocks`
blocks of `--block` steps per mode (more for fast steps, so that a block lasts `--min-block-ms`),
the modes taking turns block by block so that they see the same
machine load. A block is timed from one CUDA synchronisation to the next, with no value read in
between (a training loop that logs the loss every step would add a sync per step to all three), and
the row reports the median over blocks of the time per step. pydisc's counters are per measured step:
`clusters` (compiled clusters run), `eager` (ATen ops run by torch: matmuls and convolutions left to
cuBLAS/cuDNN by design, plus fallbacks), `record ms/step (us/entry)` (host time from the start of a step
to its `mark_step()`, per step and per recorded entry: ATen ops through the dispatcher and calls recorded
at `__torch_function__`). The memory-bound chain also reports the bandwidth it
achieves counting one read of its input and one write of its output, against the device's copy
bandwidth (`x.copy_()`, measured in the same process).

The variable-length workloads report the total time of `--varlen-steps` steps including every compile,
against torch.compile with `dynamic=False` (one compile per length, up to its recompile limit) and, as the
mode `torch.compile.dynamic`, with `dynamic=True` (one compile with symbolic sizes; run for these
workloads only); the modes take turns, `--varlen-chunk` steps each, so that they see the same machine
load and process warmth. `bert_varlen_fp32` is the same without autocast (float32, TF32 matmuls).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pydisc  # noqa: E402
from resnet import BasicBlock  # noqa: E402  (examples/resnet.py: the residual block of ResNet-18)


# ---- models -----------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16):
        super().__init__()
        c = channels
        self.features = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(2 * c * 7 * 7, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Block(nn.Module):
    """A post-norm (BERT) or pre-norm causal (GPT-2) transformer layer, attention written out."""

    def __init__(self, dim: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        if self.causal:
            x = x + self.attention(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attention(x))
        return self.ln2(x + self.ffn(x))


class Transformer(nn.Module):
    """BERT-base (causal=False) or GPT-2-small (causal=True) sized: embeddings, layers, tied head."""

    def __init__(self, vocab: int, max_len: int, dim: int, heads: int, layers: int, causal: bool):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads, causal) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class ResNet18(nn.Module):
    def __init__(self, width: int = 64, classes: int = 1000):
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            blocks += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class Chain(nn.Module):
    """x <- x + gelu(layer_norm(x)), `links` times: memory-bound, fusable into one pass."""

    def __init__(self, dim: int, links: int):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(links))

    def forward(self, x):
        for norm in self.norms:
            x = x + F.gelu(norm(x))
        return x


# ---- workloads --------------------------------------------------------------------------------------

@dataclass
class Workload:
    name: str
    title: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[torch.device, int], list]     # (device, seed) -> [batch, ...]
    loss: Callable[[nn.Module, tuple], torch.Tensor] | None = None   # training; None: inference
    forward: Callable[[nn.Module, tuple], torch.Tensor] | None = None
    optimizer: Callable = lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)
    autocast: torch.dtype | None = None
    model_dtype: torch.dtype | None = None
    bytes_moved: Callable[[tuple], int] | None = None   # memory-bound workloads: minimal traffic per step
    varlen: bool = False
    tf32: bool = False          # float32 matmuls and convolutions on tensor cores (TF32), in every mode
    notes: list = field(default_factory=list)
    # torch.compile compiles `model.forward` rather than wrapping the module: HF's `generate()` calls the
    # module's own forward, which a wrapper never sees
    compile_forward: bool = False


def _images(shape, classes):
    def make(device, seed):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(shape, generator=g).to(device), torch.randint(0, classes, (shape[0],), generator=g).to(device))
                for _ in range(4)]
    return make


def _tokens(batch, lengths, vocab):
    def make(device, seed):
        g = torch.Generator().manual_seed(seed)
        out = []
        for t in lengths:
            idx = torch.randint(0, vocab, (batch, t + 1), generator=g)
            out.append((idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)))
        return out
    return make


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lm(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _hf_gpt2(dim: int, layers: int, heads: int, vocab: int, positions: int):
    """transformers' GPT2LMHeadModel, default attention (sdpa) and dropout, random weights."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=dim, n_layer=layers,
                                      n_head=heads, bos_token_id=0, eos_token_id=1))


def _hf_llama(dim: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int):
    """transformers' LlamaForCausalLM (RoPE, grouped-query attention), random weights."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=int(2.6875 * dim),
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, max_position_embeddings=positions,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=2))


def _hf_lm(model, batch):
    x, y = batch
    return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())


def _generate(tokens: int):
    def forward(model, batch):
        return model.generate(batch[0], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=2)
    return forward


def _decode(tokens: int):
    """A hand-written greedy loop over HF's KV cache: the prompt, then one token per forward and one
    `mark_step()` per token for pydisc (a lazy model's forward takes lazy inputs)."""
    def forward(model, batch):
        ids, past = batch[0], None
        lazy = pydisc.is_lazy(next(model.parameters()))
        for _ in range(tokens):
            out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            if lazy:
                pydisc.mark_step()
            ids = torch.cat([ids, token.to(ids.device)], 1)
        return ids[:, -1].float()
    return forward


def workloads(tiny: bool, varlen_lengths: int) -> dict[str, Workload]:
    s = (lambda big, small: small if tiny else big)
    bert = dict(vocab=s(30522, 512), dim=s(768, 64), heads=s(12, 4), layers=s(12, 2))
    gpt = dict(vocab=s(50257, 512), dim=s(768, 64), heads=s(12, 4), layers=s(12, 2))
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)  # noqa: E731
    lengths = [s(128, 32) - 8 * k for k in range(varlen_lengths)]
    chain_rows, chain_dim = s(16384, 512), s(4096, 256)
    items = [
        Workload("mlp", "MNIST MLP 784-128-10, batch 64, SGD", MLP, _images((64, 1, 28, 28), 10), _classify),
        Workload("cnn", "small CNN (2 conv), batch 64, SGD", SmallCNN, _images((64, 1, 28, 28), 10), _classify),
        Workload("bert", "BERT-base encoder, bf16 autocast, batch %d seq %d, AdamW" % (s(32, 4), s(128, 32)),
                 lambda: Transformer(bert["vocab"], 512, bert["dim"], bert["heads"], bert["layers"], False),
                 _tokens(s(32, 4), [s(128, 32)] * 2, bert["vocab"]), _lm, optimizer=adamw,
                 autocast=torch.bfloat16),
        Workload("bert_large_batch", "BERT-base encoder, bf16 autocast, batch %d seq %d, AdamW" % (s(64, 4), s(512, 64)),
                 lambda: Transformer(bert["vocab"], 512, bert["dim"], bert["heads"], bert["layers"], False),
                 _tokens(s(64, 4), [s(512, 64)] * 2, bert["vocab"]), _lm, optimizer=adamw,
                 autocast=torch.bfloat16),
        Workload("bert_varlen", "BERT-base encoder as above, seq %s varying per step" % "/".join(map(str, lengths)),
                 lambda: Transformer(bert["vocab"], 512, bert["dim"], bert["heads"], bert["layers"], False),
                 _tokens(s(32, 4), lengths, bert["vocab"]), _lm, optimizer=adamw, autocast=torch.bfloat16,
                 varlen=True),
        Workload("bert_varlen_fp32", "BERT-base encoder, fp32 (TF32 matmuls), batch %d, seq %s varying per step, AdamW"
                 % (s(32, 4), "/".join(map(str, lengths))),
                 lambda: Transformer(bert["vocab"], 512, bert["dim"], bert["heads"], bert["layers"], False),
                 _tokens(s(32, 4), lengths, bert["vocab"]), _lm, optimizer=adamw, varlen=True, tf32=True),
        Workload("resnet18", "ResNet-18, bf16 autocast, batch %d 3x%d^2, SGD" % (s(32, 4), s(224, 32)),
                 lambda: ResNet18(s(64, 8), s(1000, 10)), _images((s(32, 4), 3, s(224, 32), s(224, 32)), s(1000, 10)),
                 _classify, autocast=torch.bfloat16),
        Workload("gpt2_infer", "GPT-2-small decoder inference, bf16, batch %d seq %d" % (s(8, 2), s(1024, 64)),
                 lambda: Transformer(gpt["vocab"], 1024, gpt["dim"], gpt["heads"], gpt["layers"], True),
                 _tokens(s(8, 2), [s(1024, 64)] * 2, gpt["vocab"]), forward=lambda m, b: m(b[0]),
                 model_dtype=torch.bfloat16),
        Workload("gpt2_train", "GPT-2-small decoder training, bf16 autocast, batch %d seq %d, AdamW" % (s(16, 2), s(1024, 64)),
                 lambda: Transformer(gpt["vocab"], 1024, gpt["dim"], gpt["heads"], gpt["layers"], True),
                 _tokens(s(16, 2), [s(1024, 64)] * 2, gpt["vocab"]), _lm, optimizer=adamw, autocast=torch.bfloat16),
        Workload("hf_gpt2_train", "HF GPT2LMHeadModel (GPT-2-small config, sdpa, dropout 0.1), bf16 autocast, "
                 "batch %d seq %d, AdamW" % (s(8, 2), s(512, 32)),
                 lambda: _hf_gpt2(gpt["dim"], gpt["layers"], gpt["heads"], gpt["vocab"], 1024),
                 _tokens(s(8, 2), [s(512, 32)] * 2, gpt["vocab"]), _hf_lm, optimizer=adamw, autocast=torch.bfloat16),
        Workload("hf_gpt2_generate", "HF GPT2LMHeadModel (GPT-2-small config), bf16, generate() %d new tokens "
                 "greedy, batch 1, prompt 16" % s(128, 8),
                 lambda: _hf_gpt2(gpt["dim"], gpt["layers"], gpt["heads"], gpt["vocab"], 1024).eval(),
                 _tokens(1, [16] * 2, gpt["vocab"]), forward=_generate(s(128, 8)), model_dtype=torch.bfloat16,
                 compile_forward=True),
        Workload("llama_decode", "HF LlamaForCausalLM (dim %d, %d layers, GQA 16/4 heads), bf16, KV-cache decode "
                 "loop %d tokens, batch 1" % (s(1024, 64), s(8, 2), s(128, 8)),
                 lambda: _hf_llama(s(1024, 64), s(8, 2), s(16, 4), s(4, 2), s(32000, 512), 2048).eval(),
                 _tokens(1, [16] * 2, s(32000, 512)), forward=_decode(s(128, 8)), model_dtype=torch.bfloat16,
                 compile_forward=True),
        Workload("chain", "LayerNorm+GELU+residual x4, %dx%d f32, inference" % (chain_rows, chain_dim),
                 lambda: Chain(chain_dim, 4), lambda device, seed: [(torch.randn(chain_rows, chain_dim, device=device),)] * 2,
                 forward=lambda m, b: m(b[0]), bytes_moved=lambda b: 2 * b[0].numel() * b[0].element_size()),
    ]
    return {w.name: w for w in items}


# ---- one workload, in its own process ---------------------------------------------------------------

MODES = ("eager", "torch.compile", "torch.compile.dynamic", "pydisc")

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Mode:
    """One way of running a workload: its model, optimizer and step function."""

    def __init__(self, name: str, w: Workload, base: nn.Module, device: torch.device):
        self.name, self.w, self.device = name, w, device
        model = copy.deepcopy(base)
        if name == "pydisc":
            model = pydisc.lazy(model, device=device)
        self.model = model
        self.run_model = model
        if name == "torch.compile" and w.compile_forward:
            model.forward = torch.compile(model.forward)
        elif name == "torch.compile":
            self.run_model = torch.compile(model, dynamic=False if w.varlen else None)
        elif name == "torch.compile.dynamic":
            self.run_model = torch.compile(model, dynamic=True)
        self.opt = w.optimizer(model.parameters()) if w.loss is not None else None
        self.last = None
        self.record_seconds = 0.0
        self.recorded_steps = 0

    def step(self, batch) -> None:
        w = self.w
        started = time.perf_counter()
        if self.name == "pydisc" and w.varlen:
            batch = tuple(pydisc.to_lazy(t) for t in batch)   # sizes that vary: through to_lazy
        if w.loss is None:
            with torch.no_grad():
                self.last = w.forward(self.run_model, batch)
        else:
            with torch.autocast(self.device.type, dtype=w.autocast, enabled=w.autocast is not None):
                loss = w.loss(self.run_model, batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.last = loss.detach()
        if self.name == "pydisc":
            self.record_seconds += time.perf_counter() - started
            self.recorded_steps += 1
            pydisc.mark_step()

    def value(self) -> float:
        v = self.last
        return float(v.float().mean().item() if v.dim() else v.item())


def varlen_order(batches: list, steps: int) -> list:
    """`steps` batches: every length once in each round of `len(batches)`, in an order shuffled per round
    (seeded), so no length follows the same one every time. (The order before, `(5k + k // 3) % 4`, never
    took the fourth length: the 128/120/112/104 rows until 2026-12-06 ran 128/120/112 only.)"""
    rng = random.Random(0)
    order: list = []
    while len(order) < steps:
        round_ = list(batches)
        rng.shuffle(round_)
        order += round_
    return order[:steps]


def _block_steps(modes: list, batches: list, device: torch.device, args) -> int:
    """Steps per timed block: `--block`, or more where a block of them would last less than
    `--min-block-ms`. A block starts after a synchronisation, as a training loop's steps do after it
    logs a value: a lazy step's recording overlaps the device's work on the step before, except for the
    block's first step, which records while the device idles; blocks of 4 steps (the default until
    2026-12-01, 25 ms minimum) charged BERT-base b64 one un-overlapped ~60 ms recording per 4 steps
    (0.86x eager, against 0.80x in blocks of 1 s). And a 1 ms MLP step timed in blocks of 4 read
    1.03-1.17x between identical runs: the synchronisation and the timer weigh on a 4 ms block. Every
    mode runs one untimed block, so that all take the same steps; the fastest sets the size."""
    if not modes:
        return args.block
    fastest = float("inf")
    for m in modes:
        _sync(device)
        t = time.perf_counter()
        for k in range(args.block):
            m.step(batches[k % len(batches)])
        _sync(device)
        fastest = min(fastest, (time.perf_counter() - t) / args.block)
    return max(args.block, math.ceil(args.min_block_ms / 1e3 / max(fastest, 1e-6)))


def _copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second): the best of 5 rounds of 20
    copies of 256 MiB (one round in a busy process read 1.2 TB/s where the others read 3.5-4.1)."""
    x = torch.ones(256 * 2 ** 20 // 4, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        for _ in range(20):
            y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 20 * 2 * x.numel() * 4 / best


def _profile(m: Mode, batches: list, steps: int, path: Path) -> dict:
    """`steps` steps of `m` under torch.profiler: the GPU kernels by total time, written to `path`.
    IREE's kernels are named `<module>_dispatch_<n>_<kind>_<shape>`; the rest are torch's."""
    from torch.profiler import ProfilerActivity, profile
    for k in range(2):
        m.step(batches[k % len(batches)])
    _sync(m.device)
    trace = str(path) + ".trace.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for k in range(steps):
            m.step(batches[k % len(batches)])
        _sync(m.device)
        wall = (time.perf_counter() - t) / steps
    prof.export_chrome_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    os.remove(trace)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:     # the union of the kernels' intervals: time the GPU was doing something
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name: dict[str, list] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(e["dur"])
    iree = sum(sum(d) for n, d in by_name.items() if "_dispatch_" in n)
    total = sum(sum(d) for d in by_name.values())
    summary = {"wall ms": 1e3 * wall, "gpu busy ms": busy / 1e3 / steps, "kernels": len(kernels) / steps,
               "iree ms": iree / 1e3 / steps, "torch ms": (total - iree) / 1e3 / steps}
    lines = ["%s %s: %d steps, per step: wall %.2f ms, GPU busy %.2f ms, %d kernels, IREE %.2f ms, torch %.2f ms"
             % (m.w.name, m.name, steps, summary["wall ms"], summary["gpu busy ms"], summary["kernels"],
                summary["iree ms"], summary["torch ms"]), "",
             "| kernel | calls/step | us each | ms/step | share |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append("| %s | %.1f | %.1f | %.3f | %.1f%% |" % (name[:110], len(durs) / steps, sum(durs) / len(durs),
                                                           sum(durs) / 1e3 / steps, 100 * sum(durs) / total))
    path.write_text("\n".join(lines) + "\n")
    _host_profile(m, batches, steps, Path(str(path)[: -len(".md")] + ".host.txt"))
    return summary


def _host_profile(m: Mode, batches: list, steps: int, path: Path) -> None:
    """Where the host's time goes over `steps` steps: Python functions by cumulative and own time."""
    import cProfile
    import io
    import pstats
    host = cProfile.Profile()
    host.enable()
    for k in range(steps):
        m.step(batches[k % len(batches)])
    _sync(m.device)
    host.disable()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def _progress(line: str) -> None:
    """A line on stderr, so that a run cut by --timeout still says how far it got (kept in the .log)."""
    print(line, file=sys.stderr, flush=True)


def run_one(name: str, args) -> dict:
    device = torch.device(args.device)
    w = workloads(args.tiny, args.varlen_lengths)[name]
    if w.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    base = w.make_model()
    if w.model_dtype is not None:
        base = base.to(w.model_dtype)
    base = base.to(device)
    batches = w.batches(device, 0)
    # torch.compile.dynamic only where sizes vary: elsewhere torch.compile's default marks a dim dynamic
    # once it sees it change, and no size changes
    modes = [Mode(m, w, base, device) for m in MODES if m in args.modes.split(",")
             and (w.varlen or m != "torch.compile.dynamic")]
    row = {"name": name, "title": w.title, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else "cpu", "torch": torch.__version__}
    warm_choices = []    # clusters measured during the warm-up (metrics are reset after it)
    warm = {"cuda_graph_captures": 0, "cuda_graph_fallbacks": {}}
    live = []            # the modes that ran; one that raises is reported and left out of the timing

    def failed(m: Mode, exc: BaseException) -> None:
        row["failed " + m.name] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0][:200]
                                              if str(exc).strip() else "")

    if w.varlen:
        # The modes take turns, `--varlen-chunk` steps each, and each mode's time is the sum of its
        # chunks: one mode's 200 steps after another's ran 3-6% faster on the H200's host than the same
        # steps before them, in either order.
        order = varlen_order(batches, args.varlen_steps)
        pydisc.reset_metrics()
        live = list(modes)
        spent = {m.name: 0.0 for m in modes}
        turns = {m.name: [] for m in modes}      # each turn's time per step
        compile_wait = 0.0
        for start in range(0, len(order), args.varlen_chunk):
            for m in list(live):
                try:
                    if m.name != "pydisc":
                        # pydisc's plans built in the background (PYDISC_BACKGROUND_COMPILE) finish outside
                        # every turn: its compile threads slowed the eager turns after them (H100: 65 ms a
                        # step against 23 ms on a quiet host). Alone, pydisc's later steps would overlap them.
                        t = time.perf_counter()
                        pydisc.wait_for_compiles()
                        compile_wait += time.perf_counter() - t
                    _sync(device)
                    t = time.perf_counter()
                    for b in order[start:start + args.varlen_chunk]:
                        m.step(b)
                    if start + args.varlen_chunk >= len(order):
                        m.value()       # the last chunk ends with a read of the loss, as a loop would
                    _sync(device)
                except Exception as exc:
                    failed(m, exc)
                    live.remove(m)
                    continue
                spent[m.name] += time.perf_counter() - t
                turns[m.name].append((time.perf_counter() - t) / len(order[start:start + args.varlen_chunk]))
        for m in live:
            row[m.name] = spent[m.name] / len(order)
            # the steady state, once every length has compiled: the last half of the turns, but the very last
            # (it ends with a read)
            late = turns[m.name][len(turns[m.name]) // 2:-1] or turns[m.name][-1:]
            row["late " + m.name] = sum(late) / len(late)
            row["loss " + m.name] = m.value()
            _progress("%s: %s %.1f s" % (name, m.name, spent[m.name]))
        row["steps"] = len(order)
        row["compile wait s"] = compile_wait
    else:
        for m in modes:
            try:
                t = time.perf_counter()
                for k in range(args.warmup):
                    m.step(batches[k % len(batches)])
                    if m.name == "pydisc" and k == 4:
                        # plans built in the background (PYDISC_BACKGROUND_COMPILE): the steps so far ran
                        # eagerly; wait for them, so that the rest of the warm-up measures the whole steps
                        pydisc.wait_for_compiles()
                m.value()
                _sync(device)
            except Exception as exc:
                failed(m, exc)
                continue
            row["first steps " + m.name] = time.perf_counter() - t
            _progress("%s: warm-up %s %.1f s" % (name, m.name, row["first steps " + m.name]))
            live.append(m)
        warm = pydisc.metrics()
        warm_choices = list(warm["speed_choices"])
        row["step choice"] = warm["step_choice"]
        row["compiles"] = warm["compiles"]
        row["disk cache hits"] = warm["disk_cache_hits"]
        pydisc.reset_metrics()
        for m in live:
            m.record_seconds = 0.0
            m.recorded_steps = 0
        times = {m.name: [] for m in live}
        steps = _block_steps(live, batches, device, args)
        for block in range(args.blocks):
            for m in live:
                _sync(device)
                t = time.perf_counter()
                for k in range(steps):
                    m.step(batches[k % len(batches)])
                _sync(device)
                times[m.name].append((time.perf_counter() - t) / steps)
        for m in live:
            row[m.name] = statistics.median(times[m.name])
            row["loss " + m.name] = m.value()
        row["steps"] = args.blocks * steps
    met = pydisc.metrics()
    steps = max(1, met["steps"])
    row["clusters/step"] = met["executions"] / steps
    row["eager/step"] = (sum(met["fallback_ops"].values()) + sum(met["library_ops"].values())) / steps
    row["fallbacks/step"] = sum(met["fallback_ops"].values()) / steps
    # (none where the steps ran eagerly: their time is not recording)
    # the entries: ATen ops through the dispatcher and calls recorded at __torch_function__
    entries = met["recorded_ops"] + met.get("fast_entries", 0)
    record_s = sum(m.record_seconds for m in modes if m.name == "pydisc")
    record_steps = sum(m.recorded_steps for m in modes if m.name == "pydisc")
    row["record ms/step"] = 1e3 * record_s / record_steps if record_steps and entries else None
    row["record us/entry"] = 1e6 * record_s / entries if entries else None
    row.setdefault("compiles", met["compiles"])
    row.setdefault("disk cache hits", met["disk_cache_hits"])
    row["plans"] = met["plans_compiled"]
    row["direct_launch_fallbacks"] = sum(met["direct_launch_fallbacks"].values())
    row["cuda graphs"] = "%d captured, %d replays%s" % (
        warm["cuda_graph_captures"] + met["cuda_graph_captures"], met["cuda_graph_replays"],
        "; not captured: %s" % {**warm["cuda_graph_fallbacks"], **met["cuda_graph_fallbacks"]}
        if met["cuda_graph_fallbacks"] or warm["cuda_graph_fallbacks"] else "")
    row["speed_choices"] = warm_choices + met["speed_choices"]
    row["step choice"] = met["step_choice"] or row.get("step choice", "")
    row["steps while compiling"] = met["steps_while_compiling"]
    row["fallback ops"] = dict(sorted(met["fallback_ops"].items(), key=lambda kv: -kv[1])[:5])
    row["recorded ops/step"] = met["recorded_ops"] / steps
    # PYDISC_FAST_RECORD=1: forwards recorded at __torch_function__, and those re-recorded op by op
    row["fast segments"] = met.get("fast_segments", 0)
    row["fast demotions"] = dict(met.get("fast_demotions", {}))
    if args.profile:
        # after the timing: the profiler's own cost stays out of the table
        os.makedirs(args.profile, exist_ok=True)
        for m in live:
            row["profile " + m.name] = _profile(m, batches, args.profile_steps,
                                                Path(args.profile) / ("%s.%s.md" % (name, m.name)))
    if w.bytes_moved is not None:
        moved = w.bytes_moved(batches[0])
        row["GB/s"] = {m.name: moved / row[m.name] / 1e9 for m in live}
        row["copy GB/s"] = _copy_bandwidth(device) / 1e9
    return row


# ---- the table ----------------------------------------------------------------------------------------

def _ms(v):
    return "%.2f" % (1e3 * v) if isinstance(v, float) else "-"


def table(rows: list[dict]) -> str:
    out = ["| workload | eager ms | torch.compile ms | pydisc ms | pydisc/eager | pydisc/compile | first steps s "
           "(eager / compile / pydisc) | clusters/step | eager ops/step (fallbacks) | record ms/step (us/entry) | "
           "compiles (disk cache) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    notes = []
    for r in rows:
        if "error" in r:
            out.append("| %s | %s |  |  |  |  |  |  |  |  |  |" % (r["title"], r["error"]))
            continue
        e, c, p = r.get("eager"), r.get("torch.compile"), r.get("pydisc")
        first = " / ".join("%.1f" % r["first steps " + m] if "first steps " + m in r else "-"
                           for m in ("eager", "torch.compile", "pydisc"))
        if r["name"].startswith("bert_varlen"):
            first = "(included: %d steps)" % r["steps"]
            totals = ", ".join("%s %.1f s" % (m, r[m] * r["steps"]) for m in MODES if isinstance(r.get(m), float))
            notes.append("- %s: %d steps in all, compiles included: %s%s" % (
                r["name"], r["steps"], totals, "; pydisc's background compiles waited for outside the turns: "
                "%.1f s" % r["compile wait s"] if r.get("compile wait s") else ""))
            late = ", ".join("%s %.2f ms" % (m, 1e3 * r["late " + m]) for m in MODES if "late " + m in r)
            if late:
                notes.append("- %s: per step in the last half of the turns (all compiled by then): %s" % (r["name"], late))
        ratio = (lambda a, b: "%.2f" % (a / b) if a and b else "-")
        # steps run eagerly (kept so by the step choice, or while plans were built in the background)
        # record (almost) nothing: their time per op is not recording
        eager_steps = "-> eager" in r.get("step choice", "") or r.get("steps while compiling")
        record = "-" if eager_steps or r.get("record ms/step") is None else \
            "%.2f (%.1f)" % (r["record ms/step"], r["record us/entry"])
        out.append("| %s | %s | %s | %s | %s | %s | %s | %.1f | %.1f (%.1f) | %s | %d (%d) |" % (
            r["title"], _ms(e), _ms(c), _ms(p), ratio(p, e), ratio(p, c), first, r["clusters/step"], r["eager/step"],
            r["fallbacks/step"], record, r["compiles"], r["disk cache hits"]))
        if r.get("fast segments") or r.get("fast demotions"):
            notes.append("- %s: fast recorder: %d forwards recorded at __torch_function__, demoted %s" % (
                r["name"], r["fast segments"], r["fast demotions"] or "none"))
        for m in MODES:
            if "failed " + m in r:
                notes.append("- %s: %s failed: %s" % (r["name"], m, r["failed " + m]))
        if "GB/s" in r:
            g = r["GB/s"]
            gbs = " / ".join("%.0f" % g[m] if m in g else "-" for m in ("eager", "torch.compile", "pydisc"))
            notes.append("- %s: %s GB/s (eager / torch.compile / pydisc) counting one read and one write; copy "
                         "bandwidth %.0f GB/s%s" % (r["name"], gbs, r["copy GB/s"], ", pydisc at %.0f%% of it" % (
                             100 * g["pydisc"] / r["copy GB/s"]) if "pydisc" in g else ""))
        if r["fallback ops"]:
            notes.append("- %s: fallbacks %s" % (r["name"], r["fallback ops"]))
        if r.get("step choice"):
            notes.append("- %s: whole steps (PYDISC_STEP_CHOICE): %s" % (r["name"], r["step choice"]))
        kept_eager = [c for c in r.get("speed_choices", []) if c.endswith("-> eager")]
        if kept_eager:
            notes.append("- %s: %d of %d measured clusters kept eager (faster), e.g. %s" % (
                r["name"], len(kept_eager), len(r["speed_choices"]), kept_eager[0]))
        if r.get("direct_launch_fallbacks"):
            notes.append("- %s: %d modules ran through IREE's runtime" % (r["name"], r["direct_launch_fallbacks"]))
        if r.get("cuda graphs", "0 captured, 0 replays") != "0 captured, 0 replays":
            notes.append("- %s: CUDA graphs: %s" % (r["name"], r["cuda graphs"]))
        losses = ", ".join("%s %.4g" % (m, r["loss " + m]) for m in MODES if "loss " + m in r)
        notes.append("- %s: last value %s" % (r["name"], losses))
    return "\n".join(out + [""] + notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="", help="comma-separated workloads (default: all): " +
                   ", ".join(workloads(True, 1)))
    p.add_argument("--tiny", action="store_true", help="tiny sizes, to check the harness")
    p.add_argument("--warmup", type=int, default=30, help="steps before timing: pydisc runs a new graph eagerly "
                   "once, compiles it on its 2nd run, measures its clusters (their 2nd call) and, with "
                   "PYDISC_STEP_CHOICE, whole steps (4 windows of 1 + 4 steps: done by step 29)")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--min-block-ms", type=float, default=1000.0, help="more steps per block where --block "
                   "steps last less than this: a training loop synchronises when it logs, not every few "
                   "steps (and fast steps: less timer and synchronisation noise)")
    p.add_argument("--varlen-steps", type=int, default=200)
    p.add_argument("--varlen-lengths", type=int, default=4, help="distinct sequence lengths (128, 120, ...)")
    p.add_argument("--varlen-chunk", type=int, default=25, help="variable lengths: steps per mode per turn")
    p.add_argument("--modes", default=",".join(MODES), help="which of %s to run (the table reads '-' for the "
                   "others; torch.compile.dynamic runs for the variable-length workloads only)" % ", ".join(MODES))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per workload")
    p.add_argument("--json", default="", help="append each row as a JSON line to this file")
    p.add_argument("--profile", default="", help="after timing, profile each mode's steps (torch.profiler) and "
                   "write its GPU kernels by time to this folder (with PYDISC_STEP_CHOICE=off, pydisc's compiled "
                   "steps, not the eager ones a measured choice may keep)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--render", default="", help="print the table of the JSON lines in this file, run nothing")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        rows = [json.loads(line) for line in open(args.render) if line.strip()]
        print(table(rows))
        return 0
    if args.one:
        print("ROW " + json.dumps(run_one(args.one, args)), flush=True)
        return 0
    names = [n for n in args.only.split(",") if n] or list(workloads(True, 1))
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--only")]
    rows = []
    for name in names:
        started = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + [a for a in forwarded if a != args.only]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if args.json:
                Path(args.json + "." + name + ".log").write_text(done.stdout + done.stderr)
            line = next((l for l in done.stdout.splitlines() if l.startswith("ROW ")), None)
            row = json.loads(line[4:]) if line else {
                "name": name, "title": name, "error": "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
        except subprocess.TimeoutExpired as exc:
            row = {"name": name, "title": name, "error": "not finished in %.0f s" % args.timeout}
            if args.json:
                text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                Path(args.json + "." + name + ".log").write_text(text(exc.stdout) + text(exc.stderr))
        row["wall s"] = time.perf_counter() - started
        rows.append(row)
        print("%s: %.0f s" % (name, row["wall s"]), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print("%s, torch %s, %s" % (rows[0].get("device", args.device) if rows else args.device, torch.__version__,
                                time.strftime("%Y-%m-%d")))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
