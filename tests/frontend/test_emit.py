"""emit_cluster's contract: signature, output annotations, odd outputs, errors and the support predicate."""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from conftest import _compile_and_run, check, trace
from pydisc.frontend.emit import EmittedCluster, LoweringError, TensorSpec, emit_cluster, unsupported_reason


def test_signature_and_abi_outputs() -> None:
    cluster = emit_cluster(trace(lambda x, i: [x * 2, i + 1], torch.randn(2, 3), torch.zeros(4, dtype=torch.int32)))
    assert isinstance(cluster, EmittedCluster)
    assert cluster.inputs == (TensorSpec((2, 3), torch.float32), TensorSpec((4,), torch.int32))
    assert cluster.outputs == cluster.inputs
    assert "%out0: !hal.buffer_view, %out1: !hal.buffer_view)" in cluster.text
    assert cluster.text.count("hal.tensor.alias") == 2
    assert "tensor<2x3xf32> to %out0 : !hal.buffer_view" in cluster.text
    assert "tensor<4xi32> to %out1 : !hal.buffer_view" in cluster.text
    assert cluster.ops == ("aten.mul.Tensor", "aten.add.Tensor")


def test_repeated_and_passthrough_outputs() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        z = x + y
        return [z, x, z, y.to(torch.uint8)]

    check(fn, torch.randn(3), torch.randn(3) * 10)


def test_zero_d_and_bf16_io() -> None:
    check(lambda x, s: [x * s, s.exp()], torch.randn(4, dtype=torch.bfloat16), torch.tensor(0.5, dtype=torch.bfloat16))


def test_unsupported_reason_and_lowering_error() -> None:
    gm = trace(lambda x: torch.linalg.qr(x)[0] + 1, torch.randn(3, 3))
    reasons = {n.name: unsupported_reason(n) for n in gm.graph.nodes}
    assert any(r and "no lowering rule" in r for r in reasons.values())
    assert all(unsupported_reason(n) is None for n in gm.graph.nodes if n.op in ("placeholder", "output"))
    with pytest.raises(LoweringError) as info:
        emit_cluster(gm)
    assert info.value.op is torch.ops.aten.linalg_qr.default
    complex_gm = trace(lambda x: x * 2, torch.randn(2, dtype=torch.complex64))
    mul = next(n for n in complex_gm.graph.nodes if n.op == "call_function")
    assert "complex64" in unsupported_reason(mul)


class _Supported(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:  # noqa: ANN001
        return unsupported_reason(node) is None


def test_partitioned_clusters_compile() -> None:
    """Clusters cut by torch's partitioner around an unsupported op (getitem included) each emit and run."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = (x.sin() * 2).max(dim=1)
        q = torch.linalg.qr(y.values.reshape(2, 2))[0]
        return q.relu() + y.indices.float().sum()

    x = torch.randn(4, 3)
    gm = trace(fn, x)
    parts = CapabilityBasedPartitioner(gm, _Supported(), allows_single_node_partition=True).propose_partitions()
    fused = CapabilityBasedPartitioner(gm, _Supported(), allows_single_node_partition=True).fuse_partitions(parts)
    submodules = [m for name, m in fused.named_children() if name.startswith("fused_")]
    assert len(submodules) == 2
    for sub in submodules:
        cluster = emit_cluster(sub)
        inputs = [torch.randn(s.shape).to(s.dtype) for s in cluster.inputs]
        outputs = _compile_and_run(cluster, inputs)
        expected = sub(*inputs)   # the same cluster run by torch
        expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want)
    assert any(n.target is operator.getitem for sub in submodules for n in sub.graph.nodes)
