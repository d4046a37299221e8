"""One rank of a distributed test (gloo on the CPU), started by `launch.run_ranks`.

    python tests/distributed/worker.py SCENARIO OUT_DIR

Rank, world size and the rendezvous file come from the environment (RANK, WORLD_SIZE, PYDISC_TEST_STORE).
The rank writes its findings to OUT_DIR/rank<R>.json; the test asserts on them. Every scenario compares
pydisc with eager PyTorch doing the same thing with the same seeds, in the same process.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import pydisc  # noqa: E402
import pydisc.distributed  # noqa: E402

STEPS = 5
METRIC_KEYS = ("compile_seconds", "plan_seconds", "compiles", "cache_hits", "disk_cache_hits", "clusters", "mark_steps",
               "steps", "graph_cache_hits", "graph_cache_misses", "materializations", "fallback_ops", "collectives")


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)       # every rank trains on its own data
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def metrics() -> dict:
    m = pydisc.metrics()
    return {k: m[k] for k in METRIC_KEYS}


def compare(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    """As PyTorch's DDP tests do: assert_close with float32's default tolerances (rtol 1.3e-6, atol 1e-5);
    and whether every rank holds the same replica, exactly."""
    close, message = True, ""
    try:
        for a, b in zip(ours, reference):
            torch.testing.assert_close(a, b)
    except AssertionError as e:
        close, message = False, str(e)
    flat = torch.cat([p.reshape(-1) for p in ours])
    rank0 = flat.clone()
    dist.broadcast(rank0, src=0)
    return dict(close=close, message=message, replicas_equal=bool(torch.equal(flat, rank0)),
                max_diff=max((a - b).abs().max().item() for a, b in zip(ours, reference)))


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------------

def train_ddp(rank: int, lazy: bool, hook: bool = False, **ddp_kwargs) -> tuple[list, list, dict]:
    torch.manual_seed(0)
    model = make_model()
    if lazy:
        model = pydisc.lazy(model)
    pydisc.reset_metrics()
    ddp = DDP(model, **ddp_kwargs)
    if hook:
        pydisc.distributed.register_comm_hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches(rank):
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if lazy:
            pydisc.mark_step()
        losses.append(loss.item())
    return params(model), losses, metrics()


def scenario_ddp(rank: int, world: int) -> dict:
    """Eager DDP against pydisc DDP: without a comm hook, with pydisc's, and with several buckets."""
    reference, reference_losses, _ = train_ddp(rank, lazy=False)
    out = {}
    variants = {"plain": dict(hook=False), "hook": dict(hook=True),
                "hook_buckets": dict(hook=True, bucket_cap_mb=0.0004)}   # 100 floats: several buckets
    for name, kwargs in variants.items():
        eager_kwargs = {k: v for k, v in kwargs.items() if k != "hook"}
        if eager_kwargs:
            ref, ref_losses, _ = train_ddp(rank, lazy=False, **eager_kwargs)
        else:
            ref, ref_losses = reference, reference_losses
        ours, losses, m = train_ddp(rank, lazy=True, **kwargs)
        out[name] = dict(compare(ours, ref), losses=losses, reference_losses=ref_losses, metrics=m,
                         n_params=len(ours))
    return out


def scenario_collectives(rank: int, world: int) -> dict:
    """Hand-written data parallelism: broadcast of the parameters at the start, all_reduce of every
    gradient and of the loss, all_gather of the losses; then a functional all_reduce."""
    torch.manual_seed(rank)                        # different on every rank until the broadcast
    eager = make_model()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    pydisc.reset_metrics()
    out = {}
    for name, model in (("eager", eager), ("pydisc", lazy)):
        with torch.no_grad():
            for p in model.parameters():
                dist.broadcast(p, src=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        mean_losses, gathered = [], []
        for x, y in batches(rank):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            for p in model.parameters():
                p.grad /= world
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            everyone = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(everyone, loss.detach())
            if name == "pydisc":
                pydisc.mark_step()
            mean_losses.append(total.item() / world)
            gathered.append([t.item() for t in everyone])
        out[name] = dict(params=params(model), mean_losses=mean_losses, gathered=gathered)
    m = metrics()
    import torch.distributed._functional_collectives as funcol
    x = pydisc.to_lazy(torch.arange(4.0) + rank)
    y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1
    pydisc.mark_step()
    result = dict(compare(out["pydisc"]["params"], out["eager"]["params"]), metrics=m,
                  mean_losses=out["pydisc"]["mean_losses"], eager_mean_losses=out["eager"]["mean_losses"],
                  gathered=out["pydisc"]["gathered"], eager_gathered=out["eager"]["gathered"],
                  functional=y.tolist(), functional_is_lazy=pydisc.is_lazy(y))
    return result


def scenario_cache(rank: int, world: int) -> dict:
    """Both ranks compile the same clusters at the same time into one empty cache folder; then each
    loads them back from disk."""
    from pydisc.exec import clear_cache, configured_disk_cache
    from pydisc.driver.step import clear_plans

    def step() -> float:
        torch.manual_seed(0)
        model = pydisc.lazy(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = batches(0, 1)[0]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        dist.barrier()                             # compile at the same moment on every rank
        pydisc.mark_step()
        return loss.item()

    pydisc.reset_metrics()
    first = step()
    first_metrics = metrics()
    dist.barrier()
    cache = configured_disk_cache()
    names = sorted(os.listdir(cache.directory))
    entries = [n for n in names if n.endswith(".vmfb")]
    valid = [cache.get(n[: -len(".vmfb")]) is not None for n in entries]
    dist.barrier()
    clear_plans()
    clear_cache()
    pydisc.reset_metrics()
    second = step()
    return dict(first_metrics=first_metrics, second_metrics=metrics(), entries=len(entries), valid=valid,
                others=[n for n in names if not n.endswith(".vmfb")], losses=[first, second])


SCENARIOS = {"ddp": scenario_ddp, "collectives": scenario_collectives, "cache": scenario_cache}


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["PYDISC_TEST_STORE"], rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = SCENARIOS[scenario](rank, world)
    finally:
        dist.destroy_process_group()
    (out_dir / ("rank%d.json" % rank)).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
