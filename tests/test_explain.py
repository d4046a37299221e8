"""`pydisc.explain` says what a step does with an op: each answer is checked against a step that runs
the op, on the CPU, under the setting the answer is given for."""
import pytest
import torch

import pydisc
from pydisc.config import CONFIG
from pydisc.explain import explain, main, resolve

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("fresh_plans")


def _a():
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(0))


def _b():
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


CASES = [   # op, step function over lazy tensors (a, b), PYDISC_CPU_MATMUL, PYDISC_TORCH_MLIR, route
    (aten.mm.default, lambda a, b: a @ b, "iree", True, "compiled"),
    (aten.mm.default, lambda a, b: a @ b, "torch", True, "library"),
    (aten.addmm.default, lambda a, b: torch.addmm(b[0], a, b), "iree", True, "decomposed"),
    (aten.addmm.default, lambda a, b: torch.addmm(b[0], a, b), "torch", True, "library"),
    (aten._softmax.default, lambda a, b: torch.softmax(a, -1) * 2, "iree", True, "decomposed"),
    (aten.nonzero.default, lambda a, b: torch.nonzero(a > 0), "iree", True, "eager"),
    (aten._cdist_forward.default, lambda a, b: torch.cdist(a, a) + 1, "iree", False, "fallback"),
]


@pytest.mark.parametrize("op,fn,cpu_matmul,torch_mlir,route", CASES,
                         ids=["%s-%s" % (c[0]._opname, c[2]) for c in CASES])
def test_the_route_explain_gives_is_the_route_a_step_takes(monkeypatch, op, fn, cpu_matmul, torch_mlir, route):
    monkeypatch.setattr(CONFIG, "cpu_matmul", cpu_matmul)
    monkeypatch.setattr(CONFIG, "torch_mlir", torch_mlir)
    got = explain(op, "cpu")
    assert got.route == route, got

    pydisc.reset_metrics()
    out = fn(pydisc.to_lazy(_a()), pydisc.to_lazy(_b()))
    pydisc.mark_step()
    torch.testing.assert_close(out.cpu(), fn(_a(), _b()))
    m = pydisc.metrics()
    name = str(op)
    assert (name in m["fallback_ops"]) == (route in ("eager", "fallback")), m["fallback_ops"]
    assert (name in m["library_ops"]) == (route == "library"), m["library_ops"]
    if route in ("compiled", "decomposed", "library"):
        assert not m["fallback_ops"], m["fallback_ops"]
    if route in ("compiled", "decomposed"):
        assert m["executions"] >= 1


def test_a_read_is_not_a_fallback():
    assert explain("aten._local_scalar_dense", "cpu").route == "read"
    pydisc.reset_metrics()
    value = (pydisc.to_lazy(_a()).sum() * 0 + 3).item()
    assert value == 3.0
    assert "aten._local_scalar_dense.default" not in pydisc.metrics()["fallback_ops"]


def test_cuda_policy_is_answered_without_a_gpu(monkeypatch):
    monkeypatch.setattr(CONFIG, "gpu_matmul", "torch")
    assert explain(aten.mm.default, "cuda").route == "library"
    assert explain(aten.index_put.default, "cuda").route == "library"       # a serial scatter on a GPU
    assert explain(aten.index_put.default, "cpu").route == "compiled"
    assert explain(aten._scaled_dot_product_efficient_attention.default, "cuda").route == "library"
    monkeypatch.setattr(CONFIG, "gpu_matmul", "iree")
    assert explain(aten.mm.default, "cuda").route == "compiled"
    assert explain(aten.addmm.default, "cuda").route == "decomposed"


def test_names_and_errors(capsys):
    assert resolve("aten.mm.default") == [aten.mm.default]
    assert resolve("mm") == resolve("aten.mm") and aten.mm.default in resolve("mm")
    assert aten.add.Tensor in resolve("aten.add") and aten.add.out not in resolve("aten.add")
    assert explain("aten.linear.default").route == "split"
    in_place = explain("aten.add_.Tensor")      # functionalized into add.Tensor, which is compiled
    assert in_place.route == "compiled" and in_place.op == "aten.add_.Tensor" and "aten.add.Tensor" in in_place.notes[0]
    with pytest.raises(ValueError, match="not an ATen op"):
        resolve("aten.no_such_op")
    with pytest.raises(ValueError, match="several overloads"):
        explain("aten.add")
    assert main(["aten.mm", "--device", "cpu"]) == 0
    assert "aten.mm.default on cpu: compiled" in capsys.readouterr().out
    assert main(["nonsense_op"]) == 2
    assert "not an ATen op" in capsys.readouterr().err
