"""Batched inference with pydisc (eval mode, no_grad) at a few batch sizes, checked against eager.

The model is examples/resnet.py's ResNet-18-style CNN, briefly trained eagerly on the 32x32 digits so
that its BatchNorm running statistics and outputs are realistic; a lazy copy then serves batches of
test images. The first batch size is compiled for its shape (at its second call: a new graph runs
eagerly once, `PYDISC_COMPILE_AFTER`); when the batch size changes, pydisc makes the batch dim dynamic
and compiles once more, and every later size reuses that executable (size 1 is specialised, as in
torch.compile). On CUDA plans are built in the background while calls run eagerly; the example waits
for them at the end of each size (`pydisc.wait_for_compiles()`). It checks with the metrics that no
batch size costs more than one compile and that a second pass over the sizes compiles nothing. For
each size it prints the first call, the median latency of pydisc and eager over `--steps` calls, and
the largest difference between their outputs.

Exit status: 1 when outputs differ by more than 1e-4 (relative to the logits' scale), predictions
differ, or a batch size seen before compiles again.

    python examples/inference.py
    python examples/inference.py --batch-sizes 1 16 256 --steps 50 --device cuda
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
from _data import fixed_batches, load_digits_32  # noqa: E402
from resnet import ResNet18  # noqa: E402

MAX_RELATIVE_OUTPUT_DIFF = 1e-4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pretrain(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """A few eager SGD steps: real BatchNorm statistics and confident logits to compare."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for idx in fixed_batches(len(y), 64, steps):
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    started = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - started, out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=20, help="timed calls per batch size")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--pretrain-steps", type=int, default=30)
    args = p.parse_args(argv)
    if args.steps < 1 or min(args.batch_sizes) < 1:
        p.error("--steps and batch sizes must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        # eager convolutions use TF32 on the GPU by default; compare against strict float32, as IREE computes
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    train_x, train_y, test_x, test_y = (t.to(device) for t in load_digits_32())
    torch.manual_seed(0)
    eager = ResNet18(args.width).to(device)
    pretrain(eager, train_x, train_y, args.pretrain_steps)
    eager.eval()
    lazy = pydisc.lazy(copy.deepcopy(eager), device=device).eval()
    print("model: ResNet-18 layout, width %d, %d eager SGD steps; test images %d"
          % (args.width, args.pretrain_steps, len(test_y)))

    def run_lazy(x):
        with torch.no_grad():
            out = lazy(x)
        pydisc.mark_step()
        return out

    def run_eager(x):
        with torch.no_grad():
            return eager(x)

    failures = []
    g = torch.Generator().manual_seed(0)
    print("%6s  %12s  %12s  %12s  %12s  %10s  %8s" % ("batch", "first call", "pydisc ms", "eager ms",
                                                      "pydisc/img", "max |diff|", "agree"))
    for batch in args.batch_sizes:
        plans_before = pydisc.metrics()["plans_compiled"]
        inputs = [test_x[torch.randint(0, len(test_y), (batch,), generator=g).to(device)] for _ in range(args.steps)]
        first, _ = timed(lambda: run_lazy(inputs[0]).cpu(), device)
        lazy_s, eager_s, worst, agree = [], [], 0.0, 0
        for x in inputs:
            t_l, out_l = timed(lambda: run_lazy(x), device)
            t_e, out_e = timed(lambda: run_eager(x), device)
            lazy_s.append(t_l)
            eager_s.append(t_e)
            out_l = out_l.cpu()
            out_e = out_e.cpu()
            worst = max(worst, ((out_l - out_e).abs().max() / out_e.abs().max().clamp_min(1e-6)).item())
            agree += int((out_l.argmax(1) == out_e.argmax(1)).all())
        pydisc.wait_for_compiles()   # plans built in the background (on CUDA) count for this batch size
        planned = pydisc.metrics()["plans_compiled"] - plans_before
        lazy_ms, eager_ms = 1e3 * statistics.median(lazy_s), 1e3 * statistics.median(eager_s)
        print("%6d  %10.2f s  %12.3f  %12.3f  %12.4f  %10.2e  %4d/%-3d" % (
            batch, first, lazy_ms, eager_ms, lazy_ms / batch, worst, agree, len(inputs)))
        if not worst <= MAX_RELATIVE_OUTPUT_DIFF:
            failures.append("batch %d: outputs differ by %.2e relative" % (batch, worst))
        if agree != len(inputs):
            failures.append("batch %d: predictions differ in %d batches" % (batch, len(inputs) - agree))
        if planned > 1:
            failures.append("batch %d: compiled %d times (expected at most once)" % (batch, planned))

    # A second pass over the same sizes must reuse every plan. The batches are gathered copies, as above:
    # a slice such as test_x[:batch] is a view into the whole test set, and pydisc currently keys eager
    # inputs by their storage and offset, so each slice offset would plan again (a known bug).
    plans_before = pydisc.metrics()["plans_compiled"]
    for batch in args.batch_sizes:
        run_lazy(test_x[torch.arange(batch, device=device)]).cpu()
    pydisc.wait_for_compiles()
    replanned = pydisc.metrics()["plans_compiled"] - plans_before
    print("second pass over batch sizes %s: %d new compiles" % (args.batch_sizes, replanned))
    if replanned:
        failures.append("batch sizes seen before compiled again (%d plans)" % replanned)
    print("check: %s" % ("FAIL" if failures else "ok"))
    print()
    print(pydisc.metrics_report())
    for failure in failures:
        print("FAILED: " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
