"""Determinism on the CPU target: the same seeds give bit-identical parameters, in two processes and in
one, for a training loop with dropout (random masks), Adam and a learning-rate schedule."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

_TRAIN = r"""
import sys, torch, pydisc
seed, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(seed)
model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                            torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(32, 4))
pydisc.lazy(model)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
data = torch.Generator().manual_seed(100 + seed)
losses = []
for step in range(12):
    x = torch.randn(16, 12, generator=data)
    y = torch.randint(0, 4, (16,), generator=data)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward(); opt.step(); opt.zero_grad(); sched.step()
    pydisc.mark_step()
    losses.append(loss.item())
m = pydisc.metrics()
torch.save({"params": [p.detach().cpu().clone() for p in model.parameters()], "losses": losses,
            "compiles": m["compiles"] + m["cache_hits"], "fallbacks": dict(m["fallback_ops"])}, out)
"""


def _train(tmp_path: Path, seeds: list[int]) -> list[dict]:
    """Run the training script once per seed, in parallel processes; each process has its own
    in-memory caches (the test session's disk cache is shared)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = [tmp_path / ("run%d.pt" % k) for k in range(len(seeds))]
    procs = [subprocess.Popen([sys.executable, "-c", _TRAIN, str(seed), str(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for seed, out in zip(seeds, outs)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return [torch.load(out) for out in outs]


def test_training_with_dropout_is_bit_identical_across_processes(tmp_path):
    first, second, other = _train(tmp_path, [0, 0, 1])
    assert first["compiles"] > 0, "nothing was compiled: the test would not test pydisc"
    assert first["losses"] == second["losses"]
    for a, b in zip(first["params"], second["params"]):
        assert torch.equal(a, b)
    # and the seed matters (dropout masks, data): a different seed gives different parameters
    assert any(not torch.equal(a, c) for a, c in zip(first["params"], other["params"]))
