"""Dynamic shapes: a BERT-style encoder trained with a new sequence length and batch size every step.

Each mode trains its own copy of the same model (same initial weights, same batches, dropout off)
for `--steps` steps and the table reports, side by side from one run:

* total time for all steps, compiles included (each step reads its loss, as a training loop that
  logs does; CUDA is synchronised at the end);
* how many graphs were compiled: pydisc's step graphs (`plans_compiled`), torch.compile's graphs
  (dynamo's unique graphs; the static variant has its recompile limit raised so that it really
  compiles per shape instead of silently falling back to eager);
* the median step time after the first 20% of steps, and the time pydisc spends finding the plan of
  a step (structural key + lookup);
* the largest relative difference of the loss from eager over the first 20 steps.

    python bench/dynamic_shapes.py                           # CPU, a small model
    python bench/dynamic_shapes.py --modes eager,pydisc,"pydisc(dispatch)" --steps 200   # recording paths
    python bench/dynamic_shapes.py --device cuda --dim 256 --layers 4 --max-len 512 --max-batch 32
"""
from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import pydisc  # noqa: E402
from bert_mlm import IGNORE, BertMLM  # noqa: E402

VOCAB = 1000


def batches(steps: int, min_len: int, max_len: int, max_batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        b = int(torch.randint(1, max_batch + 1, (1,), generator=g))
        t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (b, t), generator=g)
        lengths = torch.randint(max(1, t // 2), t + 1, (b,), generator=g)
        ids[torch.arange(t)[None, :] >= lengths[:, None]] = 0          # padding
        selected = (torch.rand(b, t, generator=g) < 0.15) & (ids != 0)
        selected[:, 0] = True
        labels = torch.where(selected, ids, torch.full_like(ids, IGNORE))
        ids = torch.where(selected, torch.ones_like(ids), ids)          # [MASK]
        out.append((ids, labels))
    return out


def run(mode: str, base: torch.nn.Module, data, device: torch.device, args) -> dict:
    torch.manual_seed(0)
    model = copy.deepcopy(base).to(device)
    compiled_fn = None
    lazy = mode.startswith("pydisc")
    mark = args.mark or mode == "pydisc(mark_dynamic)"
    if lazy:
        from pydisc.driver.step import clear_plans
        clear_plans()
        pydisc.reset_metrics()
        # pydisc(dispatch): every op through the dispatcher, as before fast recording served templates
        pydisc.lazy(model, device=device, fast_record=False if mode == "pydisc(dispatch)" else None)
    elif mode.startswith("torch.compile"):
        dynamo = importlib.import_module("torch._dynamo")
        dynamo.reset()
        dynamo.utils.counters.clear()
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, 10_000)
        compiled_fn = torch.compile(model, dynamic=(mode == "torch.compile(dynamic=True)"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses, seconds = [], []
    started = time.perf_counter()
    for ids, labels in data:
        if args.budget and time.perf_counter() - started > args.budget:
            break                  # out of time (torch.compile with a compile per shape): partial row
        t0 = time.perf_counter()
        ids, labels = ids.to(device), labels.to(device)
        if lazy:
            if mark:
                pydisc.mark_dynamic(ids, [0, 1])
                pydisc.mark_dynamic(labels, [0, 1])
            labels = pydisc.to_lazy(labels)
        logits = (compiled_fn if compiled_fn is not None else model)(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if lazy:
            pydisc.mark_step()
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - started
    row = {"mode": mode, "total": total, "losses": losses, "steps": len(losses), "seconds": seconds,
           "median_ms": 1e3 * statistics.median(seconds[len(seconds) // 5:])}
    if lazy:
        m = pydisc.metrics()
        row["compiles"] = m["plans_compiled"]
        row["extra"] = "%d templates, %d matched, %d eager steps, lookup %.0f us/step, %d fallback ops" % (
            m["dynamic_templates"], m["dynamic_matches"], m["dynamic_eager_steps"],
            1e6 * m["lookup_seconds"] / max(1, m["steps"]),
            sum(m["fallback_ops"].values()))
    elif compiled_fn is not None:
        row["compiles"] = importlib.import_module("torch._dynamo").utils.counters["stats"]["unique_graphs"]
        row["extra"] = ""
    else:
        row["compiles"] = 0
        row["extra"] = ""
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--mark", action="store_true", help="pydisc.mark_dynamic the inputs (default: automatic)")
    p.add_argument("--modes", default="eager,pydisc,pydisc(mark_dynamic),torch.compile(dynamic=True),"
                                      "torch.compile(dynamic=False)")
    p.add_argument("--budget", type=float, default=0.0,
                   help="stop a mode after this many seconds (0: no limit); the row then says how far it got")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    data = batches(args.steps, args.min_len, args.max_len, args.max_batch)
    torch.manual_seed(0)
    base = BertMLM(VOCAB, args.max_len, args.dim, args.heads, args.layers, dropout=0.0)
    print("BERT-style MLM: %d layers, dim %d, %d parameters; %d steps, sequence length %d..%d, batch 1..%d "
          "(%d distinct shapes); device %s, torch %s" % (
              args.layers, args.dim, sum(q.numel() for q in base.parameters()), args.steps, args.min_len,
              args.max_len, args.max_batch, len({tuple(i.shape) for i, _ in data}), device, torch.__version__))
    rows = []
    for mode in args.modes.split(","):
        try:
            rows.append(run(mode, base, data, device, args))
        except Exception as exc:    # e.g. torch.compile without a working C++/Triton toolchain
            print("%s: failed: %s: %s" % (mode, type(exc).__name__, str(exc).splitlines()[0][:200]))
    eager = next((r for r in rows if r["mode"] == "eager"), None)
    print()
    print("| mode | total s (compile incl.) | vs eager | graphs compiled | median ms/step "
          "| max rel. loss diff (20 steps) | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        diff = ""
        if eager is not None:
            n = min(20, len(r["losses"]))
            diff = "%.1e" % max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], eager["losses"][:n]))
        ratio = "%.2fx" % (r["total"] / eager["total"]) if eager else ""
        total = "%.1f" % r["total"]
        if r["steps"] < len(data):
            total += " (stopped after %d of %d steps)" % (r["steps"], len(data))
            if eager is not None:
                ratio = "%.2fx of eager's first %d steps" % (
                    r["total"] / sum(eager["seconds"][:r["steps"]]), r["steps"])
        print("| %s | %s | %s | %d | %.1f | %s | %s |" % (r["mode"], total, ratio, r["compiles"],
                                                        r["median_ms"], diff, r["extra"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
