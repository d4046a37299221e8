"""Strict mode, the fallback ledger, the recompile explainer, dumps and the numerics check."""
import os

import pytest
import torch

import pydisc
from pydisc.config import CONFIG


@pytest.fixture
def config(monkeypatch):
    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setattr(CONFIG, k, v)
    return set_


def test_strict_mode_raises_at_the_fallback_line(config):
    config(strict=True)
    x = pydisc.to_lazy(torch.randn(4))
    pydisc.mark_step()
    with pytest.raises(pydisc.StrictModeError) as info:
        torch.nonzero(x * 2)  # STRICT-LINE
    assert "nonzero" in str(info.value)
    assert "test_diagnostics.py:%d" % _line_of("STRICT-LINE") in str(info.value)
    from pydisc.frontend.lazy_tensor import RECORDER
    RECORDER.new_trace()


def test_strict_mode_raises_on_read_before_mark_step(config):
    config(strict=True)
    x = pydisc.to_lazy(torch.randn(4))
    y = x * 2
    with pytest.raises(pydisc.StrictModeError, match="read before mark_step"):
        y.sum().item()
    from pydisc.frontend.lazy_tensor import RECORDER
    RECORDER.new_trace()


def test_ledger_names_op_dtype_and_source_line():
    pydisc.reset_metrics()
    x = pydisc.to_lazy(torch.randn(6))
    pydisc.mark_step()
    y = torch.special.bessel_j0(x)  # LEDGER-LINE
    pydisc.mark_step()
    m = pydisc.metrics()
    op = next(k for k in m["fallback_ops"] if "bessel_j0" in k)
    assert "test_diagnostics.py:%d" % _line_of("LEDGER-LINE") in m["fallback_sources"][op]
    assert m["fallback_dtypes"][op] == ["float32"]
    report = pydisc.metrics_report()
    assert "bessel_j0" in report and "first at" in report
    torch.testing.assert_close(y.cpu(), torch.special.bessel_j0(x.cpu()))


def test_ledger_names_the_source_line_of_a_new_graph_after_a_steady_state():
    """Steps that reuse a plan record no source lines (they cost 1-3 µs per op); an op with no rule of
    its own is the exception, so a fallback in a new graph after a steady state still has its line."""
    pydisc.reset_metrics()
    x = pydisc.to_lazy(torch.randn(5))
    for _ in range(3):
        (x * 2).sum().cpu()
        pydisc.mark_step()
    assert pydisc.metrics()["graph_cache_hits"] >= 1
    y = torch.special.bessel_y0(x.abs() + 1)  # STEADY-LINE
    pydisc.mark_step()
    m = pydisc.metrics()
    op = next(k for k in m["fallback_ops"] if "bessel_y0" in k)
    assert "test_diagnostics.py:%d" % _line_of("STEADY-LINE") in m["fallback_sources"][op]
    torch.testing.assert_close(y.cpu(), torch.special.bessel_y0(x.cpu().abs() + 1))


@pytest.mark.parametrize("dynamic", [True, False])
def test_recompile_explainer_names_the_changed_dimension(config, dynamic):
    """An eager tensor has fixed sizes: one plan per shape, with or without dynamic shapes, and the
    explainer names the change (and, with dynamic shapes on, how to let the size vary)."""
    from pydisc.driver.step import clear_plans
    config(dynamic=dynamic)
    clear_plans()
    pydisc.reset_metrics()
    w = pydisc.to_lazy(torch.randn(8, 4))
    pydisc.mark_step()
    for batch in (3, 3, 5):
        x = torch.randn(batch, 8)
        out = (x @ w).relu()
        pydisc.mark_step()
    m = pydisc.metrics()
    assert any("eager input 0 changed" in r and "(3, 8)" in r and "(5, 8)" in r and
               (("to_lazy" in r) == dynamic) for r in m["recompiles"]), m["recompiles"]
    assert out.shape == (5, 4)
    torch.testing.assert_close(out.cpu(), (x @ w.cpu()).relu())


def test_dump_dir_writes_graph_partition_dot_and_mlir(config, tmp_path):
    config(dump_dir=str(tmp_path))
    x = pydisc.to_lazy(torch.randn(4, 4))
    y = (x.exp() + 1).sum(0)
    pydisc.mark_step()
    names = os.listdir(tmp_path)
    assert any(n.endswith("_partition.txt") for n in names)
    assert any(n.endswith("_partition.dot") for n in names)
    assert any(n.endswith("_graph.txt") for n in names)
    recorded = [n for n in names if n.endswith("_recorded.txt")]
    assert recorded and "aten.exp.default" in open(tmp_path / recorded[0]).read()
    flags = [n for n in names if n.endswith("_flags.txt")]
    assert flags and "--iree-hal-target-device" in open(tmp_path / flags[0]).read()
    mlir = [n for n in names if n.endswith(".mlir")]
    assert mlir and "stablehlo" in open(tmp_path / mlir[0]).read()
    torch.testing.assert_close(y.cpu(), (x.cpu().exp() + 1).sum(0))


def test_numerics_check_catches_a_wrong_lowering(config, monkeypatch):
    from pydisc.frontend.lowering import registry
    aten = torch.ops.aten
    original = registry.LOWERINGS[aten.exp.default]

    def wrong_exp(ctx, *args, **kwargs):   # exp lowered as exp(x) + exp(x): injected bug
        v = original(ctx, *args, **kwargs)
        return registry.LOWERINGS[aten.add.Tensor](ctx, v, v)

    monkeypatch.setitem(registry.LOWERINGS, aten.exp.default, wrong_exp)
    config(check_every=1)
    pydisc.reset_metrics()
    x = pydisc.to_lazy(torch.randn(5, 7))
    y = (x * 1.25).exp() - 3     # a structure no other test compiles, so the bad rule is used
    with pytest.warns(pydisc.PydiscWarning, match="numerics check"):
        pydisc.mark_step()
    m = pydisc.metrics()
    assert m["numerics_checks"] >= 1 and m["numerics_mismatches"]
    assert "diverges from eager" in m["numerics_mismatches"][0]
    del y


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def test_cluster_too_large_for_the_target_is_split_and_still_compiled(monkeypatch):
    # IREE's CUDA driver refuses kernels with more than 16 bindings at load time; simulate that limit
    # on the CPU for clusters of more than 3 ops and check that the cluster is compiled in pieces
    import pydisc.exec as pexec
    real_compile = pexec.compile_module
    sizes = []

    def limited(text, device):
        n_ops = text.count("// aten.")
        sizes.append(n_ops)
        if n_ops > 3:
            raise ValueError("Error creating vm context with modules: exports[0] binding_flags count 40 "
                             "exceeds maximum of 16")
        return real_compile(text, device)

    monkeypatch.setattr(pexec, "compile_module", limited)
    pydisc.reset_metrics()
    x = pydisc.to_lazy(torch.randn(4, 5))
    y = ((x.sin() * 2.5 + 1).exp().tanh() - x.cos()).abs()    # a fresh 7-op structure
    pydisc.mark_step()
    m = pydisc.metrics()
    assert m["compile_failures"] == {} and m["fallback_ops"] == {}
    assert max(sizes) > 3 and m["clusters"] >= 2
    xc = x.cpu()
    torch.testing.assert_close(y.cpu(), ((xc.sin() * 2.5 + 1).exp().tanh() - xc.cos()).abs())


def test_strict_mode_raises_when_planning_leaves_an_op_eager(config, monkeypatch):
    """Strict mode's refusal at planning (an op the partitioner leaves to torch) reaches the user; it is
    not taken for a fault of pydisc's planning, which would run the step eagerly."""
    from pydisc.driver.step import clear_plans
    from pydisc.frontend.lowering import registry
    config(strict=True, compile_after=1, torch_mlir=False)
    monkeypatch.setitem(registry.SUPPORT_CHECKS, torch.ops.aten.tanh.default, lambda node: "refused by the test")
    clear_plans()
    x = pydisc.to_lazy(torch.randn(5))
    y = torch.tanh(x * 3)
    with pytest.raises(pydisc.StrictModeError, match="refused by the test"):
        pydisc.mark_step()
    del y
    from pydisc.frontend.lazy_tensor import RECORDER
    RECORDER.new_trace()
    clear_plans()
