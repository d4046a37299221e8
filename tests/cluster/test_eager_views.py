"""A view left out of every cluster because only torch consumes it is metadata, not a fallback.

On CUDA, convolutions run in cuDNN through torch (library ops), so the view of a step input that
feeds only a convolution stays outside every cluster. The same policy is applied here on the CPU."""
import sys
from pathlib import Path

import pydisc
from pydisc.driver import step as pstep
from pydisc.cluster import partition as P
from pydisc.config import CONFIG

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))


def _library_policy(monkeypatch):
    """What the CUDA target does with convolutions and matmuls (and the transposes only they read;
    addmm and baddbmm kept whole), applied on the CPU: PYDISC_CPU_MATMUL=torch."""
    monkeypatch.setattr(CONFIG, "cpu_matmul", "torch")


def test_view_feeding_only_library_ops_is_not_a_fallback(monkeypatch):
    import test_training

    _library_policy(monkeypatch)
    pstep.clear_plans()
    try:
        # trains eager and pydisc side by side, asserts equal losses and states, and no fallback ops
        test_training.test_cnn_batchnorm_training_matches_eager("cpu")
        assert pydisc.metrics()["library_ops"]
    finally:
        pstep.clear_plans()


def test_getitems_of_a_multi_output_op_stay_with_it(monkeypatch):
    """max_pool2d_with_indices in one cluster, its indices used by the backward in a cluster after a
    library op: the indices' getitem must be computed in the producer's cluster (a cluster cannot return
    the tuple itself). The linear-time proposer (graphs over 2,000 nodes, like ResNet's) moved it to
    its user's cluster."""
    import torch
    import torch.nn.functional as F

    _library_policy(monkeypatch)
    monkeypatch.setattr(P, "FX_PARTITIONER_MAX_NODES", 0)
    pstep.clear_plans()
    pydisc.reset_metrics()
    torch.manual_seed(0)
    x = torch.randn(2, 4, 12, 12)
    w = torch.randn(4, 4, 3, 3)

    def step(x, w):
        y = F.max_pool2d(torch.relu(x * 1.5), 3, 2, 1)
        return F.conv2d(y, w, padding=1).square().sum()

    lx = pydisc.to_lazy(x.clone()).requires_grad_()
    lw = pydisc.to_lazy(w.clone()).requires_grad_()
    step(lx, lw).backward()
    pydisc.mark_step()
    ex, ew = x.clone().requires_grad_(), w.clone().requires_grad_()
    step(ex, ew).backward()
    torch.testing.assert_close(lx.grad.cpu(), ex.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lw.grad.cpu(), ew.grad, rtol=1e-4, atol=1e-4)
    m = pydisc.metrics()
    assert m["compile_failures"] == {} and m["fallback_ops"] == {}, (m["compile_failures"], m["fallback_ops"])
    pstep.clear_plans()


def test_transposes_read_only_by_matmuls_run_as_views_in_training(monkeypatch):
    """An attention step with matmuls left to torch: the transposed activations of the weight
    gradients and of the attention probabilities are views in torch, not cluster outputs; the
    values equal eager's."""
    import copy

    import torch
    import torch.nn as nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = (z.view(3, 5, 2, 8).transpose(1, 2) for z in self.qkv(x).split(16, dim=2))
            p = ((q @ k.transpose(-2, -1)) * 0.35).softmax(-1)
            return self.out((p @ v).transpose(1, 2).reshape(3, 5, 16)).tanh()

    _library_policy(monkeypatch)
    pstep.clear_plans()
    pydisc.reset_metrics()
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(3, 5, 16)
    twin = pydisc.lazy(copy.deepcopy(model))
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    for _ in range(3):
        for m, o in ((model, opt), (twin, twin_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        pydisc.mark_step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-4, atol=1e-5)
    m = pydisc.metrics()
    assert m["fallback_ops"] == {} and m["compile_failures"] == {}, (m["fallback_ops"], m["compile_failures"])
    assert m["library_ops"].get("aten.permute.default", 0) > 0, m["library_ops"]
    # the linear layers: whole addmms in torch (their decomposition would compute bf16 ones in float32)
    assert m["library_ops"].get("aten.addmm.default", 0) > 0, m["library_ops"]
    pstep.clear_plans()
