"""PYDISC_CPU_MATMUL=torch: on the CPU too, matmuls, convolutions and softmaxes run in torch's libraries
(oneDNN, MKL) between the compiled clusters, as they do on a GPU. Values against eager; the ops that ran
in torch through the library counters."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.config import CONFIG
from pydisc.driver.step import clear_plans


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(h.flatten(1)).log_softmax(-1)


@pytest.mark.parametrize("cpu_matmul", ["torch", "iree"])
def test_cpu_training_with_library_ops_in_torch_matches_eager(monkeypatch, cpu_matmul):
    monkeypatch.setattr(CONFIG, "cpu_matmul", cpu_matmul)
    clear_plans()
    torch.manual_seed(0)
    ref = Net()
    model = pydisc.lazy(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    pydisc.reset_metrics()
    for _ in range(3):
        losses = []
        for m, opt in zip((ref, model), opts):
            loss = F.nll_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        pydisc.mark_step()
        torch.testing.assert_close(losses[1].cpu(), losses[0].detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    library = pydisc.metrics()["library_ops"]
    if cpu_matmul == "torch":
        assert library["aten.convolution.default"] and library["aten.convolution_backward.default"], library
        assert library["aten.addmm.default"] or library["aten.mm.default"], library
        assert pydisc.metrics()["executions"] > 0       # the rest still runs compiled
    else:
        assert not library, library
    clear_plans()
