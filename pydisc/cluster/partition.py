"""Capability-based partitioning with a small cost policy.

`propose` and `fuse` stay apart, as in torch.fx's partitioner which does the cycle-free greedy merging:
a node is a candidate when the lowering registry can emit it (a pure predicate from the frontend) and
its tensors live on the step's device; the cost policy then drops clusters that would not pay for an
executable call (nothing but reshapes and getitems).

torch.fx's partitioner keeps, for every node, the set of all nodes downstream of it: quadratic time and
memory (a 5,000-op step spent 17 s there, and 20,000 ops would need gigabytes). Graphs above
`FX_PARTITIONER_MAX_NODES` nodes are proposed by `_propose_by_level` instead, in linear time.

A second route, torch-mlir (`add_torch_mlir_regions`), proposes regions the same way over what the
StableHLO clusters left: the StableHLO route is preferred, since it runs first and takes every node it
can; the regions take what it cannot, and eager execution keeps the rest.

In a graph with symbolic sizes, nodes that compute a size (`aten.sym_size.int`, `operator.mul` on
SymInts) join the clusters that use them like any supported op, but cost nothing (the emitter computes
them from tensor dims) and are not fallbacks where they stay outside: they are host integer arithmetic.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition as FxPartition
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions
from torch.fx.passes.operator_support import OperatorSupportBase

from ..frontend.lowering.indexing import one_per_row
from ..frontend.lowering.size_exprs import size_of
from ..frontend.policy import CUDA_ATTENTION, FREE_OPS, LIBRARY_OPS, SLOW_ON_GPU, library_ops_in_torch

__all__ = ["FX_PARTITIONER_MAX_NODES", "MAX_CLUSTER_NODES", "Partition", "add_torch_mlir_regions", "is_host_scalar",
           "partition_graph", "partition_regions"]

FX_PARTITIONER_MAX_NODES = 2000
# iree-compile's time per op grows with the size of the module (llvm-cpu, a chain of small matmuls and
# elementwise ops: 3.7 ms/op at 2,000 ops, 4.6 at 5,000, 12.9 at 20,000), and IREE's VM refused to load
# the module of a 20,000-op cluster ("register count overflow"): larger clusters are compiled in pieces
# of this many nodes.
MAX_CLUSTER_NODES = 2000

aten = torch.ops.aten
prims = torch.ops.prims
_TRANSPOSES = {aten.permute.default, aten.transpose.int, aten.t.default}

def _parallel_scatter(node: torch.fx.Node) -> bool:
    """Whether the lowering emits this scatter as a one-hot select (`lowering.indexing.one_per_row`)."""

    if node.target not in (aten.scatter.src, aten.scatter.value, aten.scatter_add.default):
        return False
    x, dim, index = (a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[:3])
    if not isinstance(x, torch.Tensor) or not isinstance(index, torch.Tensor) or not x.dim():
        return False
    return one_per_row([size_of(d) for d in x.shape], dim % x.dim(), [size_of(d) for d in index.shape])


@dataclass
class Partition:
    graph_module: torch.fx.GraphModule           # the step graph with clusters as call_module nodes
    clusters: list[str]                          # names of the cluster submodules
    eager_ops: list[str] = field(default_factory=list)   # ATen op names left to eager, one per node
    reasons: dict[str, str] = field(default_factory=dict)  # op name -> why it was not compiled
    regions: list[str] = field(default_factory=list)       # names of the torch-mlir region submodules


class _Support(OperatorSupportBase):
    def __init__(self, device: torch.device, reason_of: Callable[[torch.fx.Node], str | None],
                 reasons: dict[str, str]) -> None:
        self.device = device
        self.reason_of = reason_of
        self.reasons = reasons

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.meta.get("pydisc_view"):
            return False      # (a view left to torch on purpose: no torch-mlir region may take it)
        if self.library(node) or self._transposes_for_library(node):
            node.meta["pydisc_library"] = True   # torch's kernels (cuBLAS, cuDNN), by choice, not a fallback
            return False
        reason = self.reason_of(node)
        if reason is not None and is_host_scalar(node):
            return False  # host arithmetic on sizes (SymFloat, SymBool): runs outside, not a fallback
        if reason is None:
            reason = _device_reason(node, self.device)
        if reason is not None:
            self.reasons.setdefault(_op_name(node), reason)
            return False
        return True

    def library(self, node: torch.fx.Node) -> bool:
        """Whether `node` runs in torch's libraries by choice on this device (matmuls, convolutions,
        softmaxes; on a GPU also scatters whose coordinates may repeat, max pooling, concatenations)."""
        if node.op != "call_function":
            return False
        if node.target in LIBRARY_OPS:
            return library_ops_in_torch(self.device)
        return self.device.type == "cuda" and (node.target in CUDA_ATTENTION or node.target in SLOW_ON_GPU
                                               and not _parallel_scatter(node))

    def _transposes_for_library(self, node: torch.fx.Node) -> bool:
        """A transpose that only library ops read. In torch it is a view, which cuBLAS reads with a
        transposed layout at no cost; inside a cluster it becomes an output that IREE writes transposed
        (a GPT-2 training step had 62 of them: the activations of every weight gradient, the attention
        probabilities, the 50257x16384 logits' input, up to 1.6 GB each)."""
        return (node.target in _TRANSPOSES and bool(node.users)
                and all(self.library(user) for user in node.users))


def _device_reason(node: torch.fx.Node, device: torch.device) -> str | None:
    for n in [node, *node.all_input_nodes]:
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for v in vals:
            if isinstance(v, torch.Tensor) and v.device.type != device.type and v.dim() > 0:
                return "tensor on %s in a %s step" % (v.device, device)
    return None


_SIZE_QUERIES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.sym_storage_offset.default}
# Checks on sizes that symbolic tracing may insert (no value, nothing to compile).
_SIZE_CHECKS = {aten._assert_scalar.default, aten.sym_constrain_range.default,
                aten.sym_constrain_range_for_size.default}


def is_host_scalar(node: torch.fx.Node) -> bool:
    """Host arithmetic on sizes: a size query or a Python operator whose value is a (symbolic) scalar,
    or a check on sizes. Not `.item()` (`_local_scalar_dense`), which reads tensor data."""
    if node.target in _SIZE_CHECKS:
        return True
    if not isinstance(node.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    return node.target in _SIZE_QUERIES or not isinstance(node.target, torch._ops.OpOverload)


def _op_name(node: torch.fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target)) if node.target is operator.getitem \
        else str(node.target)


def _chunks(partition, max_ops: int, order: dict) -> list:
    """Split a partition into pieces of about `max_ops` nodes along the graph's topological order.
    Each piece stays convex: a path from a later piece back into an earlier one would need an edge
    against the order. A piece never ends between a multi-output node and its getitems (a cluster
    input must be a tensor, not a tuple)."""
    nodes = sorted(partition.nodes, key=order.__getitem__)
    pieces, start = [], 0
    while start < len(nodes):
        end = min(start + max_ops, len(nodes))
        while end < len(nodes) and nodes[end].target is operator.getitem:
            end += 1
        pieces.append(FxPartition(nodes=nodes[start:end]))
        start = end
    return pieces


def _propose_by_level(gm: torch.fx.GraphModule, support: _Support) -> list[FxPartition]:
    """Clusters in linear time: a node's level is the number of eager nodes on the longest path that
    reaches it, and the supported nodes of one level form one cluster.

    Along every edge the level never decreases, and it grows past each eager node, so a path that
    leaves a cluster through an eager node cannot come back to it: every cluster is convex, as the
    fusion requires. A supported node whose users are all supported then moves up to the lowest level
    among its users (its own level is never above theirs, so the order still holds): it joins the
    cluster that consumes it rather than becoming an output of an earlier one. Like torch.fx's
    partitioner, independent nodes of one level are fused horizontally, and the getitems of an eager
    node stay eager."""
    nodes = list(gm.graph.nodes)
    supported: dict[torch.fx.Node, bool] = {}
    level: dict[torch.fx.Node, int] = {}
    for node in nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            source = node.args[0]
            ok = supported.get(source, False) and support.is_node_supported({}, node)
        else:
            ok = support.is_node_supported({}, node)
        supported[node] = ok
        value = 0
        for source in node.all_input_nodes:
            lifted = level[source] + (0 if supported[source] or source.op in ("placeholder", "get_attr") else 1)
            value = max(value, lifted)
        level[node] = value
    groups: dict[int, list[torch.fx.Node]] = {}
    for node in reversed(nodes):
        if not supported[node]:
            continue
        if node.users and all(supported[user] for user in node.users):
            level[node] = min(level[user] for user in node.users)
        groups.setdefault(level[node], []).append(node)
    return [FxPartition(id=k, nodes=reversed(group)) for k, (_, group) in enumerate(sorted(groups.items()))]


def _propose(gm: torch.fx.GraphModule, support: _Support, min_ops: int, max_ops: int | None) -> list[FxPartition]:
    """Convex groups of supported nodes, without those that hold no compute op, in pieces of at most
    `max_ops` nodes."""
    if len(gm.graph.nodes) > FX_PARTITIONER_MAX_NODES:
        proposed = _propose_by_level(gm, support)
    else:
        proposed = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()
    kept = []
    for p in proposed:
        compute = [n for n in p.nodes if n.target not in FREE_OPS and not is_host_scalar(n)]
        if len(compute) >= max(min_ops, 1):
            kept.append(p)
    if max_ops:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        kept = [piece for p in kept for piece in _chunks(p, max_ops, order)]
        for i, p in enumerate(kept):
            p.id = i
    _getitems_with_producer(kept)
    return kept


def _getitems_with_producer(partitions: list[FxPartition]) -> None:
    """Every getitem of a multi-output node goes into the partition of that node: a cluster cannot
    return the tuple itself (max_pool2d_with_indices whose indices feed a cluster downstream). A getitem
    reads only its producer, so moving it there keeps every partition convex."""
    home = {n: p for p in partitions for n in p.nodes}
    for p in partitions:
        for node in list(p.nodes):
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem and home.get(user) is not p:
                    if user in home:
                        _discard(home[user].nodes, user)
                    _add(p.nodes, user)
                    home[user] = p


def _discard(nodes, node) -> None:     # Partition.nodes is a dict in recent torch, a set before
    if isinstance(nodes, dict):
        nodes.pop(node, None)
    else:
        nodes.discard(node)


def _add(nodes, node) -> None:
    if isinstance(nodes, dict):
        nodes[node] = None
    else:
        nodes.add(node)


def _eager(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem and not is_host_scalar(n)]


# Ops that only move or reinterpret data: a chain of them from a tensor that torch holds is free in
# torch, but a cluster that computes one as an output writes a copy.
_MOVES = FREE_OPS - {aten.detach.default, operator.getitem} | {
    aten.split_with_sizes.default, aten.split.Tensor, aten.as_strided.default, prims.broadcast_in_dim.default}
# what a duplicate runs: a reshape is a view where the layout allows, a copy (never an error) otherwise
_IN_TORCH = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def _views_in_torch(gm: torch.fx.GraphModule, partitions: list[FxPartition]) -> int:
    """Give the readers outside a cluster their own copy of each view chain that the cluster computes
    from one of its inputs.

    A chain such as `view(weight)` read both by a cluster (the optimizer's update) and by cuBLAS (the
    forward matmul) went into the cluster, which then returned the view as an output: IREE wrote a copy
    of the weight, every step (~400 device copies of a BERT-base step at batch 64 on the H200). The
    readers in torch now read a duplicate of the chain, run by torch as views (`pydisc_view`: not a
    fallback); a reader in another cluster gets a duplicate in that cluster, which then reads the
    chain's source (a view made by torch would reach it as an input it must copy where it is not dense
    and aligned: the lifted scalars, 0-d selects at odd offsets, were 288 such copies of a BERT-base
    step). The cluster keeps the chain for its own readers, if any. Returns the chains duplicated."""
    graph = gm.graph
    home = {n: p for p in partitions for n in p.nodes}
    copies: dict[tuple, torch.fx.Node] = {}

    def is_move(node) -> bool:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return False
        if node.target is aten.as_strided.default:    # strides of a step input's own memory only
            return node.args[0].op == "placeholder"
        if node.target is operator.getitem:
            return is_move(node.args[0])
        return node.target in _MOVES

    def duplicate(node: torch.fx.Node, part, into) -> torch.fx.Node:
        """`node`'s chain, from its source in `part`, for the readers in `into` (None: torch)."""
        if home.get(node) is not part:
            return node                              # the chain's source, an input of the cluster
        key = (node, None if into is None else id(into))
        if key not in copies:
            source = duplicate(node.args[0], part, into)
            target = node.target if into is not None else _IN_TORCH.get(node.target, node.target)
            with graph.inserting_before(node):       # after its source and any size it reads
                copy = graph.call_function(target, (source, *node.args[1:]), dict(node.kwargs))
            if into is None:
                copy.meta = {**node.meta, "pydisc_view": True}
            else:
                copy.meta = dict(node.meta)
                _add(into.nodes, copy)
                home[copy] = into
            copies[key] = copy
        return copies[key]

    count = 0
    for node in list(graph.nodes):
        part = home.get(node)
        if part is None or not is_move(node):
            continue
        source = node
        while is_move(source) and home.get(source) is part:
            source = source.args[0]
        outside = [u for u in node.users if home.get(u) is not part]
        if home.get(source) is part or not outside:
            continue
        for user in outside:
            user.replace_input_with(node, duplicate(node, part, home.get(user)))
        count += 1
    for node in reversed(list(graph.nodes)):     # chain nodes left with no reader
        if is_move(node) and not node.users and node in home:
            _discard(home[node].nodes, node)
            graph.erase_node(node)
    return count


def partition_graph(gm: torch.fx.GraphModule, device: torch.device,
                    reason_of: Callable[[torch.fx.Node], str | None],
                    min_ops: int = 1, max_ops: int | None = MAX_CLUSTER_NODES) -> Partition:
    reasons: dict[str, str] = {}
    support = _Support(device, reason_of, reasons)
    kept = _propose(gm, support, min_ops, max_ops)
    if _views_in_torch(gm, kept):
        kept = [p for p in kept if p.nodes]
    fused = fuse_by_partitions(gm, [p.nodes for p in kept], prefix="fused_")
    clusters = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    return Partition(fused, clusters, _eager(fused), reasons)


def add_torch_mlir_regions(part: Partition, device: torch.device,
                           reason_of: Callable[[torch.fx.Node], str | None],
                           min_ops: int = 1, max_ops: int | None = MAX_CLUSTER_NODES) -> Partition:
    """The torch-mlir route: group the eager nodes of `part` that `reason_of` accepts into convex
    regions (submodules `torch_mlir_K`, next to the clusters `fused_K`). A region's tensors must all
    live on the step's device, 0-d ones included (a region has no host scalars)."""
    reasons: dict[str, str] = {}

    def region_reason(node: torch.fx.Node) -> str | None:
        reason = reason_of(node)
        if reason is None:
            for n in [node, *node.all_input_nodes]:
                val = n.meta.get("val")
                for v in (val if isinstance(val, (tuple, list)) else (val,)):
                    if isinstance(v, torch.Tensor) and v.device.type != device.type:
                        return "tensor on %s in a %s step" % (v.device, device)
        return reason

    kept = _propose(part.graph_module, _Support(device, region_reason, reasons), min_ops, max_ops)
    if not kept:
        return part
    fused = fuse_by_partitions(part.graph_module, [p.nodes for p in kept], prefix="torch_mlir_")
    regions = [n.target for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("torch_mlir_")]
    eager = _eager(fused)
    left = set(eager)
    merged = {op: reason + ("; torch-mlir: " + reasons[op] if op in reasons else "")
              for op, reason in part.reasons.items() if op in left}
    return Partition(fused, part.clusters, eager, merged, regions)


def partition_regions(gm: torch.fx.GraphModule, device: torch.device,
                      reason_of: Callable[[torch.fx.Node], str | None], min_ops: int = 1) -> Partition:
    """`add_torch_mlir_regions` over a graph with no clusters: a region that torch-mlir rejected is
    partitioned again once the op it failed on is refused."""
    return add_torch_mlir_regions(Partition(gm, [], _eager(gm)), device, reason_of, min_ops)
