"""The examples run end to end and pass their own eager-vs-pydisc check; the MNIST IDX reader is exact."""
from __future__ import annotations

import gzip
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
MNIST_EXAMPLE = REPO / "examples" / "mnist.py"


def _load_example():
    """Import examples/mnist.py (not a package) once; dataclasses need it registered in sys.modules."""
    name = "pydisc_example_mnist"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, MNIST_EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def write_idx(path: Path, array: np.ndarray, code: int) -> None:
    """Write `array` as an IDX file: magic (0, 0, type code, ndim), big-endian int32 dims, big-endian data."""
    big_endian = array.astype(array.dtype.newbyteorder(">"))
    payload = bytes([0, 0, code, array.ndim]) + np.array(array.shape, dtype=">i4").tobytes() + big_endian.tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize("name, dtype, code", [
    ("images-idx3-ubyte", np.uint8, 0x08),
    ("labels.gz", np.int32, 0x0C),
    ("values", np.float32, 0x0D),
    ("shorts.gz", np.int16, 0x0B),
])
def test_read_idx_round_trip(tmp_path: Path, name: str, dtype, code: int) -> None:
    mnist = _load_example()
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 5, 4)) * 100).astype(dtype)
    if code == 0x0C:
        array = array[:, 0, 0]   # a 1-d file, like the labels
    write_idx(tmp_path / name, array, code)
    read = mnist.read_idx(tmp_path / name)
    assert read.shape == array.shape
    np.testing.assert_array_equal(read, array)


def test_read_idx_rejects_bad_files(tmp_path: Path) -> None:
    mnist = _load_example()
    (tmp_path / "not-idx").write_bytes(b"\x12\x34\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="not an IDX file"):
        mnist.read_idx(tmp_path / "not-idx")
    write_idx(tmp_path / "short", np.zeros((4, 2), dtype=np.uint8), 0x08)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])   # truncated data
    with pytest.raises(ValueError, match="header says"):
        mnist.read_idx(tmp_path / "short")


def test_load_mnist_from_idx_files(tmp_path: Path) -> None:
    mnist = _load_example()
    rng = np.random.default_rng(1)
    files = {"train-images-idx3-ubyte.gz": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
             "train-labels-idx1-ubyte": rng.integers(0, 10, (12,), dtype=np.uint8),
             "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28), dtype=np.uint8),
             "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, (5,), dtype=np.uint8)}
    for name, array in files.items():
        write_idx(tmp_path / name, array, 0x08)
    data = mnist.load_mnist(tmp_path)
    assert tuple(data.train_x.shape) == (12, 1, 28, 28) and tuple(data.test_x.shape) == (5, 1, 28, 28)
    assert data.train_y.tolist() == files["train-labels-idx1-ubyte"].tolist()
    assert data.test_y.tolist() == files["t10k-labels-idx1-ubyte.gz"].tolist()
    assert abs(float(data.train_x.mean())) < 1e-5 and abs(float(data.train_x.std()) - 1) < 1e-2


def test_mnist_example_trains_both_models_like_eager() -> None:
    proc = subprocess.run([sys.executable, str(MNIST_EXAMPLE), "--steps", "20", "--model", "both"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, "example failed:\n%s\n%s" % (out[-4000:], proc.stderr[-4000:])
    for header in ("== mlp:", "== cnn:"):
        assert header in out
    assert out.count("eager loss") == 2 and out.count("pydisc loss") == 2
    assert out.count("check    max relative loss diff") == 2
    assert "pydisc metrics" in out and "IREE compiles" in out


def test_hf_examples_fine_tune_then_generate_like_eager(tmp_path: Path) -> None:
    """examples/hf_finetune.py then examples/generate.py on its weights, with the settings a user gets
    (not the tests' PYDISC_* overrides; the compiled path of these models is tests/models/test_hf_models.py's):
    each exits 0 only when pydisc and eager agree."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYDISC_") or k == "PYDISC_CACHE_DIR"}
    weights = tmp_path / "gpt2.pt"
    for args in (["hf_finetune.py", "--steps", "8", "--save", str(weights)],
                 ["generate.py", "--weights", str(weights), "--tokens", "12"]):
        proc = subprocess.run([sys.executable, str(REPO / "examples" / args[0]), *args[1:]], cwd=REPO,
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, "%s failed:\n%s\n%s" % (args[0], proc.stdout[-4000:], proc.stderr[-4000:])
        assert "agree" in proc.stdout and "pydisc metrics" in proc.stdout
