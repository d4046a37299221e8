"""The partitioner: clusters are convex and the fused graph computes what the original did, with
torch.fx's partitioner (small graphs) and with the linear-time one for very large graphs; large
clusters are cut into pieces of at most MAX_CLUSTER_NODES nodes."""
from __future__ import annotations

import operator
import random
import time

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pydisc.cluster import partition as partition_module
from pydisc.cluster import partition_graph
from pydisc.config import CONFIG

aten = torch.ops.aten
CPU = torch.device("cpu")


def _graph(fn, *inputs) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*inputs)


def _eager_ops(*targets):
    names = {str(t) for t in targets}

    def reason_of(node: torch.fx.Node) -> str | None:
        if node.op == "call_function" and str(node.target) in names:
            return "runs eagerly in this test"
        return None
    return reason_of


def _random_program(seed: int, n_ops: int):
    """A random DAG of unary/binary elementwise ops over three inputs; returns fn(a, b, c)."""
    rng = random.Random(seed)
    unary = [torch.sin, torch.exp, torch.tanh, torch.neg, torch.cos]
    binary = [torch.add, torch.mul, torch.sub, torch.maximum]
    plan = []
    for k in range(n_ops):
        if rng.random() < 0.5:
            plan.append(("u", rng.randrange(len(unary)), rng.randrange(3 + k)))
        else:
            plan.append(("b", rng.randrange(len(binary)), rng.randrange(3 + k), rng.randrange(3 + k)))
    outputs = sorted(rng.sample(range(3, 3 + n_ops), min(4, n_ops)))

    def fn(a, b, c):
        values = [a, b, c]
        for step in plan:
            if step[0] == "u":
                values.append(unary[step[1]](values[step[2]]) * 0.5)
            else:
                values.append(binary[step[1]](values[step[2]], values[step[3]]).clamp(-3, 3))
        return [values[i] for i in outputs]
    return fn


@pytest.mark.parametrize("proposer", ["fx", "levels"])
@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_partition_into_convex_clusters_that_compute_the_same(seed, proposer, monkeypatch):
    if proposer == "levels":
        monkeypatch.setattr(partition_module, "FX_PARTITIONER_MAX_NODES", 0)
    fn = _random_program(seed, 40)
    inputs = [torch.randn(5) for _ in range(3)]
    gm = _graph(fn, *inputs)
    want = gm(*inputs)
    eager = random.Random(seed).sample([aten.sin.default, aten.exp.default, aten.tanh.default,
                                        aten.mul.Tensor, aten.maximum.default, aten.clamp.default], 2)
    # fuse_by_partitions raises on a cluster that is not convex (a path out of it and back in)
    part = partition_graph(gm, CPU, _eager_ops(*eager), max_ops=None)
    got = part.graph_module(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    outside = [n for n in part.graph_module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    assert all(str(n.target) in {str(e) for e in eager} for n in outside)


def test_levels_cluster_a_diamond_around_an_eager_op_like_fx(monkeypatch):
    def fn(x):
        a = x.exp() + 1
        b = a.sin()          # eager
        c = a * 2            # independent of b: joins a's cluster
        return b.tanh() + c  # after b: a second cluster

    x = torch.randn(6)
    counts = {}
    for proposer, limit in (("fx", 10_000), ("levels", 0)):
        monkeypatch.setattr(partition_module, "FX_PARTITIONER_MAX_NODES", limit)
        gm = _graph(fn, x)
        part = partition_graph(gm, CPU, _eager_ops(aten.sin.default), max_ops=None)
        torch.testing.assert_close(part.graph_module(x), fn(x))
        counts[proposer] = len(part.clusters)
    assert counts == {"fx": 2, "levels": 2}


def test_getitems_of_an_eager_multi_output_op_stay_eager(monkeypatch):
    monkeypatch.setattr(partition_module, "FX_PARTITIONER_MAX_NODES", 0)

    def fn(x):
        var, mean = torch.var_mean(x.exp(), dim=0)
        return var.tanh() + mean

    x = torch.randn(4, 3)
    gm = _graph(fn, x)
    part = partition_graph(gm, CPU, _eager_ops(aten.var_mean.correction), max_ops=None)
    torch.testing.assert_close(part.graph_module(x), fn(x))
    getitems = [n for n in part.graph_module.graph.nodes if n.target is operator.getitem]
    assert any(n.args[0].target is aten.var_mean.correction for n in getitems)


def _chain(n: int):
    def fn(x):
        for k in range(n):
            x = x.sin() if k % 2 else x * 1.5
        return x
    return fn


def _chain_graph(n: int) -> torch.fx.GraphModule:
    """The graph of `_chain(n)`, built directly (make_fx takes a minute for 10,000 ops)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for k in range(n):
        x = graph.call_function(aten.sin.default, (x,)) if k % 2 else graph.call_function(aten.mul.Tensor, (x, 1.5))
    graph.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_large_graph_partitions_in_linear_time():
    timings = {}
    for n in (2500, 10_000):
        gm = _chain_graph(n)
        started = time.perf_counter()
        part = partition_graph(gm, CPU, _eager_ops(), max_ops=None)
        timings[n] = time.perf_counter() - started
        assert len(part.clusters) == 1
    # torch.fx's proposer is quadratic (and keeps every node's downstream set: 10,000 nodes would hold
    # 50 million set entries); four times the nodes must not cost sixteen times the time
    assert timings[10_000] < 8 * timings[2500] + 1.0, timings


def test_large_clusters_are_cut_in_pieces_along_the_order():
    x = torch.randn(3)
    fn = _chain(5000)
    gm = _chain_graph(5000)
    part = partition_graph(gm, CPU, _eager_ops())     # max_ops: MAX_CLUSTER_NODES
    sizes = [sum(1 for n in getattr(part.graph_module, name).graph.nodes if n.op == "call_function")
             for name in part.clusters]
    assert len(sizes) == 3 and max(sizes) <= partition_module.MAX_CLUSTER_NODES, sizes
    torch.testing.assert_close(part.graph_module(x), fn(x))


def test_a_piece_never_ends_between_a_node_and_its_getitems():
    def fn(x):
        for _ in range(4):
            var, mean = torch.var_mean(x, dim=0, keepdim=True)
            x = (x - mean) * var
        return x

    x = torch.randn(4, 3)
    gm = _graph(fn, x)
    for max_ops in range(1, 8):
        part = partition_graph(gm, CPU, _eager_ops(), max_ops=max_ops)
        for name in part.clusters:
            sub = getattr(part.graph_module, name)
            for node in sub.graph.nodes:
                if node.op == "placeholder":
                    assert isinstance(node.meta.get("val"), torch.Tensor), (max_ops, name, node)
        torch.testing.assert_close(part.graph_module(x), fn(x))


def test_on_a_gpu_scatters_that_may_repeat_coordinates_run_in_torch(monkeypatch):
    # IREE runs such a scatter on one GPU thread: the embedding gradient (index_put with accumulate) and
    # scatter_add with repeated indices stay in torch on CUDA; a scatter of one element per row (the
    # nll_loss backward) is lowered as a parallel one-hot select and stays in the cluster; max pooling
    # with indices lost to eager in every cluster measured on the H200 and runs in torch there too, as
    # does a concatenation (one unvectorized copy dispatch per piece in IREE)
    monkeypatch.setattr(partition_module, "_device_reason", lambda node, device: None)  # CPU-traced graph

    def fn(w, idx, grad, target, logits, image):
        g = torch.zeros_like(w).index_put((idx,), grad, accumulate=True)
        s = torch.zeros(4, 6).scatter_add(1, idx.view(4, 2) % 6, grad[:, :2])
        one = torch.zeros_like(logits).scatter(1, target.unsqueeze(1), -1.0)
        pooled, _ = torch.ops.aten.max_pool2d_with_indices(image, [2, 2], [2, 2])
        return g.exp(), s.exp(), one.exp(), pooled.exp(), torch.cat([w.exp(), grad], 0).exp()

    gm = _graph(fn, torch.randn(10, 3), torch.randint(0, 10, (8,)), torch.randn(8, 3), torch.randint(0, 5, (4,)),
                torch.randn(4, 5), torch.randn(1, 2, 4, 4))
    targets = {aten.index_put.default, aten.scatter_add.default, aten.scatter.value, aten.max_pool2d_with_indices.default,
               aten.cat.default}
    slow = {aten.index_put.default, aten.scatter_add.default, aten.max_pool2d_with_indices.default, aten.cat.default}
    for device, in_torch in ((torch.device("cuda"), slow),
                             (CPU, set())):
        support = partition_module._Support(device, lambda node: None, {})
        for node in gm.graph.nodes:
            if node.target in targets:
                assert support.is_node_supported({}, node) == (node.target not in in_torch), (device, node.target)
                assert bool(node.meta.pop("pydisc_library", False)) == (node.target in in_torch)


def test_on_a_gpu_a_transpose_read_only_by_matmuls_stays_a_view(monkeypatch):
    # cuBLAS reads a transposed view at no cost; inside a cluster the transpose would be an output that
    # IREE writes transposed (every weight gradient's activations in a training step). A transpose that
    # a cluster op reads too stays in the cluster.
    monkeypatch.setattr(partition_module, "_device_reason", lambda node, device: None)  # CPU-traced graph

    def fn(x, w, g):
        h = (x * 2).tanh()
        gw = h.t() @ g                  # read by mm only: a view in torch
        p = h.exp().t()                 # read by mm and by an add: stays in the cluster
        return h @ w, gw, p @ g, p + 1

    inputs = (torch.randn(6, 4), torch.randn(4, 3), torch.randn(6, 5))
    transposes = {aten.t.default, aten.permute.default}
    # on the CPU matmuls stay in the clusters unless PYDISC_CPU_MATMUL=torch
    for device, cpu_matmul, outside in ((torch.device("cuda"), "iree", 1), (CPU, "iree", 0), (CPU, "torch", 1)):
        monkeypatch.setattr(CONFIG, "cpu_matmul", cpu_matmul)
        part = partition_graph(_graph(fn, *inputs), device, lambda node: None, max_ops=None)
        top = [n for n in part.graph_module.graph.nodes if n.target in transposes]
        assert len(top) == outside and all(n.meta.get("pydisc_library") for n in top), (device, top)
        inside = [n for name in part.clusters for n in getattr(part.graph_module, name).graph.nodes
                  if n.target in transposes]
        assert len(inside) == 2 - outside, (device, inside)
        for got, want in zip(part.graph_module(*inputs), fn(*inputs)):
            torch.testing.assert_close(got, want)


def _view_outputs(part) -> list:
    """Cluster outputs that are only a view chain of one of the cluster's inputs."""
    found = []
    for name in part.clusters:
        sub = getattr(part.graph_module, name)
        out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        for node in out if isinstance(out, (list, tuple)) else [out]:
            chain = node
            while chain.op == "call_function" and (chain.target in partition_module._MOVES
                                                   or chain.target is operator.getitem):
                chain = chain.args[0]
            if chain is not node and chain.op == "placeholder":
                found.append(node)
    return found


def test_views_of_a_cluster_input_read_outside_it_are_taken_by_torch(monkeypatch):
    # A weight's view read by cuBLAS and by the cluster's update; the pieces of a matmul's result
    # (q, k, v) read by the cluster and by further matmuls; a view that is a graph output. A cluster
    # used to return each such view, which IREE wrote as a copy at every step; torch now takes its own
    # views, and the cluster keeps the chain for its own reads.
    monkeypatch.setattr(partition_module, "_device_reason", lambda node, device: None)  # CPU-traced graph

    def fn(w, x, g):
        wv = w.view(4, 6)
        y = x @ wv
        new_w = wv - 0.1 * g
        q, k = y.split(3, dim=1)
        return q @ k.t(), (q * 2).exp(), k.sum(), new_w, w.view(24)[:5] * 2

    inputs = (torch.randn(24), torch.randn(5, 4), torch.randn(4, 6))
    for device, cpu_matmul, duplicated in ((torch.device("cuda"), "iree", True), (CPU, "iree", False),
                                           (CPU, "torch", True)):
        monkeypatch.setattr(CONFIG, "cpu_matmul", cpu_matmul)
        gm = _graph(fn, *inputs)
        part = partition_graph(gm, device, lambda node: None, max_ops=None)
        views = [n for n in part.graph_module.graph.nodes if n.meta.get("pydisc_view")]
        assert bool(views) == duplicated, (device, part.graph_module.code)
        if duplicated:
            assert _view_outputs(part) == [], part.graph_module.code
            # and no later proposal (the torch-mlir route's regions) takes them back: that copied them
            # again in a BERT-base step on the H200
            support = partition_module._Support(device, lambda node: None, {})
            assert not any(support.is_node_supported({}, v) for v in views)
        for got, want in zip(part.graph_module(*inputs), fn(*inputs)):
            torch.testing.assert_close(got, want)


def test_a_view_that_another_cluster_reads_is_made_in_that_cluster(monkeypatch):
    # A select of the lifted scalars (0-d, at an offset no kernel may be handed) read by two clusters
    # with a matmul in torch between them: the second cluster takes the scalars themselves and selects
    # inside, instead of a view that torch made and the launcher must copy at every call.
    monkeypatch.setattr(partition_module, "_device_reason", lambda node, device: None)  # CPU-traced graph

    def fn(s, x, w):
        a = s.select(0, 3)
        y = (x * a + 1) @ w
        return (y * a - 2).exp()

    inputs = (torch.randn(8), torch.randn(5, 4), torch.randn(4, 6))
    gm = _graph(fn, *inputs)
    part = partition_graph(gm, torch.device("cuda"), lambda node: None, max_ops=None)
    clusters = [getattr(part.graph_module, n.target) for n in part.graph_module.graph.nodes if n.op == "call_module"]
    assert len(clusters) == 2, part.graph_module.code
    for cluster in clusters:
        shapes = [tuple(n.meta["val"].shape) for n in cluster.graph.nodes if n.op == "placeholder"]
        assert () not in shapes, cluster.code          # each reads `s` whole
        assert (8,) in shapes, cluster.code
    assert not any(n.meta.get("pydisc_view") for n in part.graph_module.graph.nodes)
    out = part.graph_module(*inputs)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, fn(*inputs))
