"""The HF transformers models of the tests, measured: what compiles, what falls back, time to the first
compiled step, step times against eager, dynamic lengths and decoding. Writes the tables of
docs/models.md (markdown on stdout).

    python bench/models.py                    # all rows, 10-15 minutes on 2 CPU cores
    python bench/models.py --only gpt2,bert   # some models

Each row runs in a fresh process (pydisc's plans, templates and the step choice are per process) with
the compile cache off, so the first-step times include IREE's compiles. Steps are timed with the
compiled path forced (PYDISC_STEP_CHOICE=off): the step choice would keep eager on this machine where
it is faster, and the table is about the compiled path.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [("bert", "sdpa"), ("bert", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager"), ("llama", "sdpa"),
         ("t5", "sdpa"), ("bart", "sdpa"), ("vit", "sdpa")]
LENGTHS = [8, 12, 16, 10, 14, 9, 11, 13, 15, 7, 12, 16, 10, 14, 9, 11, 13, 15, 8, 12]


def _child(kind: str, name: str, attn: str) -> dict:
    """Runs in the child process: one measurement, as a dict."""
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import copy
    import time

    import torch

    import hf_models
    import pydisc

    torch.manual_seed(0)
    if kind in ("train", "dynamic"):
        run = hf_models.train_side_by_side(name, steps=8, attn=attn, lengths=LENGTHS if kind == "dynamic" else None)
        m = run.metrics
        try:
            hf_models.assert_trains_like_eager(run)
            equal = "yes"
        except AssertionError as exc:
            equal = "no: " + str(exc).splitlines()[0][:80]
        return {"equal": equal, "ops": m["ops_stablehlo"] + m["ops_torch_mlir"], "recorded": m["recorded_ops"],
                "fallback": dict(m["fallback_ops"]), "plans": m["plans_compiled"],
                "first": run.step_seconds[0] + run.step_seconds[1] + run.step_seconds[2],
                "step": statistics.median(run.step_seconds[-4:]), "eager": statistics.median(run.eager_seconds[-4:]),
                "compiled_share": run.compiled_share, "templates": m["dynamic_templates"]}
    eager = hf_models.MODELS[name]().eval()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    prompt = torch.randint(3, hf_models.VOCAB, (1, 6))
    settings = dict(max_new_tokens=32, do_sample=False, pad_token_id=2)
    times = {}
    with torch.no_grad():
        for label, model in (("eager", eager), ("lazy", lazy)):
            started = time.perf_counter()
            out = model.generate(prompt, **settings)
            times[label] = time.perf_counter() - started
        want = eager.generate(prompt, **settings)
    m = pydisc.metrics()
    return {"equal": "yes" if torch.equal(out.cpu(), want) else "no", "plans": m["plans_compiled"],
            "matches": m["dynamic_matches"], "fallback": dict(m["fallback_ops"]), "lazy": times["lazy"],
            "eager": times["eager"], "templates": m["dynamic_templates"]}


def _measure(kind: str, name: str, attn: str) -> dict:
    env = dict(os.environ, PYDISC_CACHE_DIR="off", PYDISC_STEP_CHOICE="off", PYTHONWARNINGS="ignore")
    code = "import sys, json; sys.path.insert(0, %r); import models; print('RESULT', json.dumps(models._child(%r, %r, %r)))" % (
        str(ROOT / "bench"), kind, name, attn)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError("%s %s %s failed:\n%s" % (kind, name, attn, out.stderr[-2000:]))


def _fallbacks(f: dict) -> str:
    return ", ".join("%s x%d" % (k.replace("aten.", ""), v) for k, v in sorted(f.items())) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model names")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None

    print("| model (attention) | equal to eager | compiled ops / recorded | fallbacks | first 3 steps, compile "
          "included | step, pydisc / eager (ms) |")
    print("| --- | --- | ---: | --- | ---: | ---: |")
    for name, attn in TRAIN:
        if only and name not in only:
            continue
        r = _measure("train", name, attn)
        print("| %s (%s) | %s | %d / %d | %s | %.1f s | %.1f / %.1f (%.1fx) |" % (
            name, attn, r["equal"], r["ops"], r["recorded"], _fallbacks(r["fallback"]), r["first"],
            1e3 * r["step"], 1e3 * r["eager"], r["step"] / r["eager"]), flush=True)
    print()
    print("| model, a new length every step (20 steps) | equal to eager | plans | steps compiled | fallbacks |")
    print("| --- | --- | ---: | ---: | --- |")
    for name in ("gpt2", "bert", "llama", "t5"):
        if only and name not in only:
            continue
        r = _measure("dynamic", name, "sdpa")
        print("| %s | %s | %d | %d%% | %s |" % (name, r["equal"], r["plans"], 100 * r["compiled_share"],
                                              _fallbacks(r["fallback"])), flush=True)
    print()
    print("| generate(), greedy, 32 tokens | tokens equal | plans | token steps served by one template | "
          "pydisc / eager (s) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in ("gpt2", "llama"):
        if only and name not in only:
            continue
        r = _measure("generate", name, "sdpa")
        print("| %s | %s | %d | %d | %.2f / %.2f |" % (name, r["equal"], r["plans"], r["matches"], r["lazy"],
                                                       r["eager"]), flush=True)


if __name__ == "__main__":
    main()
