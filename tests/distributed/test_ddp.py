"""pydisc under torch.distributed, 2 processes with gloo on the CPU (tests/distributed/worker.py).

DDP around a lazy module trains to the parameters of eager DDP with the same seeds (compared as
PyTorch's DDP tests compare: assert_close at float32's default tolerances), with and without pydisc's
comm hook; explicit collectives on lazy tensors give eager's results; per-rank counters say what ran
where; two ranks filling one compile cache at once leave only valid entries.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "worker.py"
REPO = WORKER.parents[2]
WORLD = 2
TIMEOUT_S = 300


def run_ranks(scenario: str, tmp_path: Path, world: int = WORLD, env: dict | None = None) -> list[dict]:
    """Start `world` worker processes (a file rendezvous: no port to pick) and return each rank's JSON."""
    out = tmp_path / scenario
    out.mkdir()
    base = dict(os.environ, WORLD_SIZE=str(world), PYDISC_TEST_STORE=str(out / "store"), PYDISC_PROGRESS="0",
                OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base.update(env or {})
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)], cwd=REPO,
                              env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("%s: ranks did not finish within %d s" % (scenario, TIMEOUT_S))
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, "rank %d of %s failed:\n%s" % (r, scenario, log[-6000:])
    return [json.loads((out / ("rank%d.json" % r)).read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> list[dict]:
    return run_ranks("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def collectives(tmp_path_factory) -> list[dict]:
    return run_ranks("collectives", tmp_path_factory.mktemp("collectives"))


@pytest.mark.parametrize("variant", ["plain", "hook", "hook_buckets"])
def test_ddp_parameters_equal_eager_ddp(ddp, variant):
    for rank, result in enumerate(ddp):
        r = result[variant]
        assert r["close"], "rank %d, %s: %s" % (rank, variant, r["message"])
        assert r["replicas_equal"], "rank %d, %s: replicas differ from rank 0's" % (rank, variant)
        assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
    # the ranks trained on different data, so their local losses differ
    assert ddp[0][variant]["losses"] != ddp[1][variant]["losses"]


def test_ddp_counters_per_rank(ddp):
    for rank, result in enumerate(ddp):
        plain, hook, buckets = result["plain"], result["hook"], result["hook_buckets"]
        for name, r in (("plain", plain), ("hook", hook), ("hook_buckets", buckets)):
            m = r["metrics"]
            assert m["fallback_ops"] == {}, (rank, name, m["fallback_ops"])
            assert m["mark_steps"] == 5
            assert m["collectives"].get("c10d.broadcast_.default") == 1, (rank, name)   # DDP's initial sync
            # steps 3 to 5 reuse the plans of step 2 (step 1 creates the momentum buffers, and DDP
            # rebuilds its buckets after it)
            runs_per_step = (m["steps"] - 1) // 5      # one more run: the cut of DDP's initial broadcast
            assert m["graph_cache_hits"] >= 3 * runs_per_step, (rank, name, m)
        # without the hook, DDP's reducer reads each gradient as autograd produces it: a partial run, of all
        # that autograd recorded so far (a gradient it computed with the one before is not read again)
        assert 5 <= plain["metrics"]["materializations"] <= plain["n_params"] * 5
        assert "DDP bucket (allreduce_mean_hook)" not in plain["metrics"]["collectives"]
        # with it: nothing is read early, and each step runs as (forward + backward) | all-reduce | rest
        assert hook["metrics"]["materializations"] == 0
        assert hook["metrics"]["collectives"]["DDP bucket (allreduce_mean_hook)"] == 5
        assert hook["metrics"]["steps"] == 1 + 2 * 5
        assert buckets["metrics"]["materializations"] == 0
        assert buckets["metrics"]["collectives"]["DDP bucket (allreduce_mean_hook)"] > 5
    for name in ("plain", "hook", "hook_buckets"):
        # every rank planned and compiled (or loaded) the same clusters
        a, b = (result[name]["metrics"] for result in ddp)
        assert a["clusters"] == b["clusters"] and a["graph_cache_misses"] == b["graph_cache_misses"], name
        assert a["compiles"] + a["cache_hits"] == b["compiles"] + b["cache_hits"], name


def test_explicit_collectives(collectives):
    for rank, r in enumerate(collectives):
        assert r["close"], "rank %d: %s" % (rank, r["message"])
        assert r["replicas_equal"]
        assert r["mean_losses"] == pytest.approx(r["eager_mean_losses"], rel=1e-5)
        assert sum(r["gathered"], []) == pytest.approx(sum(r["eager_gathered"], []), rel=1e-5)
        m = r["metrics"]
        assert m["fallback_ops"] == {} and m["materializations"] == 0
        n_params = 4
        assert m["collectives"] == {"c10d.broadcast_.default": n_params, "c10d.allreduce_.default": 5 * (n_params + 1),
                                    "c10d.allgather_.default": 5}
        # funcol.all_reduce(2 * (arange(4) + rank), "sum") + 1 over ranks 0 and 1
        assert r["functional"] == [2.0 * (2 * i + 1) + 1 for i in range(4)]
        assert r["functional_is_lazy"]
    assert collectives[0]["gathered"] == collectives[1]["gathered"]


def test_ranks_share_the_compile_cache(tmp_path):
    cache = tmp_path / "compile-cache"
    cache.mkdir(mode=0o700)
    ranks = run_ranks("cache", tmp_path, env={"PYDISC_CACHE_DIR": str(cache)})
    for rank, r in enumerate(ranks):
        first, second = r["first_metrics"], r["second_metrics"]
        assert first["fallback_ops"] == {}
        assert first["compiles"] + first["cache_hits"] == first["clusters"] > 0
        assert r["entries"] == first["clusters"], "one entry per distinct cluster, whoever wrote it"
        assert all(r["valid"]) and not [name for name in r["others"] if name.startswith(".tmp-")]
        # a new process (here: memory caches dropped) loads everything from disk
        assert second["compiles"] == 0 and second["disk_cache_hits"] == first["clusters"]
        assert r["losses"][0] == r["losses"][1]
    # the ranks wait for each other's compiles (a lock per entry): each cluster is compiled once on the host
    assert sum(r["first_metrics"]["compiles"] for r in ranks) == ranks[0]["first_metrics"]["clusters"]


def test_ddp_example_under_torchrun():
    """examples/ddp.py, as the README launches it (smaller): eager and pydisc DDP agree on every rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               str(REPO / "examples" / "ddp.py"), "--model", "mlp", "--steps", "3", "--dim", "32"]
    env = dict(os.environ, PYDISC_PROGRESS="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "pydisc equal to eager DDP (rtol 0.001, atol 0.0001): ok" in proc.stdout, proc.stdout[-4000:]
    for rank in range(WORLD):
        assert "rank %d step   3" % rank in proc.stdout
