"""Train a ResNet-18-style CNN on handwritten digits upsampled to 32x32, pydisc and eager side by side.

The data is scikit-learn's 8x8 digits (shipped with scikit-learn), normalized, bilinearly upsampled to
32x32 and dithered with a little fixed noise (examples/_data.py: exact ties in the blank background
would make max pooling's gradient depend on last-bit rounding). The network has ResNet-18's layout: a
3x3 stem with BatchNorm, ReLU and a 3x3/2 max pool, four stages of two basic residual blocks (3x3 convs,
BatchNorm, ReLU, a 1x1 conv + BatchNorm shortcut where the shape changes), adaptive average pooling and
a linear classifier; its width is `--width` (ResNet-18 proper: 64; default 16 so that it trains in a
minute or two on two CPU cores). SGD with Nesterov momentum and weight decay, OneCycleLR (which also
cycles the momentum every step: learning rate and momentum are step inputs in pydisc, so this does not
recompile). Batches have one size (the last partial batch of an epoch is dropped) and so does evaluation
(the test set in equal chunks), so the training step compiles twice (before and after the momentum
buffers exist) and evaluation once.

Exit status: 1 when the first 2 steps' losses differ by more than 1e-3 relative, or the test accuracies
differ by more than three points. This network at this learning rate is chaotic: two eager copies whose
weights differ by one part in a million already differ by 8e-3 in loss at step 3 and by 1e-1 at step 5
(measured on the CPU), so only the first steps can be compared step by step; rounding differences
between IREE and eager grow into different, equally good paths, and accuracy judges the end.

    python examples/resnet.py
    python examples/resnet.py --width 64 --steps 500 --device cuda
"""
from __future__ import annotations

import argparse
import copy
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
from _data import fixed_batches, load_digits_32  # noqa: E402

MAX_RELATIVE_LOSS_DIFF = 1e-3
CHECKED_STEPS = 2
MAX_ACCURACY_DIFF = 0.03


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


def train_step(model, opt, sched, x, y, lazy: bool) -> float:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    if lazy:
        pydisc.mark_step()
    return loss.item()


def accuracy(model, x, y, lazy: bool, chunk: int) -> float:
    """Accuracy over the largest multiple of `chunk` test images (one shape: one compiled plan)."""
    model.eval()
    n = len(y) - len(y) % chunk
    correct = 0
    with torch.no_grad():
        for xs, ys in zip(x[:n].split(chunk), y[:n].split(chunk)):
            hits = (model(xs).argmax(dim=1) == ys).sum()
            if lazy:
                pydisc.mark_step()
            correct += int(hits.item())
    model.train()
    return correct / n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=16, help="channels of the first stage (ResNet-18: 64)")
    p.add_argument("--lr", type=float, default=0.1, help="OneCycleLR's peak learning rate")
    p.add_argument("--eval-chunk", type=int, default=120)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        # eager convolutions use TF32 on the GPU by default; compare against strict float32, as IREE computes
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    train_x, train_y, test_x, test_y = (t.to(device) for t in load_digits_32())
    print("data: scikit-learn digits upsampled to 32x32, %d train / %d test images" % (len(train_y), len(test_y)))

    torch.manual_seed(0)
    eager = ResNet18(args.width).to(device)
    lazy = pydisc.lazy(copy.deepcopy(eager), device=device)
    copies = []
    for model in (eager, lazy):
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        copies.append((model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)))
    print("model: ResNet-18 layout, width %d, %d parameters; SGD nesterov, OneCycleLR to %g over %d steps"
          % (args.width, sum(p.numel() for p in eager.parameters()), args.lr, args.steps))

    losses_e, losses_l, seconds_e, seconds_l = [], [], [], []
    log_every = max(1, args.steps // 10)
    print("%6s  %9s  %12s  %12s  %10s" % ("step", "lr", "eager loss", "pydisc loss", "|diff|"))
    for step, idx in enumerate(fixed_batches(len(train_y), args.batch_size, args.steps), start=1):
        x, y = train_x[idx], train_y[idx]
        lr = copies[0][1].param_groups[0]["lr"]
        for (model, opt, sched), losses, seconds, is_lazy in zip(copies, (losses_e, losses_l),
                                                                 (seconds_e, seconds_l), (False, True)):
            started = time.perf_counter()
            losses.append(train_step(model, opt, sched, x, y, is_lazy))
            seconds.append(time.perf_counter() - started)
        if step == 1 or step % log_every == 0 or step == args.steps:
            e, p = losses_e[-1], losses_l[-1]
            print("%6d  %9.5f  %12.6f  %12.6f  %10.2e" % (step, lr, e, p, abs(e - p)))
    warm = slice(2, None) if args.steps > 2 else slice(None)
    print("timing: eager %.1f ms/step, pydisc %.1f ms/step (median after 2 warm-up steps); slowest pydisc step "
          "%.1f s (it compiles)" % (1e3 * statistics.median(seconds_e[warm]), 1e3 * statistics.median(seconds_l[warm]),
                                    max(seconds_l)))
    acc_e = accuracy(eager, test_x, test_y, False, args.eval_chunk)
    acc_l = accuracy(lazy, test_x, test_y, True, args.eval_chunk)
    print("accuracy: eager %.2f%%, pydisc %.2f%%" % (100 * acc_e, 100 * acc_l))

    failures = []
    drift = max(abs(e - p) / abs(e) for e, p in list(zip(losses_e, losses_l))[:CHECKED_STEPS])
    if not drift <= MAX_RELATIVE_LOSS_DIFF:
        failures.append("losses diverge (max relative diff %.2e over the first %d steps)" % (drift, CHECKED_STEPS))
    if abs(acc_e - acc_l) > MAX_ACCURACY_DIFF:
        failures.append("test accuracies differ by %.2f points" % (100 * abs(acc_e - acc_l)))
    print("check: max relative loss diff over the first %d steps %.2e: %s"
          % (CHECKED_STEPS, drift, "FAIL" if failures else "ok"))
    print()
    print(pydisc.metrics_report())
    for failure in failures:
        print("FAILED: " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
