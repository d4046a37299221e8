"""Helpers for the emitter tests: trace a function the way pydisc does, emit it, run it with IREE."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pydisc.frontend.decompositions import DECOMPOSITIONS
from pydisc.exec import compile_module
from pydisc.frontend.emit import EmittedCluster, emit_cluster


def trace(fn: Callable, *args: torch.Tensor) -> torch.fx.GraphModule:
    """The functionalized core-ATen graph of `fn`, traced on fake copies of `args`."""
    return make_fx(
        torch.func.functionalize(fn, remove="mutations_and_views"),
        decomposition_table=DECOMPOSITIONS,
        tracing_mode="fake",
    )(*args)


def _compile_and_run(cluster: EmittedCluster, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    module = compile_module(cluster.text, torch.device("cpu"))
    outputs = [torch.empty(s.shape, dtype=s.dtype) for s in cluster.outputs]
    module.run(list(inputs), outputs)
    return outputs


def run_emitted(fn: Callable, *args: torch.Tensor) -> tuple[list[torch.Tensor], EmittedCluster]:
    gm = trace(fn, *args)
    cluster = emit_cluster(gm)
    return _compile_and_run(cluster, args), cluster


def check(fn: Callable, *args: torch.Tensor, atol: float | None = None, rtol: float | None = None) -> EmittedCluster:
    """Emit `fn` as one cluster, run it with IREE and compare every output with eager torch."""
    expected = fn(*args)
    if isinstance(expected, torch.Tensor):
        expected = [expected]
    got, cluster = run_emitted(fn, *args)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype, f"output {i}: {g.dtype} vs {e.dtype}"
        torch.testing.assert_close(g, e.detach(), atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"output {i}: {m}\n")
    return cluster


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
