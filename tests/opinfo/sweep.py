"""The full OpInfo sweep over the Core ATen ops; writes docs/ops.md.

    python -m tests.opinfo.sweep [--samples N] [--ops NAME,...] [--out docs/ops.md] [--log FILE] [--jobs N]

Every selected OpInfo entry (see core_ops.py) runs in float32, float16, bfloat16, int64, int32 and bool
where it supports them, forward and (for differentiable float ops) forward + backward, up to N samples
per case. Each case prints one line as it finishes; `--log` also writes the details of every
non-compiled sample. `--jobs N` runs the ops in N worker processes (one op per task); the results come
out in the same order as with one process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import Counter, defaultdict

import torch

from .core_ops import DATA_DEPENDENT, core_op, core_opinfos
from .harness import CaseResult, case_dtypes, differentiable, full_name, run_case

KINDS = ("compiled", "fallback", "wrong", "error")
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "bool"}


def sweep(ops: list, samples: int, log) -> list[CaseResult]:
    results = []
    for op in ops:
        for dtype in case_dtypes(op):
            for grad in ([False, True] if differentiable(op, dtype) else [False]):
                started = time.perf_counter()
                try:
                    case = run_case(op, dtype, grad=grad, max_samples=samples)
                except Exception as exc:  # the harness itself failed (sample generation): report it
                    case = CaseResult(full_name(op), dtype, grad)
                    from .harness import Outcome
                    case.outcomes = [Outcome("error", f"harness: {type(exc).__name__}: {exc}"[:300])]
                results.append(case)
                counts = case.counts()
                routes = Counter(o.route for o in case.outcomes if o.route in ("torch-mlir", "both"))
                print(f"{case.op:45s} {SHORT[dtype]:5s} {'bwd' if grad else 'fwd'} "
                      + " ".join(f"{k}={counts[k]}" for k in KINDS if counts[k])
                      + "".join(f" route:{r}={n}" for r, n in sorted(routes.items()))
                      + f"  ({time.perf_counter() - started:.1f}s)", flush=True)
                if log is not None:
                    for o in case.outcomes:
                        if o.kind != "compiled" or o.route in ("torch-mlir", "both"):
                            log.write(json.dumps({"op": case.op, "dtype": SHORT[dtype], "grad": grad,
                                                  "kind": o.kind, "route": o.route, "detail": o.detail}) + "\n")
                    log.flush()
    return results


class _Lines:
    """A log that keeps its lines, so that a worker's log reaches the parent with its results."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        pass


def _sweep_one(task: tuple[int, int, bool]) -> tuple[list[CaseResult], list[str]]:
    """Worker: every case of the `index`-th selected OpInfo entry."""
    index, samples, logging = task
    lines = _Lines()
    return sweep([core_opinfos()[index]], samples, lines if logging else None), lines.lines


def sweep_parallel(ops: list, samples: int, log, jobs: int) -> list[CaseResult]:
    """`sweep` over `jobs` worker processes (spawned: IREE's runtime threads do not survive a fork), one
    op per task; results and log lines are merged in the order of `ops`, as `sweep` gives them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    position = {id(op): i for i, op in enumerate(core_opinfos())}
    tasks = [(position[id(op)], samples, log is not None) for op in ops]
    results: list[CaseResult] = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for cases, lines in pool.map(_sweep_one, tasks):
            results.extend(cases)
            if log is not None:
                log.write("".join(lines))
                log.flush()
    return results


def _cell(counts: Counter) -> str:
    if not sum(counts.values()):
        return ""
    return "/".join(str(counts[k]) for k in KINDS)


def _percent(results: list[CaseResult], dtypes: set) -> tuple[float, int, int]:
    total = Counter()
    for r in results:
        if r.dtype in dtypes:
            total += r.counts()
    n = sum(total.values())
    return (100.0 * total["compiled"] / n if n else 0.0), total["compiled"], n


def render(results: list[CaseResult], command: str, samples: int, seconds: float) -> str:
    by_op: dict[str, dict] = defaultdict(lambda: defaultdict(Counter))
    for r in results:
        by_op[r.op + (" (grad)" if r.grad else "")][r.dtype] += r.counts()
    totals = Counter()
    for r in results:
        totals += r.counts()
    dtypes = [d for d in SHORT if any(r.dtype == d for r in results)]
    f32, f32_ok, f32_n = _percent(results, {torch.float32})
    low, low_ok, low_n = _percent(results, {torch.float16, torch.bfloat16})
    f32_fwd = _percent([r for r in results if not r.grad], {torch.float32})
    low_fwd = _percent([r for r in results if not r.grad], {torch.float16, torch.bfloat16})
    routes = Counter(o.route for r in results for o in r.outcomes if o.kind == "compiled")
    by_route: dict[str, Counter] = defaultdict(Counter)   # op -> route -> compiled samples
    for r in results:
        for o in r.outcomes:
            if o.kind == "compiled" and o.route in ("torch-mlir", "both"):
                by_route[r.op + (" (grad)" if r.grad else "")][f"{SHORT[r.dtype]} {o.route}"] += 1
    lines = [
        "# Op coverage against PyTorch's OpInfo suite",
        "",
        f"Generated by `{command}` on {datetime.date.today()} (torch {torch.__version__}, "
        f"{seconds / 60:.0f} min on CPU); the harness is `tests/opinfo/`.",
        "",
        "## How it is measured",
        "",
        "Each OpInfo sample's tensors become lazy tensors (`pydisc.to_lazy(t.clone())`), the op is called,",
        "all samples of one op and dtype run in one `pydisc.mark_step()`, and the results are compared with",
        "eager PyTorch (`torch.testing.assert_close` with the dtype's default tolerances, `equal_nan`; a",
        "float result outside them still passes when it is no less accurate than eager against a float64",
        "reference, torch's `test_decomp` criterion). Backward cases (`(grad)` rows) take the gradients of",
        "the sum of the differentiable outputs with respect to every input that requires grad, through",
        "`torch.autograd.grad` on lazy inputs, and compare outputs and gradients. A sample is",
        "",
        "- **compiled**: correct, nothing ran eagerly (`fallback_ops` unchanged; a compiled executable ran,",
        "  or nothing was left to run because only views of materialized tensors were taken);",
        "- **fallback**: correct, some ATen ops ran eagerly;",
        "- **wrong**: differs from eager; **error**: pydisc raised, or a cluster failed to compile.",
        "",
        f"Up to {samples} samples per op and dtype (the first ones OpInfo generates); samples that eager",
        "itself rejects are skipped. Random ops (randn, dropout, ...) are not measured: their values",
        "cannot be compared sample by sample. Outputs of `empty*` are compared by dtype and shape only.",
        "Each case runs with static plans (`CONFIG.dynamic` off): one compile per shape, as the first step",
        "of a new shape would otherwise run eagerly under the dynamic-shape policy (docs/dynamic.md).",
        "",
        "**Which ops**: OpInfo entries whose ATen op is in torch's Core ATen set (overloads tagged",
        "`torch.Tag.core`), matched by `OpInfo.aten_name`/`name`, plus a by-name map for core ops whose",
        "OpInfo is named after the Python API (`nn.functional.conv2d` -> `convolution`, `softmax` ->",
        "`_softmax`, `nn.functional.layer_norm` -> `native_layer_norm`, ...; see",
        "`tests/opinfo/core_ops.py`). Backward-only core ops are exercised by the `(grad)` rows.",
        "",
        "## Totals",
        "",
        "| | compiled | fallback | wrong | error | samples |",
        "| --- | --- | --- | --- | --- | --- |",
        "| all | " + " | ".join(str(totals[k]) for k in KINDS) + f" | {sum(totals.values())} |",
        "",
        f"- **float32**: {f32:.1f}% of Core ATen samples compiled ({f32_ok}/{f32_n}); forward only "
        f"{f32_fwd[0]:.1f}% ({f32_fwd[1]}/{f32_fwd[2]}).",
        f"- **bfloat16 + float16**: {low:.1f}% compiled ({low_ok}/{low_n}); forward only {low_fwd[0]:.1f}% "
        f"({low_fwd[1]}/{low_fwd[2]}).",
        "",
        f"- **routes** of the compiled samples: StableHLO only {routes['stablehlo']}, torch-mlir only "
        f"{routes['torch-mlir']}, both {routes['both']}, none ran (views only) {routes['']}. torch-mlir "
        "compiles regions of ops that have no StableHLO rule (`PYDISC_TORCH_MLIR=0` turns it off).",
        "",
        "Ops that fall back by design: their output shape depends on the data (pydisc compiles static",
        "shapes): " + ", ".join(sorted(DATA_DEPENDENT)) + ". Complex results (`fft.rfft`, `fft.irfft`)",
        "have no StableHLO lowering in pydisc and run eagerly.",
        "",
    ]
    lines += _problems(results)
    lines += [
        "## Per op",
        "",
        "Each cell: compiled/fallback/wrong/error samples.",
        "",
        "| op | core ATen op | " + " | ".join(SHORT[d] for d in dtypes) + " |",
        "| --- | --- | " + " | ".join("---" for _ in dtypes) + " |",
    ]
    names = {full_name(op): core_op(op) for op in core_opinfos()}
    for name in sorted(by_op):
        base = name.removesuffix(" (grad)")
        lines.append(f"| `{name}` | {names.get(base, '')} | "
                     + " | ".join(_cell(by_op[name][d]) for d in dtypes) + " |")
    if by_route:
        lines += ["", "## Compiled through torch-mlir", "",
                  "Compiled samples whose step ran a torch-mlir region (ops with no StableHLO rule), per op:",
                  "", "| op | samples (dtype route) |", "| --- | --- |"]
        for name in sorted(by_route):
            lines.append(f"| `{name}` | " + ", ".join(f"{k} x{n}" for k, n in sorted(by_route[name].items())) + " |")
    return "\n".join(lines) + "\n"


# Why the OpInfo entries that still fall back do (by OpInfo name, forward and backward rows alike);
# an entry missing here is listed as "not explained yet".
FALLBACK_REASONS = {
    "nonzero": "by design: the output shape depends on the data",
    "fft.rfft": "complex values: no StableHLO lowering in pydisc",
    "fft.irfft": "complex values: no StableHLO lowering in pydisc",
    "sort": "outside float32/float64 on purpose: IREE's sort orders ties differently from eager's unstable "
            "sort, and ties are frequent in half precision and integers",
    "topk": "as sort",
    "scatter": "`reduce=` (the deprecated `aten.scatter.reduce`) has no rule",
    "index_put": "a boolean mask index: data-dependent",
    "nn.functional.embedding_bag": "no rule yet (`_embedding_bag`)",
    "cdist": "no rule yet (`_cdist_forward`, `_cdist_backward`)",
    "nn.functional.pdist": "no rule yet (`_pdist_forward`, `_pdist_backward`)",
    "grid_sampler_2d": "`grid_sampler_2d_backward` has no rule yet",
    "nn.functional.grid_sample": "`grid_sampler_2d_backward` has no rule yet",
    "nn.functional.conv_transpose1d": "`convolution_backward` of a transposed convolution has no rule yet",
    "nn.functional.conv_transpose2d": "`convolution_backward` of a transposed convolution has no rule yet",
    "nn.functional.conv_transpose3d": "`convolution_backward` of a transposed convolution has no rule yet",
    "nn.functional.pad.replicate": "an empty input `(0, 3, 3)`: its backward's `index_put` has an empty index",
}


def _problems(results: list[CaseResult]) -> list[str]:
    """The samples that are wrong or raised, and the entries that fall back with the reason."""
    lines = ["## Wrong and error samples", ""]
    bad = [(r, o) for r in results for o in r.outcomes if o.kind in ("wrong", "error")]
    for r, o in bad:
        lines.append(f"- `{r.op}{' (grad)' if r.grad else ''}` {SHORT[r.dtype]}: {o.kind}: {o.detail[:300]}")
    if not bad:
        lines.append("None in this run.")
    lines += ["", "## What falls back, and why", ""]
    fallback: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        for o in r.outcomes:
            if o.kind == "fallback":
                fallback[r.op][SHORT[r.dtype] + (" grad" if r.grad else "")] += 1
    for name in sorted(fallback):
        cases = ", ".join(f"{k} x{n}" for k, n in sorted(fallback[name].items()))
        lines.append(f"- `{name}` ({cases}): {FALLBACK_REASONS.get(name, 'not explained yet')}")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all core ops)")
    parser.add_argument("--out", default="docs/ops.md", help="'' to write nothing")
    parser.add_argument("--log", default="", help="JSON lines with every non-compiled sample")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes, each taking one op at a time")
    args = parser.parse_args(argv)
    ops = core_opinfos()
    if args.ops:
        wanted = set(args.ops.split(","))
        ops = [op for op in ops if full_name(op) in wanted or op.name in wanted]
    log = open(args.log, "w") if args.log else None
    started = time.perf_counter()
    if args.jobs > 1:
        results = sweep_parallel(ops, args.samples, log, args.jobs)
    else:
        results = sweep(ops, args.samples, log)
    seconds = time.perf_counter() - started
    command = "python -m tests.opinfo.sweep" + (f" --samples {args.samples}" if args.samples != 4 else "") \
        + (f" --jobs {args.jobs}" if args.jobs > 1 else "")
    text = render(results, command, args.samples, seconds)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    print(text.split("## Per op")[0].split("## Totals")[1], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
