"""A CPU cluster writes its outputs into the memory of its last call's outputs where nothing holds them
any more (`CompiledCluster._outputs`), and never into memory something still reads."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.exec import clusters, compile_module
from pydisc.exec.clusters import CompiledCluster

SHAPE = (64,)


def _text(op: str) -> str:
    t = "tensor<64xf32>"
    return f"""func.func @main(%a: {t}, %b: {t}, %o: {t} {{iree.abi.output = 0 : index}}) -> {t} {{
  %r = stablehlo.{op} %a, %b : {t}
  return %r : {t}
}}"""


def _cluster(op: str = "add") -> CompiledCluster:
    text = _text(op)
    fallback = torch.fx.symbolic_trace(lambda a, b: a + b)
    return CompiledCluster(op, compile_module(text, "cpu"), [(SHAPE, torch.float32)], text,
                           torch.device("cpu"), fallback)


def test_the_memory_of_a_dropped_output_is_written_again():
    cluster = _cluster()
    a, b = torch.randn(SHAPE), torch.randn(SHAPE)
    first = cluster(a, b)
    address = first.data_ptr()
    del first
    second = cluster(a, 2 * b)
    assert second.data_ptr() == address
    torch.testing.assert_close(second, a + 2 * b)


@pytest.mark.parametrize("holder", ["tensor", "view", "numpy", "dlpack", "saved for backward"])
def test_an_output_something_still_reads_keeps_its_values(holder):
    """Whatever still reads an output's memory, a Python reference, a view of it (a lazy tensor's device
    data), NumPy, a DLPack export, autograd's saved tensors, the next calls write elsewhere."""
    cluster = _cluster()
    a, b = torch.randn(SHAPE), torch.randn(SHAPE)
    out = cluster(a, b)
    expected = (a + b).clone()
    if holder == "tensor":
        kept, read = out, lambda: out
    elif holder == "view":
        kept = out.view(8, 8)
        read = lambda: kept.reshape(SHAPE)  # noqa: E731
    elif holder == "numpy":
        kept = out.numpy()
        read = lambda: torch.from_numpy(np.array(kept))  # noqa: E731
    elif holder == "dlpack":
        kept = torch.utils.dlpack.to_dlpack(out)
        read = lambda: torch.utils.dlpack.from_dlpack(kept).clone()  # noqa: E731
    else:
        w = torch.ones(SHAPE, requires_grad=True)
        kept = (w * out).sum()      # autograd saves `out` (C++ alone holds it then) for w's gradient
        read = lambda: torch.autograd.grad(kept, w, retain_graph=True)[0]  # noqa: E731
    if holder != "tensor":
        del out
    for k in range(3):
        cluster(a, torch.full(SHAPE, float(k)))
    torch.testing.assert_close(read(), expected)


def test_only_the_clusters_called_last_keep_a_pool():
    made = [_cluster(op) for op in ("add", "subtract", "multiply", "maximum", "minimum")]
    a, b = torch.randn(SHAPE), torch.randn(SHAPE)
    limit = clusters.POOLS.LIMIT
    calls = [made[k % len(made)] for k in range(limit + 2)]
    for cluster in calls:
        cluster(a, b)
    assert all(cluster.pool is not None for cluster in made)    # (5 clusters, fewer than the limit)
    for cluster in made:
        cluster(a, b)
    for k in range(2 * limit):          # other clusters called since: pools given up
        _cluster("add")(a, b)
    assert all(cluster.pool is None for cluster in made)


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("fast_record", [True, False], ids=["fast", "dispatch"])
def test_gradients_kept_across_steps_keep_their_values(fast_record):
    """A training loop that keeps each step's gradients (as a gradient-noise probe or an EMA of
    gradients would) after `zero_grad` drops them from the parameters: the later steps' compiled runs,
    which would write the same memory if nothing held it, leave them as eager computed them."""
    torch.manual_seed(0)
    eager = _MLP()
    lazy = pydisc.lazy(copy.deepcopy(eager), fast_record=fast_record)
    kept = {"eager": [], "lazy": []}
    for model, name in ((eager, "eager"), (lazy, "lazy")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            kept[name].append([p.grad for p in model.parameters()])
            opt.zero_grad()
            if name == "lazy":
                pydisc.mark_step()
    assert pydisc.metrics()["executions"] >= 3         # (later steps ran compiled)
    for step, (e, lz) in enumerate(zip(kept["eager"], kept["lazy"])):
        for ge, gl in zip(e, lz):
            torch.testing.assert_close(gl.cpu(), ge, msg=lambda m, step=step: "step %d: %s" % (step, m))
