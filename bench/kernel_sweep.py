"""Time every compiled cluster of a run under several sets of iree-compile flags, side by side.

    PYDISC_DUMP_DIR=dump python bench/workloads.py --only bert --modes pydisc   # the clusters' StableHLO
    python bench/kernel_sweep.py dump --json sweep.json                        # on the GPU machine

Each `<digest>.mlir` that pydisc wrote to the dump folder (static shapes only) is compiled once per
variant (`PYDISC_IREE_FLAGS`, in a process of its own, no disk cache), run on random inputs made from
its signature (floats normal, integers zero, so gathers stay in range), and timed with CUDA events
(median of `--repeats` calls after warm-up). The table lists the clusters that take the most time with
the baseline flags, the time under each variant as a ratio of the baseline, and the achieved GB/s
(inputs read once, outputs written once). What a variant changes in the kernels can be seen with
`--iree-hal-dump-executable-configurations-to`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# name -> extra iree-compile flags; the first is the baseline
VARIANTS = {
    "base": "",
    "O3": "--iree-opt-level=O3",
    "no-vector-dist": "--iree-codegen-llvmgpu-use-vector-distribution=false",
    "reduction-vd": "--iree-codegen-llvmgpu-use-reduction-vector-distribution=true",
    "no-multi-reduction-fusion": "--iree-dispatch-creation-element-wise-fuse-multi-reduction=false",
    "legacy-vectorize": "--iree-codegen-llvmgpu-vectorize-pipeline=true",
}

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
           "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "ui8": torch.uint8,
           "i1": torch.bool}
_ARG = re.compile(r"%[\w.]+\s*:\s*tensor<([^>]*)>(\s*\{iree\.abi\.output = \d+ : index\})?")


_PLUMBING = {"view", "_unsafe_view", "reshape", "expand", "permute", "t", "transpose", "clone", "unsqueeze",
             "squeeze", "alias", "slice", "select", "_to_copy", "copy"}


def signature(text: str) -> tuple[list, list] | None:
    """([(shape, dtype)] of inputs, [(shape, dtype)] of outputs) of @main, or None for dynamic shapes or
    element types this script does not make."""
    start = text.find("@main(")
    end = text.find(") ->", start)    # the argument list ends at the first ') ->'
    if start < 0 or end < 0:
        return None
    head = text[start:end]
    inputs, outputs = [], []
    for m in _ARG.finditer(head):
        *dims, elem = m.group(1).split("x") if "x" in m.group(1) else [m.group(1)]
        if any(d == "?" for d in dims) or elem not in _DTYPES:
            return None
        (outputs if m.group(2) else inputs).append((tuple(int(d) for d in dims), _DTYPES[elem]))
    return inputs, outputs


def _make(shape, dtype, device):
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, device=device) < 0.5
    return torch.zeros(shape, dtype=dtype, device=device)


def _nbytes(specs) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)


def _time_call(run, device) -> float:
    """Microseconds of one call: CUDA events on the GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        run()
        return 1e6 * (time.perf_counter() - t)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def run_variant(folder: str, repeats: int, device: torch.device) -> list[dict]:
    """In this process (PYDISC_IREE_FLAGS set by the caller): compile and time every cluster."""
    from pydisc.exec import compile_module
    from pydisc.exec.compiler import precompile
    texts = {}     # name -> (text, signature)
    for path in sorted(Path(folder).glob("*.mlir")):
        if re.fullmatch(r"[0-9a-f]{16}\.mlir", path.name):
            text = path.read_text()
            sig = signature(text) if "stablehlo" in text else None
            if sig is not None:
                texts[path.stem] = (text, sig)
    started = time.perf_counter()
    precompile([text for text, _ in texts.values()], device, jobs=os.cpu_count())
    rows = [{"compile s": time.perf_counter() - started, "clusters": len(texts)}]
    for name, (text, (ins, outs)) in texts.items():
        row = {"cluster": name}
        try:
            module = compile_module(text, device)
            inputs = [_make(s, d, device) for s, d in ins]
            outputs = [torch.empty(s, dtype=d, device=device) for s, d in outs]
            for _ in range(3):
                module.run(inputs, outputs)
            row["us"] = statistics.median(_time_call(lambda: module.run(inputs, outputs), device)
                                          for _ in range(repeats))
            row["bytes"] = _nbytes(ins) + _nbytes(outs)
            ops = [l.strip()[3:].split(".")[1] for l in text.splitlines() if l.strip().startswith("// aten.")]
            row["ops"] = "%d: %s" % (len(ops), ",".join(dict.fromkeys(o for o in ops if o not in _PLUMBING)))
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is reported
            row["error"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0][:160] if str(exc).strip()
                                       else "")
        rows.append(row)
    return rows


def table(results: dict[str, list[dict]], top: int) -> str:
    names = list(results)
    base = {r["cluster"]: r for r in results[names[0]][1:] if "us" in r}
    order = sorted(base, key=lambda c: -base[c]["us"])
    out = ["| cluster | aten ops | MB moved | %s |" % " | ".join(
               "%s us (x base)" % n if k == 0 else "%s (x base)" % n for k, n in enumerate(names)),
           "| --- | --- | ---: |" + " ---: |" * len(names)]
    by = {n: {r["cluster"]: r for r in results[n][1:]} for n in names}
    for c in order[:top]:
        cells = []
        for k, n in enumerate(names):
            r = by[n].get(c, {})
            if "us" not in r:
                cells.append("failed" if "error" in r else "-")
            elif k == 0:
                cells.append("%.1f (%.0f GB/s)" % (r["us"], r["bytes"] / r["us"] / 1e3))
            else:
                cells.append("%.2f" % (r["us"] / base[c]["us"]))
        out.append("| %s | %s | %.1f | %s |" % (c, base[c]["ops"][:60], base[c]["bytes"] / 2 ** 20, " | ".join(cells)))
    totals = []
    for n in names:
        common = [c for c in base if "us" in by[n].get(c, {})]
        t = sum(by[n][c]["us"] for c in common)
        b = sum(base[c]["us"] for c in common)
        fails = sum(1 for r in results[n][1:] if "error" in r)
        totals.append("%.0f us = %.2f x base over %d clusters, %d failed, compile %.0f s" % (
            t, t / b if b else 0, len(common), fails, results[n][0]["compile s"]))
    return "\n".join(out + [""] + ["- %s: %s" % (n, t) for n, t in zip(names, totals)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a PYDISC_DUMP_DIR of a CUDA run")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of: " + ", ".join(VARIANTS))
    p.add_argument("--flags", action="append", default=[], help="NAME=FLAGS: one more variant")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant")
    p.add_argument("--json", default="", help="write {variant: rows} here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print("ROWS " + json.dumps(run_variant(args.folder, args.repeats, torch.device(args.device))), flush=True)
        return 0
    variants = {n: VARIANTS[n] for n in args.variants.split(",") if n}
    for item in args.flags:
        name, _, flags = item.partition("=")
        variants[name] = flags
    results = {}
    for name, flags in variants.items():
        env = dict(os.environ, PYDISC_IREE_FLAGS=flags, PYDISC_CACHE_DIR="off", PYDISC_PROGRESS="0")
        cmd = [sys.executable, os.path.abspath(__file__), args.folder, "--one", name, "--repeats", str(args.repeats),
               "--device", args.device]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in done.stdout.splitlines() if l.startswith("ROWS ")), None)
            if line is None:
                print("%s: failed: %s" % (name, (done.stderr.strip().splitlines() or ["?"])[-1][:300]), file=sys.stderr)
                continue
            results[name] = json.loads(line[5:])
        except subprocess.TimeoutExpired:
            print("%s: not finished in %.0f s" % (name, args.timeout), file=sys.stderr)
            continue
        print("%s: %d clusters in %.0f s" % (name, results[name][0]["clusters"], results[name][0]["compile s"]),
              file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    if results:
        print(table(results, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
