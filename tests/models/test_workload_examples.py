"""The workload examples (GPT, BERT, ResNet, batched inference) run a few steps end to end and pass
their own eager-vs-pydisc checks.

The examples run as subprocesses, all started at once (compiling is partly serial, so they share the
cores well), with small model sizes so that the cold compiles of a fresh test session stay short."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# our own models, written for pydisc: the HF models (tests/models/test_hf_models.py) and the MNIST and
# HF examples (test_examples.py) cover the default run; these five cold compiles take ~3 minutes
pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"

RUNS = {
    "gpt_char": ["gpt_char.py", "--steps", "3", "--layers", "1", "--dim", "32", "--context", "32",
                 "--generate", "20"],
    "bert_check": ["bert_mlm.py", "--steps", "3", "--layers", "1", "--dim", "32", "--max-words", "16"],
    "bert_dropout": ["bert_mlm.py", "--steps", "3", "--layers", "1", "--dim", "32", "--max-words", "16",
                     "--dropout", "0.1"],
    "resnet": ["resnet.py", "--steps", "3", "--width", "4", "--eval-chunk", "180"],
    "inference": ["inference.py", "--steps", "3", "--batch-sizes", "1", "5", "--width", "4",
                  "--pretrain-steps", "2"],
}


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        return "exit %d after %.0f s\n--- stdout\n%s\n--- stderr\n%s" % (
            self.returncode, self.seconds, self.stdout[-4000:], self.stderr[-4000:])


@pytest.fixture(scope="module")
def finished() -> dict[str, Finished]:
    env = dict(os.environ, PYDISC_PROGRESS="0")
    started = time.perf_counter()
    procs = {name: subprocess.Popen([sys.executable, str(EXAMPLES / argv[0]), *argv[1:]], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, argv in RUNS.items()}
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, 600 - (time.perf_counter() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = Finished(proc.returncode, out, err, time.perf_counter() - started)
    return results


def _assert_ran(run: Finished, *pieces: str) -> None:
    assert run.returncode == 0, run.explain()
    for piece in pieces:
        assert piece in run.stdout, "missing %r\n%s" % (piece, run.explain())
    assert "pydisc metrics" in run.stdout and "IREE compiles" in run.stdout


def test_gpt_char_trains_and_generates(finished) -> None:
    run = finished["gpt_char"]
    _assert_ran(run, "characters of Python standard-library source", "eager loss", "pydisc loss",
                "greedy, pydisc:", "greedy, eager with the same weights:", "sampled (T=0.8, pydisc):",
                "check: max relative loss diff")
    table = run.stdout.split("|diff|")[1].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ["1", "2", "3"]


def test_bert_mlm_check_mode_matches_eager(finished) -> None:
    _assert_ran(finished["bert_check"], "padded lengths:", "dropout 0.00",
                "check (dropout off): max relative loss diff", ": ok")


def test_bert_mlm_runs_with_dropout(finished) -> None:
    _assert_ran(finished["bert_dropout"], "dropout 0.10", "check (dropout 0.10): mean loss")


def test_resnet_trains_like_eager(finished) -> None:
    _assert_ran(finished["resnet"], "ResNet-18 layout", "accuracy: eager", "check: max relative loss diff")


def test_inference_batch_sizes_compile_once(finished) -> None:
    run = finished["inference"]
    _assert_ran(run, "max |diff|", "second pass over batch sizes [1, 5]: 0 new compiles", "check: ok")
