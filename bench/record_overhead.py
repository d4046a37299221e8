"""What recording costs: microseconds per recorded ATen op, against eager PyTorch's cost per ATen op.

For each model, one training step (forward, backward, SGD with momentum or `--optimizer adamw`) is timed two ways on CPU:
  - pydisc: from the start of the step until just before `mark_step()` (recording only), divided by
    the step's recorded entries (ATen ops through the dispatcher, plus the calls recorded at
    `__torch_function__` on the fast path, docs/fast_recording.md); `mark_step()` on the warm plan (plan
    cache hit) is timed on its own; both recording paths side by side unless `--fast on|off`. With
    PYDISC_ASYNC on (the default) a step's compiled run goes to a worker thread and `mark_step()` returns;
    the next `mark_step()` waits for it (the `wait` column), so record + mark_step per step is the
    step's wall time in a training loop;
  - eager: the whole step, divided by the number of ATen ops it runs (counted once with a
    TorchDispatchMode, so the count includes the ops autograd runs in backward).
Medians over repeats after warm-up steps (which also compile the pydisc plans); `--stat min` takes the
fastest step instead, the better figure on a machine shared with other jobs (their load only ever adds
time). Eager and pydisc take turns in blocks of 10 steps, so the ratios see the same load; the last
column is the ratio of a pydisc block's wall time (up to `pydisc.synchronize()` after its last step) to
the eager block's before it, the median taken over blocks (with `--stat min`, the fastest pydisc block
over the fastest eager block).

The last column, the floor, is what the step's own Python costs (module calls, the optimizer's code,
autograd's API) when every torch call returns at once a result prepared for it (`_Prepared`): the least
any recorder at `__torch_function__` can cost, against the eager step, taking turns with it too.

    python bench/record_overhead.py [--repeats 50] [--stat median|min] [--fast both|on|off]
        [--models mlp,block,gpt-char,bert-mlm,bert-mlm-dropout,hf-gpt2,hf-gpt2-dropout] [--optimizer sgd|adamw]
    PYDISC_ASYNC=0 python bench/record_overhead.py ...     # mark_step returns when the step has run
    python bench/record_overhead.py --compare-async --repeats 15 --models ...   # both, taking turns
    python bench/record_overhead.py --phases --repeats 200 --models ...   # each phase: eager, floor, pydisc
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# Lets `python bench/record_overhead.py` run from a checkout without installing pydisc (and import examples/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Recording is what is timed: the measured step choice would switch these small CPU steps to eager.
os.environ.setdefault("PYDISC_STEP_CHOICE", "off")
import pydisc  # noqa: E402
from pydisc.driver import inflight  # noqa: E402
from pydisc.metrics import METRICS  # noqa: E402  (counters read without waiting for a step in flight)


class MLP(nn.Module):
    def __init__(self, width: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """A pre-norm transformer block written with plain torch ops (no fused attention kernel)."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, s, d))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x.mean(dim=1))


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


def _hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=y).loss


def _gpt_char() -> nn.Module:
    from examples.gpt_char import GPT
    return GPT(vocab=65, context=32, dim=64, heads=4, layers=2)


def _bert_mlm(dropout: float = 0.0) -> nn.Module:
    from examples.bert_mlm import BertMLM
    return BertMLM(vocab=96, max_len=32, dim=64, heads=4, layers=2, dropout=dropout)


def _hf_gpt2(dropout: float = 0.0) -> nn.Module:
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)      # default attention (sdpa)


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    vocab: int = 0                 # token inputs in [0, vocab) (labels alike), else float inputs, 10 classes
    loss: Callable = _cross_entropy


WORKLOADS = {"mlp": Workload("mlp 64-256-256-10, batch 64", MLP, (64, 64)),
             "block": Workload("transformer block d64 h4, 8x32 tokens", Block, (8, 32, 64)),
             "gpt-char": Workload("examples/gpt_char.py GPT d64 2 layers, 8x32 tokens", _gpt_char, (8, 32), 65),
             "bert-mlm": Workload("examples/bert_mlm.py BERT d64 2 layers, 8x32 tokens", _bert_mlm, (8, 32), 96),
             "bert-mlm-dropout": Workload("examples/bert_mlm.py as above, dropout 0.1", lambda: _bert_mlm(0.1), (8, 32),
                                          96),
             "hf-gpt2": Workload("HF GPT-2 (tiny config, sdpa) d32 2 layers, 4x16 tokens", _hf_gpt2, (4, 16), 96,
                                 _hf_loss),
             "hf-gpt2-dropout": Workload("HF GPT-2 as above, GPT-2's dropout 0.1", lambda: _hf_gpt2(0.1), (4, 16), 96,
                                         _hf_loss)}
DEFAULT_MODELS = ("mlp", "block")


# the optimizer of the timed steps (`--optimizer`); the floor steps with the same, in its foreach form
OPTIMIZERS = {"sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.01, momentum=0.9, **kw),
              "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)}
OPTIMIZER = ["sgd"]


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               loss: Callable = _cross_entropy) -> None:
    opt.zero_grad()
    loss(model, x, y).backward()
    opt.step()


@dataclass
class Result:
    name: str
    eager_ops: int
    eager_us_per_op: float
    recorded_ops: int
    record_us_per_op: float
    eager_step_ms: float
    record_ms: float
    mark_step_ms: float
    lookup_bind_ms: float    # mark_step minus its runner and its wait: key, plan cache lookup, binding results
    wait_ms: float           # in mark_step, waiting for the step before to finish on the worker (PYDISC_ASYNC)
    total_ms: float          # a lazy step's share of its block's wall time, synchronised at the end, at eager's scale


def _setup(workload: Workload, fast_record: bool | None) -> tuple:
    """An eager model and its lazy copy, an SGD optimizer for each, and one batch: (eager, lazy, eager's
    optimizer, lazy's, x, y)."""
    torch.manual_seed(0)
    eager = workload.make_model()
    lazy = pydisc.lazy(copy.deepcopy(eager), fast_record=fast_record)
    make_opt = OPTIMIZERS[OPTIMIZER[0]]
    if workload.vocab:
        x = torch.randint(0, workload.vocab, workload.input_shape)
        y = torch.randint(0, workload.vocab, workload.input_shape)
    else:
        x = torch.randn(workload.input_shape)
        y = torch.randint(0, 10, (workload.input_shape[0],))
    return eager, lazy, make_opt(eager.parameters()), make_opt(lazy.parameters()), x, y


def measure(workload: Workload, repeats: int, warmup: int, stat: Callable[[list[float]], float],
            fast_record: bool, block: int = 10) -> Result:
    eager, lazy, eager_opt, lazy_opt, x, y = _setup(workload, fast_record)
    step = lambda model, opt: train_step(model, opt, x, y, workload.loss)  # noqa: E731

    for _ in range(warmup):   # momentum buffers appear in step 1: the ops change once, then stay
        step(eager, eager_opt)
        step(lazy, lazy_opt)
        pydisc.mark_step()
    run_s = _time_runners()
    counter = CountOps()
    with counter:
        step(eager, eager_opt)

    # Blocks of `block` steps of each, taking turns: with PYDISC_ASYNC a lazy step's run overlaps what the
    # main thread does next, which must be the next lazy step, not an eager one (whose time it would hide).
    eager_s, record_s, mark_s, wait_s, recorded, blocks, eager_blocks = [], [], [], [], [], [], []
    for _ in range(max(1, repeats // block)):
        started = time.perf_counter()
        for _ in range(block):
            step_started = time.perf_counter()
            step(eager, eager_opt)
            eager_s.append(time.perf_counter() - step_started)
        eager_block = time.perf_counter() - started

        started = time.perf_counter()
        for _ in range(block):
            ops_before = METRICS.recorded_ops + METRICS.fast_entries
            waited = METRICS.async_wait_seconds
            step_started = time.perf_counter()
            step(lazy, lazy_opt)
            recorded_at = time.perf_counter()
            pydisc.mark_step()
            mark_s.append(time.perf_counter() - recorded_at)
            record_s.append(recorded_at - step_started)
            wait_s.append(METRICS.async_wait_seconds - waited)
            recorded.append(METRICS.recorded_ops + METRICS.fast_entries - ops_before)
        pydisc.synchronize()        # the block's last step has run
        blocks.append(time.perf_counter() - started)
        eager_blocks.append(eager_block)
    if len(set(recorded)) != 1:
        raise RuntimeError("recorded op count changed between repeats: %s" % sorted(set(recorded)))
    if len(run_s) != len(record_s):
        raise RuntimeError("expected one warm plan run per step, got %d runs in %d steps" % (len(run_s), len(record_s)))
    ms = lambda seconds: 1e3 * stat(seconds)  # noqa: E731
    name = workload.name + (", fast" if fast_record else ", dispatch")
    return Result(name, counter.count, 1e3 * ms(eager_s) / counter.count, recorded[0],
                  1e3 * ms(record_s) / recorded[0], ms(eager_s), ms(record_s), ms(mark_s),
                  ms([m - r - w for m, r, w in zip(mark_s, run_s, wait_s)]), ms(wait_s),
                  _block_ratio(blocks, eager_blocks, stat) * ms(eager_s))


def _block_ratio(lazy: list[float], eager: list[float], stat: Callable[[list[float]], float]) -> float:
    """pydisc's block time against eager's: the median of each block's ratio to the eager block before it
    (which saw the same load), or with `--stat min` the fastest pydisc block over the fastest eager block
    (the least of the paired ratios picks the pair whose eager block was disturbed: 0.24x for HF GPT-2
    over two blocks, where its steps took 1.7x)."""
    if stat is min:
        return min(lazy) / min(eager)
    return stat([a / b for a, b in zip(lazy, eager)])


class _Prepared(torch.Tensor):
    """A tensor whose every torch call returns, at once, the result prepared for that call's place in
    the step (`PreparedStep`): no recording, no key, no bookkeeping. What a step of these costs is
    what the step's own Python costs (module calls, the optimizer's code, autograd's API) when each
    call does nothing: the least any recorder at `__torch_function__` can cost."""

    step: "PreparedStep | None" = None

    @staticmethod
    def __new__(cls, like: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device="cpu",
            requires_grad=requires_grad and like.dtype.is_floating_point)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            if func in _PASSED or getattr(func, "__name__", "") in ("__get__", "__set__"):
                return func(*args, **(kwargs or {}))     # sizes, attributes, `.grad` read and written
            return cls.step.result(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError("prepared tensors run no ops")


_PASSED = {getattr(torch.Tensor, name) for name in (
    "size", "dim", "stride", "numel", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "storage_offset", "__len__", "__hash__")}


def _meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(tuple(a.shape), a.stride(), dtype=a.dtype, device="meta")
    if type(a) is list or type(a) is tuple:
        return type(a)(map(_meta, a))
    return torch.device("meta") if isinstance(a, torch.device) else a


class PreparedStep:
    """The results of a step's calls, in call order: made on the first step from the calls' meta
    kernels, handed back as they are on every later step. `backward()` gives each parameter its
    prepared gradient."""

    def __init__(self, grads: list) -> None:
        self.grads = grads          # [(parameter, its prepared gradient)]
        self.results: list = []
        self.position = 0
        self.changes = 0            # steps whose calls differed from the step before (the first SGD step)

    def start(self) -> None:
        self.position = 0
        _Prepared.step = self

    def result(self, func, args, kwargs):
        if func is torch.Tensor.backward:
            for p, g in self.grads:
                p.grad = g
            return None
        k, self.position = self.position, self.position + 1
        if k < len(self.results):
            made, out, iterates = self.results[k]
            if made is func:
                return iter(out) if iterates else out
            del self.results[k:]        # (SGD's first step makes the momentum buffers)
            self.changes += 1
        try:
            out = func(*map(_meta, args), **{name: _meta(v) for name, v in kwargs.items()})
        except NotImplementedError:     # an in-place foreach op reaches no kernel for lists of these
            out = None
        iterates = hasattr(out, "__next__")     # `q, k, v = t` calls `unbind`'s iterator
        out = tuple(out) if iterates else out
        if isinstance(out, torch.Tensor):
            out = _Prepared(out, True)
        elif isinstance(out, (tuple, list)):
            out = type(out)(_Prepared(o, True) if isinstance(o, torch.Tensor) else o for o in out)
        self.results.append((func, out, iterates))
        return iter(out) if iterates else out


def _prepared(workload: Workload) -> tuple:
    """An eager model and its copy made of `_Prepared` tensors, the prepared step, and a batch of each:
    (eager, prepared, step, x, y, px, py)."""
    torch.manual_seed(0)
    eager = workload.make_model()
    prepared = copy.deepcopy(eager)
    grads = []
    for m in prepared.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                # (a leaf that requires grad is all the optimizer asks of a parameter; `nn.Parameter`
                # would call `detach`)
                m._parameters[name] = q = _Prepared(p.detach(), p.requires_grad)
                grads.append((q, _Prepared(p.detach())))
    x = torch.randint(0, workload.vocab, workload.input_shape) if workload.vocab else torch.randn(workload.input_shape)
    y = torch.randint(0, workload.vocab or 10, workload.input_shape if workload.vocab else workload.input_shape[:1])
    return eager, prepared, PreparedStep(grads), x, y, _Prepared(x), _Prepared(y)


def _foreach_optimizer(params) -> torch.optim.Optimizer:
    return OPTIMIZERS[OPTIMIZER[0]](params, foreach=True)


def floor(workload: Workload, repeats: int, stat: Callable[[list[float]], float], block: int = 10) -> float:
    """The step's own Python against the eager step (`_Prepared`): the ratio of their `stat`s, taking
    turns in blocks of `block` steps after one untimed block. Raises where the model's Python needs
    what a prepared result cannot give (a value read, a call no meta kernel runs)."""
    eager, prepared, step, x, y, px, py = _prepared(workload)
    eager_opt, prepared_opt = _foreach_optimizer(eager.parameters()), _foreach_optimizer(prepared.parameters())
    eager_s, prepared_s = [], []
    changes = 0
    for k in range(1 + max(1, repeats // block)):
        for _ in range(block):
            started = time.perf_counter()
            train_step(eager, eager_opt, x, y, workload.loss)
            eager_s.append(time.perf_counter() - started)
        for _ in range(block):
            step.start()
            started = time.perf_counter()
            train_step(prepared, prepared_opt, px, py, workload.loss)
            prepared_s.append(time.perf_counter() - started)
        if k == 0:
            eager_s.clear()
            prepared_s.clear()
            changes = step.changes
    if step.changes != changes:
        raise RuntimeError("the step's calls kept changing after the warm-up steps")
    return stat(prepared_s) / stat(eager_s)


PHASES = ("zero_grad()", "forward and loss", "backward()", "optimizer.step()")


def phases(workload: Workload, repeats: int, warmup: int, block: int = 10) -> dict[str, list[float]]:
    """Each phase of the step (`PHASES`) timed on its own, for eager, the floor (`_Prepared`) and pydisc
    (with `mark_step()` after the step, untimed), taking turns in blocks of `block` steps: the fastest
    of each, in µs, as {"eager": [...], "floor": [...], "pydisc": [...]} in the order of `PHASES`."""
    eager, prepared, step, x, y, px, py = _prepared(workload)
    lazy = pydisc.lazy(copy.deepcopy(eager))
    make_opt = OPTIMIZERS[OPTIMIZER[0]]
    # (as `measure` and `floor` have them: the floor's optimizer in its foreach form)
    sides = {"eager": (eager, make_opt(eager.parameters()), x, y),
             "floor": (prepared, _foreach_optimizer(prepared.parameters()), px, py),
             "pydisc": (lazy, make_opt(lazy.parameters()), x, y)}
    times: dict[str, list[list[float]]] = {side: [[] for _ in PHASES] for side in sides}
    clock = time.perf_counter
    for k in range(max(1, warmup // block) + max(1, repeats // block)):
        for side, (model, opt, a, b) in sides.items():
            for _ in range(block):
                if side == "floor":
                    step.start()
                t0 = clock()
                opt.zero_grad()
                t1 = clock()
                loss = workload.loss(model, a, b)
                t2 = clock()
                loss.backward()
                t3 = clock()
                opt.step()
                t4 = clock()
                if side == "pydisc":
                    pydisc.mark_step()
                if k >= max(1, warmup // block):
                    for phase, (start, end) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                        times[side][phase].append(end - start)
    pydisc.synchronize()
    return {side: [1e6 * min(t) for t in ts] for side, ts in times.items()}


def _time_runners() -> list[float]:
    """Wrap the runner of every cached step plan so its calls are timed. This reaches into pydisc's
    plan cache (there is no public hook): what is left of mark_step is the key build, the cache
    lookup and binding the results to the lazy tensors (and, with PYDISC_ASYNC, waiting for the step
    before, timed apart; the runner then only prepares the IREE calls the worker makes)."""
    from pydisc.driver.engine import ENGINE

    seconds: list[float] = []

    def timed(runner):
        def run(*inputs):
            started = time.perf_counter()
            out = runner(*inputs)
            seconds.append(time.perf_counter() - started)
            return out
        return run

    for plan in ENGINE.plans.values():
        if not getattr(plan, "_bench_timed", False):
            plan.runner, plan._bench_timed = timed(plan.runner), True
    return seconds


def compare_async(workload: Workload, blocks: int, warmup: int, block: int = 10,
                  intervals: tuple[float, ...] = ()) -> dict[str, float]:
    """Eager, PYDISC_ASYNC on and PYDISC_ASYNC off, in one process, taking turns in blocks of `block` steps,
    each pydisc block ending in `pydisc.synchronize()`: the median ms per step of each ("eager", "on",
    "off"; "on <s>" for each GIL switch interval in `intervals` that a step in flight sets, instead of
    pydisc's), and "runs", how many steps ran on the worker. (Two processes, one per setting, differed by
    more than the setting on a shared VM.)"""
    eager, lazy, eager_opt, lazy_opt, x, y = _setup(workload, None)
    for _ in range(warmup):
        train_step(lazy, lazy_opt, x, y, workload.loss)
        pydisc.mark_step()
    pydisc.synchronize()
    runs_before = METRICS.async_runs
    modes = {"eager": None, "off": None, **({"on %g" % s: s for s in intervals} if intervals else {"on": None})}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    setting, interval = pydisc.config.CONFIG.async_cpu, inflight.SWITCH_INTERVAL
    try:
        for _ in range(blocks):
            for mode, seconds in modes.items():
                pydisc.config.CONFIG.async_cpu = mode.startswith("on")
                inflight.SWITCH_INTERVAL = seconds or interval
                started = time.perf_counter()
                for _ in range(block):
                    if mode == "eager":
                        train_step(eager, eager_opt, x, y, workload.loss)
                    else:
                        train_step(lazy, lazy_opt, x, y, workload.loss)
                        pydisc.mark_step()
                pydisc.synchronize()
                times[mode].append((time.perf_counter() - started) / block * 1e3)
    finally:
        pydisc.config.CONFIG.async_cpu, inflight.SWITCH_INTERVAL = setting, interval
    return {**{mode: statistics.median(t) for mode, t in times.items()}, "runs": METRICS.async_runs - runs_before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated, of: %s (default: %s)" % (", ".join(WORKLOADS), ",".join(DEFAULT_MODELS)))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for eager (default 1: recording is single-threaded, and "
                        "one thread keeps eager timings stable on a small shared machine)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="per-step statistic of each column (min: the fastest step, for a loaded machine)")
    p.add_argument("--fast", choices=("both", "on", "off"), default="both",
                   help="record at __torch_function__ (PYDISC_FAST_RECORD, docs/fast_recording.md), op by op "
                        "through the dispatcher, or both side by side (default)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd",
                   help="the training steps' optimizer: SGD with momentum 0.9 (default) or AdamW")
    p.add_argument("--compare-async", action="store_true",
                   help="instead: eager, PYDISC_ASYNC=1 and PYDISC_ASYNC=0 taking turns in one process "
                        "(--repeats blocks of 10 steps each, fast recording as configured)")
    p.add_argument("--phases", action="store_true",
                   help="instead: each phase of the step (zero_grad, forward and loss, backward, optimizer step) "
                        "timed on its own for eager, the floor and pydisc's fast recorder, taking turns in one "
                        "process, fastest of --repeats steps")
    p.add_argument("--intervals", default="",
                   help="with --compare-async: comma-separated GIL switch intervals (seconds) that a step in "
                        "flight sets, each a column of its own, instead of pydisc's")
    args = p.parse_args()
    OPTIMIZER[0] = args.optimizer
    torch.set_num_threads(args.threads)
    if args.compare_async:
        print("torch %s, %d thread(s), median ms per step over %d blocks of 10 steps, taking turns"
              % (torch.__version__, torch.get_num_threads(), args.repeats))
        print()
        intervals = tuple(float(s) for s in args.intervals.split(",") if s)
        ons = ["on %g" % s for s in intervals] or ["on"]
        print("| model | eager | %s | PYDISC_ASYNC=0 | steps on the worker |"
              % " | ".join("PYDISC_ASYNC=1" + (", interval %s s" % m[3:] if m != "on" else "") for m in ons))
        print("| --- | ---: | %s---: | ---: |" % ("---: | " * len(ons)))
        for name in args.models.split(","):
            r = compare_async(WORKLOADS[name], args.repeats, args.warmup, intervals=intervals)
            e = r["eager"]
            print("| %s | %.2f ms | %s | %.2f ms (%.2fx) | %d |" % (
                WORKLOADS[name].name, e, " | ".join("%.2f ms (%.2fx)" % (r[m], r[m] / e) for m in ons),
                r["off"], r["off"] / e, r["runs"]))
        return
    if args.phases:
        print("torch %s, %d thread(s), fastest of %d steps after %d warm-up steps, each phase timed on its own, "
              "µs, %s; the step: the sum of its phases' fastest" % (
                  torch.__version__, torch.get_num_threads(), max(1, args.repeats // 10) * 10,
                  max(1, args.warmup // 10) * 10, args.optimizer))
        print()
        print("| model | phase | eager | floor | pydisc | pydisc above the floor |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for name in args.models.split(","):
            r = phases(WORKLOADS[name], args.repeats, args.warmup)
            for k, phase in enumerate(PHASES + ("the step",)):
                e, f, d = (sum(r[side]) if k == len(PHASES) else r[side][k] for side in ("eager", "floor", "pydisc"))
                print("| %s | %s | %.0f | %.0f | %.0f | %+.0f |" % (WORKLOADS[name].name, phase, e, f, d, d - f))
        return
    stat = statistics.median if args.stat == "median" else min
    paths = {"both": (False, True), "on": (True,), "off": (False,)}[args.fast]
    workloads = [WORKLOADS[name] for name in args.models.split(",")]
    results = [measure(w, args.repeats, args.warmup, stat, path) for w in workloads for path in paths]
    floors = {}
    for w in workloads:
        try:
            floors[w.name] = "%.2fx" % floor(w, args.repeats, stat)
        except Exception as e:      # (the model's Python needs more than prepared results)
            floors[w.name] = "- (%s)" % type(e).__name__
    print("torch %s, %d thread(s), %s of %d steps after %d warm-up steps, PYDISC_ASYNC=%d, %s"
          % (torch.__version__, torch.get_num_threads(), args.stat, args.repeats, args.warmup,
             pydisc.config.CONFIG.async_cpu, args.optimizer))
    print()
    print("| model, recording path | eager ATen ops | eager us/op | recorded entries | record us/entry "
          "| eager step | pydisc record + mark_step (lookup+bind / run / wait) | record / eager step "
          "| (record + mark_step) / eager step | floor: the step's own Python / eager step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r, w in zip(results, [w for w in workloads for _ in paths]):
        print("| %s | %d | %.1f | %d | %.1f | %.2f ms | %.2f + %.2f ms (%.2f / %.2f / %.2f) | %.2fx | %.2fx | %s |" % (
            r.name, r.eager_ops, r.eager_us_per_op, r.recorded_ops, r.record_us_per_op, r.eager_step_ms,
            r.record_ms, r.mark_step_ms, r.lookup_bind_ms, r.mark_step_ms - r.lookup_bind_ms - r.wait_ms,
            r.wait_ms, r.record_ms / r.eager_step_ms, r.total_ms / r.eager_step_ms, floors[w.name]))


if __name__ == "__main__":
    main()
