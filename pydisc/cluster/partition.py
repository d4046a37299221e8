"""Capability-based partitioning with a small cost policy.

`propose` and `fuse` stay apart, as in torch.fx's partitioner which does the cycle-free greedy merging:
a node is a candidate when the lowering registry can emit it (a pure predicate from the frontend) and
its tensors live on the step's device; the cost policy then drops clusters that would not pay for an
executable call (nothing but reshapes and getitems).

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
from torch.fx.passes.operator_support import OperatorSupportBase

__all__ = ["Partition", "is_host_scalar", "partition_graph"]

aten = torch.ops.aten
# Ops that move no data: a cluster made only of these is not worth an executable call.
_FREE_OPS = {operator.getitem, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
             aten.alias.default, aten.detach.default, aten.expand.default, aten.permute.default,
             aten.t.default, aten.transpose.int, aten.select.int, aten.slice.Tensor}


@dataclass
class Partition:
    graph_module: torch.fx.GraphModule           # the step graph with clusters as call_module nodes
    clusters: list[str]                          # names of the cluster submodules
    eager_ops: list[str] = field(default_factory=list)   # ATen op names left to eager, one per node
    reasons: dict[str, str] = field(default_factory=dict)  # op name -> why it was not compiled


class _Support(OperatorSupportBase):
    def __init__(self, device: torch.device, reason_of: Callable[[torch.fx.Node], str | None],
                 reasons: dict[str, str]) -> None:
        self.device = device
        self.reason_of = reason_of
        self.reasons = reasons

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        if node.op != "call_function":
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
    """Split a partition into pieces of at most `max_ops` nodes along the graph's topological order.
    Each piece stays convex: a path from a later piece back into an earlier one would need an edge
    against the order."""
    nodes = sorted(partition.nodes, key=order.__getitem__)
    return [FxPartition(nodes=nodes[i:i + max_ops]) for i in range(0, len(nodes), max_ops)]


def partition_graph(gm: torch.fx.GraphModule, device: torch.device,
                    reason_of: Callable[[torch.fx.Node], str | None],
                    min_ops: int = 1, max_ops: int | None = None) -> Partition:
    reasons: dict[str, str] = {}
    partitioner = CapabilityBasedPartitioner(gm, _Support(device, reason_of, reasons),
                                             allows_single_node_partition=True)
    proposed = partitioner.propose_partitions()
    kept = []
    for p in proposed:
        compute = [n for n in p.nodes if n.target not in _FREE_OPS and not is_host_scalar(n)]
        if len(compute) >= max(min_ops, 1):
            kept.append(p)
    if max_ops:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        kept = [piece for p in kept for piece in _chunks(p, max_ops, order)]
        for i, p in enumerate(kept):
            p.id = i
    fused = partitioner.fuse_partitions(kept)
    clusters = [n.target for n in fused.graph.nodes if n.op == "call_module"]
    eager = [str(n.target) for n in fused.graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem and not is_host_scalar(n)]
    return Partition(fused, clusters, eager, reasons)
