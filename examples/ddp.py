"""Data-parallel training with torch.distributed: eager DDP and pydisc DDP side by side, on every rank.

Launch one process per device with torchrun:

    torchrun --nproc-per-node 2 examples/ddp.py                       # CPU, gloo
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/ddp.py --device cuda   # GPUs, NCCL

Every rank builds the same model from the same seed, wraps one copy in
`DistributedDataParallel(model)` and a deep copy in `DistributedDataParallel(pydisc.lazy(copy))` (with
pydisc's comm hook, `pydisc.distributed.register_comm_hook`, unless `--no-comm-hook`), and trains both
on its own shard of the batches: the BERT-style masked LM of examples/bert_mlm.py (default) or a small
MLP (`--model mlp`). Dropout is off, so the two copies must agree step by step.

It prints each rank's losses, the step times, each rank's compiles, cache hits, fallbacks and
collectives, and checks, exiting non-zero when a check fails:
- every rank holds identical parameters after training (DDP keeps replicas equal), eager and pydisc;
- the losses of the first steps agree within 1e-3 (relative);
- pydisc's parameters equal eager DDP's within `--rtol`/`--atol` (default 1e-3/1e-4). Compiled and eager
  kernels round differently in the last bits, and AdamW divides each update by the root of the squared
  gradient's running mean: for a gradient near zero, a rounding difference of 1e-9 moves the update by a
  fair part of the learning rate (2e-3). tests/distributed pins exact-tolerance equality with SGD.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
import pydisc.distributed  # noqa: E402
from _data import stdlib_sentences  # noqa: E402
from bert_mlm import IGNORE, UNK, BertMLM, build_vocab, make_batches  # noqa: E402

MAX_RELATIVE_LOSS_DIFF = 1e-3
CHECKED_STEPS = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", choices=["bert", "mlp"], default="bert")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-words", type=int, default=32, help="BERT: sentences are cut to this many words "
                   "and padded to it, so every step has one shape")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's gradient bucket size")
    p.add_argument("--no-comm-hook", action="store_true",
                   help="plain DDP around the lazy model: one cut per gradient instead of one per bucket")
    p.add_argument("--no-eager", action="store_true", help="train pydisc DDP only (timing, scaling)")
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--atol", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: int, classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.LayerNorm(hidden),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(args, rank: int):
    """(model, this rank's batches as (input, target) pairs, loss function)."""
    if args.model == "mlp":
        g = torch.Generator().manual_seed(1000 + rank)
        batches = [(torch.randn(args.batch_size, 32, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g))
                   for _ in range(args.steps)]
        torch.manual_seed(0)
        return MLP(32, args.dim, 10), batches, F.cross_entropy
    words = stdlib_sentences(max_words=args.max_words)
    vocab = build_vocab(words, min_count=2)
    sentences = [[vocab.get(w, UNK) for w in s] for s in words]
    batches = make_batches(sentences, len(vocab), args.batch_size, args.steps, bucket=args.max_words,
                           seed=1000 + rank)
    torch.manual_seed(0)
    model = BertMLM(len(vocab), args.max_words, args.dim, args.heads, args.layers, dropout=0.0)

    def mlm_loss(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    return model, batches, mlm_loss


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("launch with torchrun, e.g.: torchrun --nproc-per-node 2 %s" % " ".join(sys.argv), file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False      # compare against strict float32
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=30))   # the first steps compile
    rank, world = dist.get_rank(), dist.get_world_size()

    model, batches, loss_fn = build(args, rank)
    lazy = pydisc.lazy(copy.deepcopy(model), device=device)
    ddp_kwargs = dict(device_ids=[local_rank] if args.device == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    copies = {}
    if not args.no_eager:
        copies["eager"] = DDP(model.to(device), **ddp_kwargs)
    copies["pydisc"] = DDP(lazy, **ddp_kwargs)
    if not args.no_comm_hook:
        pydisc.distributed.register_comm_hook(copies["pydisc"])
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01) for name, m in copies.items()}
    if rank == 0:
        print("%d ranks (%s), %s model with %d parameters, %d steps of %d examples per rank; pydisc DDP %s"
              % (world, dist.get_backend(), args.model, sum(p.numel() for p in model.parameters()), args.steps,
                 args.batch_size, "without a comm hook" if args.no_comm_hook else "with pydisc's comm hook"))

    losses = {name: [] for name in copies}
    seconds = {name: [] for name in copies}
    log_every = max(1, args.steps // 5)
    for step, (x, y) in enumerate(batches, start=1):
        x, y = x.to(device), y.to(device)
        for name, ddp in copies.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if name == "pydisc":
                pydisc.mark_step()
            losses[name].append(loss.item())
            if args.device == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - started)
        if step == 1 or step % log_every == 0 or step == args.steps:
            print("rank %d step %3d  " % (rank, step) + "  ".join("%s loss %.6f" % (n, l[-1]) for n, l in losses.items()),
                  flush=True)

    failures = []
    warm = slice(2, None) if args.steps > 3 else slice(None)
    timing = {name: 1e3 * statistics.median(s[warm]) for name, s in seconds.items()}
    # plain copies of the parameters (for pydisc: read after its last mark_step, so nothing runs)
    params = {name: [p.detach().cpu() for p in ddp.module.parameters()] for name, ddp in copies.items()}
    for name, ps in params.items():
        flat = torch.cat([p.reshape(-1) for p in ps]).to(device)   # every rank holds the same replica
        reference = flat.clone()
        dist.broadcast(reference, src=0)
        if not torch.equal(flat, reference):
            failures.append("rank %d: %s parameters differ from rank 0's (max %.3e)"
                            % (rank, name, (flat - reference).abs().max().item()))
    if "eager" in copies:
        diff = max((a - b).abs().max().item() for a, b in zip(params["eager"], params["pydisc"]))
        try:
            for a, b in zip(params["eager"], params["pydisc"]):
                torch.testing.assert_close(b, a, rtol=args.rtol, atol=args.atol)
        except AssertionError as e:
            failures.append("rank %d: pydisc parameters differ from eager DDP's: %s" % (rank, str(e).splitlines()[0]))
        drift = max(abs(e - p) / abs(e) for e, p in list(zip(losses["eager"], losses["pydisc"]))[:CHECKED_STEPS])
        if drift > MAX_RELATIVE_LOSS_DIFF:
            failures.append("rank %d: losses differ (max relative diff %.2e over the first steps)" % (rank, drift))
    else:
        diff = drift = float("nan")

    m = pydisc.metrics()
    row = dict(rank=rank, timing=timing, diff=diff, drift=drift, compiles=m["compiles"], cache_hits=m["cache_hits"],
               disk_hits=m["disk_cache_hits"], fallbacks=sum(m["fallback_ops"].values()), steps=m["mark_steps"],
               runs=m["steps"], collectives=sum(m["collectives"].values()), materializations=m["materializations"],
               report=pydisc.metrics_report(), failures=failures)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print()
        print("%4s  %10s  %10s  %10s  %9s  %8s  %10s  %9s  %12s  %11s" % (
            "rank", "eager ms", "pydisc ms", "max |diff|", "compiles", "cache hits", "fallbacks", "runs/step",
            "collectives", "reads"))
        for r in rows:
            print("%4d  %10.1f  %10.1f  %10.2e  %9d  %8d (%d disk)  %7d  %9.1f  %12d  %11d" % (
                r["rank"], r["timing"].get("eager", float("nan")), r["timing"]["pydisc"], r["diff"], r["compiles"],
                r["cache_hits"], r["disk_hits"], r["fallbacks"], r["runs"] / max(1, r["steps"]), r["collectives"],
                r["materializations"]))
        print("(ms: median step time after the first two steps; runs/step: compiled pieces per mark_step, "
              "one more than the cuts; reads: values read before mark_step)")
        print()
        print("rank 0 " + rows[0]["report"])
        all_failures = [f for r in rows for f in r["failures"]]
        print()
        print("check: parameters equal on all ranks, pydisc equal to eager DDP (rtol %g, atol %g): %s"
              % (args.rtol, args.atol, "FAIL" if all_failures else "ok"))
        for failure in all_failures:
            print("FAILED: " + failure, file=sys.stderr)
    failed = torch.tensor([len(failures)], device=device)
    dist.all_reduce(failed)
    dist.destroy_process_group()
    return 1 if failed.item() else 0


if __name__ == "__main__":
    sys.exit(main())
