"""Train an MLP and a small CNN on handwritten digits with pydisc and eager PyTorch side by side.

Both copies start from the same weights and see the same batches in the same order, and train
independently. The example doubles as a check: it exits non-zero when the losses of the first
steps differ (relative difference above 1e-3) or the final test accuracies differ by more than one point.

Rounding differs between IREE's kernels and eager's (about 1e-7), and training amplifies it: once a
pre-activation within ~1e-8 of zero lands on the other side of a ReLU, the two runs follow different
(equally good) paths, and after a few hundred steps their losses differ by percents while both
converge. So the step-by-step check covers the first steps only, before that drift can build up; the
end of the curves is judged by accuracy. (The test suite pins step-by-step equality on short runs.)

    python examples/mnist.py                       # scikit-learn's 8x8 digits, MLP and CNN
    python examples/mnist.py --mnist ~/data/mnist  # the standard MNIST IDX files (.gz or not)
    python examples/mnist.py --model cnn --optimizer adam --device cuda
"""
from __future__ import annotations

import argparse
import copy
import gzip
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# Lets `python examples/mnist.py` run from a checkout without installing pydisc.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pydisc  # noqa: E402
from _data import fixed_batches  # noqa: E402

MAX_RELATIVE_LOSS_DIFF = 1e-3
MAX_ACCURACY_DIFF = 0.01
WARMUP_STEPS = 3   # step 1 compiles; step 2 compiles again once the optimizer state exists


# ---- data --------------------------------------------------------------------------------------

# IDX element type codes (http://yann.lecun.com/exdb/mnist/); all multi-byte values are big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (gzip-compressed when the name ends in .gz) into an array of its shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError("%s is not an IDX file (bad magic number %s)" % (path, data[:4].hex()))
    ndim = data[3]
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    offset = 4 + 4 * ndim
    count = int(np.prod(dims)) if dims else 1
    if len(data) != offset + count * dtype.itemsize:
        raise ValueError("%s: header says %s elements of %s, file has %d data bytes"
                         % (path, dims, dtype, len(data) - offset))
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(dims)


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor   # (N, 1, H, W) float32, normalized with the training set's statistics
    train_y: torch.Tensor   # (N,) int64
    test_x: torch.Tensor
    test_y: torch.Tensor


def _normalized(train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    train = train.astype(np.float32)
    test = test.astype(np.float32)
    mean, std = train.mean(), train.std()
    to_tensor = lambda a: torch.from_numpy((a - mean) / std).unsqueeze(1)  # noqa: E731
    return to_tensor(train), to_tensor(test)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_test = int(len(order) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    train_x, test_x = _normalized(digits.images[train], digits.images[test])
    labels = torch.from_numpy(digits.target.astype(np.int64))
    return Dataset("sklearn digits 8x8", train_x, labels[train], test_x, labels[test])


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).exists():
            return directory / name
    raise FileNotFoundError("no %s or %s.gz in %s" % (stem, stem, directory))


def load_mnist(directory: str | Path) -> Dataset:
    directory = Path(directory).expanduser()
    read = lambda stem: read_idx(_find_idx(directory, stem))  # noqa: E731
    train_x, test_x = _normalized(read("train-images-idx3-ubyte"), read("t10k-images-idx3-ubyte"))
    train_y = torch.from_numpy(read("train-labels-idx1-ubyte").astype(np.int64))
    test_y = torch.from_numpy(read("t10k-labels-idx1-ubyte").astype(np.int64))
    return Dataset("MNIST 28x28 (%s)" % directory, train_x, train_y, test_x, test_y)


# ---- models ------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, image_size: int, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(image_size * image_size, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, image_size: int, channels: int = 16):
        super().__init__()
        # No conv bias: the BatchNorm that follows would cancel it.
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels * (image_size // 4) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


MODELS: dict[str, Callable[[int], nn.Module]] = {"mlp": MLP, "cnn": CNN}
OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
}


# ---- training ----------------------------------------------------------------------------------

@dataclass
class Run:
    """One model trained eagerly and with pydisc from the same start."""
    name: str
    eager_losses: list[float]
    lazy_losses: list[float]
    eager_seconds: list[float]
    lazy_seconds: list[float]
    eager_accuracy: float
    lazy_accuracy: float
    compiles: int
    compile_seconds: float

    def max_relative_loss_diff(self, steps: int = 10) -> float:
        """Over the first `steps` steps, before rounding differences can grow into different paths."""
        pairs = list(zip(self.eager_losses, self.lazy_losses))[:steps]
        return max(abs(e - p) / max(abs(e), 1e-12) for e, p in pairs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               lazy: bool) -> float:
    optimizer.zero_grad()
    if lazy:
        y = pydisc.to_lazy(y)    # a step input like x: the last, smaller batch keeps one executable
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if lazy:
        pydisc.mark_step()
    # After mark_step the lazy loss holds device data, so this read costs no extra materialization.
    return loss.item()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lazy: bool, chunk: int = 1000) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for xs, ys in zip(x.split(chunk), y.split(chunk)):
            hits = (model(xs).argmax(dim=1) == ys).sum()
            if lazy:
                pydisc.mark_step()
            correct += int(hits.item())
    model.train()
    return correct / len(y)


def train_side_by_side(name: str, data: Dataset, args: argparse.Namespace) -> Run:
    device = torch.device(args.device)
    torch.manual_seed(0)
    eager = MODELS[name](data.train_x.shape[-1]).to(device)
    lazy = pydisc.lazy(copy.deepcopy(eager), device=device)
    # Optimizers are built after pydisc.lazy: they must hold the lazy parameters.
    eager_opt, lazy_opt = OPTIMIZERS[args.optimizer](eager.parameters()), OPTIMIZERS[args.optimizer](lazy.parameters())
    before = pydisc.metrics()
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    log_every = max(1, args.steps // 10)
    run = Run(name, [], [], [], [], 0.0, 0.0, 0, 0.0)
    print("\n== %s: %d steps, batch %d, %s, %s ==" % (name, args.steps, args.batch_size, args.optimizer, device))
    print("%6s  %12s  %12s  %10s" % ("step", "eager loss", "pydisc loss", "|diff|"))
    for step, idx in enumerate(fixed_batches(len(train_y), args.batch_size, args.steps), start=1):
        x, y = train_x[idx], train_y[idx]
        for model, opt, losses, seconds, is_lazy in (
                (eager, eager_opt, run.eager_losses, run.eager_seconds, False),
                (lazy, lazy_opt, run.lazy_losses, run.lazy_seconds, True)):
            _sync(device)
            started = time.perf_counter()
            losses.append(train_step(model, opt, x, y, is_lazy))
            _sync(device)
            seconds.append(time.perf_counter() - started)
        if step == 1 or step % log_every == 0 or step == args.steps:
            e, p = run.eager_losses[-1], run.lazy_losses[-1]
            print("%6d  %12.6f  %12.6f  %10.2e" % (step, e, p, abs(e - p)))
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)
    run.eager_accuracy = accuracy(eager, test_x, test_y, lazy=False)
    run.lazy_accuracy = accuracy(lazy, test_x, test_y, lazy=True)
    after = pydisc.metrics()
    run.compiles = after["compiles"] - before["compiles"]
    run.compile_seconds = after["compile_seconds"] - before["compile_seconds"]
    return run


def report(run: Run) -> list[str]:
    """Print timing and accuracy of one run; return the reasons it fails the check (empty: passed)."""
    warm = slice(WARMUP_STEPS, None)
    eager_ms = 1e3 * statistics.median(run.eager_seconds[warm] or run.eager_seconds)
    lazy_ms = 1e3 * statistics.median(run.lazy_seconds[warm] or run.lazy_seconds)
    print("timing   eager %.2f ms/step, pydisc %.2f ms/step (median after %d warm-up steps, %.1fx)"
          % (eager_ms, lazy_ms, WARMUP_STEPS, lazy_ms / eager_ms))
    print("         slowest pydisc step %.2f s (the one that plans and compiles); %d IREE compiles, %.2f s"
          % (max(run.lazy_seconds), run.compiles, run.compile_seconds))
    print("accuracy eager %.2f%%, pydisc %.2f%%" % (100 * run.eager_accuracy, 100 * run.lazy_accuracy))
    failures = []
    drift = run.max_relative_loss_diff()
    if not drift <= MAX_RELATIVE_LOSS_DIFF:   # written so that NaN fails too
        failures.append("%s: losses diverge (max relative diff %.2e > %.0e)" % (run.name, drift, MAX_RELATIVE_LOSS_DIFF))
    if abs(run.eager_accuracy - run.lazy_accuracy) > MAX_ACCURACY_DIFF:
        failures.append("%s: test accuracies differ by %.2f points"
                        % (run.name, 100 * abs(run.eager_accuracy - run.lazy_accuracy)))
    print("check    max relative loss diff over the first 10 steps %.2e: %s" % (drift, "FAIL" if failures else "ok"))
    return failures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "cnn", "both"], default="both")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                   help="sgd: lr 0.05, momentum 0.9; adam: lr 1e-3")
    p.add_argument("--mnist", metavar="DIR", help="read the MNIST IDX files from DIR instead of sklearn's digits")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = load_mnist(args.mnist) if args.mnist else load_digits()
    print("data: %s, %d train / %d test images" % (data.name, len(data.train_y), len(data.test_y)))
    names = ["mlp", "cnn"] if args.model == "both" else [args.model]
    failures: list[str] = []
    for name in names:
        failures += report(train_side_by_side(name, data, args))
    print()
    print(pydisc.metrics_report())
    for failure in failures:
        print("FAILED: " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
