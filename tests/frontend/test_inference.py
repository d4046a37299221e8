"""Steps without grad record `F.linear` and `matmul` whole (frontend/inference.py); with grad or under
autocast they take torch's usual path. Values against eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pydisc
from pydisc.frontend import inference
from pydisc.frontend.lazy_tensor import current_trace

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def removed_after():
    # what a test installs (a forward without grad) is removed again, as a forward with grad does: later
    # tests record under no_grad without it
    yield
    with torch.enable_grad():
        inference.use_for_forward()
    assert not inference.installed()


class Net(nn.Module):
    """Linear layers on a 3-D input, a batched matmul (attention scores), a matmul with a plain tensor
    on the left, a matrix-vector product and F.linear without a bias."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8, bias=False)
        self.register_buffer("v", torch.randn(8))

    def forward(self, x, plain):
        h = self.inp(x)                                  # [b, t, 32]
        scores = h @ h.transpose(1, 2)                   # [b, t, t]
        h = torch.matmul(scores.softmax(-1), h)          # [b, t, 32]
        h = F.linear(h, self.out.weight)                 # [b, t, 8]
        left = plain @ h                                 # a plain [t, t] on the left: [b, t, 8]
        return h.matmul(self.v) + left.sum(-1)           # [b, t]


def _ops(trace) -> list:
    return [e.fn for e in trace.entries]


def _models():
    torch.manual_seed(0)
    ref = Net()
    lazy = Net()
    lazy.load_state_dict(ref.state_dict())
    return ref, pydisc.lazy(lazy)


def test_without_grad_linear_and_matmul_are_recorded_whole_and_match_eager():
    ref, model = _models()
    x, plain = torch.randn(3, 5, 16), torch.randn(5, 5)
    with torch.no_grad():
        want = ref(x, plain)
        got = model(x, plain)
        ops = _ops(current_trace())
    assert ops.count(aten.linear.default) == 2 and ops.count(aten.matmul.default) == 4
    assert aten.addmm.default not in ops and aten.bmm.default not in ops and aten.mm.default not in ops
    pydisc.mark_step()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_with_grad_they_are_split_and_gradients_match_eager():
    ref, model = _models()
    x, plain = torch.randn(3, 5, 16), torch.randn(5, 5)
    with torch.no_grad():
        model(x, plain)          # an inference step first: F.linear recorded whole ...
    assert aten.linear.default in _ops(current_trace())
    pydisc.mark_step()
    ref(x, plain).square().sum().backward()
    loss = model(x, plain).square().sum()
    ops = _ops(current_trace())      # ... and not in a forward with grad (on the fast path: its own calls)
    assert aten.linear.default not in ops and aten.matmul.default not in ops
    loss.backward()
    pydisc.mark_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_under_autocast_they_take_torchs_path_and_are_cast():
    ref, model = _models()
    x, plain = torch.randn(3, 5, 16), torch.randn(5, 5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x, plain)
        got = model(x, plain)
        ops = _ops(current_trace())
    assert aten.linear.default not in ops and aten.matmul.default not in ops
    pydisc.mark_step()
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shapes", [((4,), (4,)), ((4,), (4, 3)), ((2, 4), (4,)), ((2, 3, 4), (4, 5)),
                                    ((2, 1, 3, 4), (5, 4, 2))])
def test_matmul_shapes_recorded_whole_match_eager(shapes):
    # every matmul case torch distinguishes (dot, vector-matrix, matrix-vector, folded, broadcast batch)
    a, b = (torch.randn(s) for s in shapes)
    la, lb = pydisc.to_lazy(a.clone()), pydisc.to_lazy(b.clone())
    with torch.no_grad():
        inference.use_for_forward()          # what a lazy module's forward does
        got = la @ lb
        assert _ops(current_trace()) == [aten.matmul.default]
    pydisc.mark_step()
    torch.testing.assert_close(got.cpu(), a @ b, rtol=1e-5, atol=1e-5)


def test_a_step_recorded_with_symbolic_sizes_records_them_whole_too():
    # the template of a dynamic batch is recorded with symbolic sizes (under a dispatch mode of pydisc's
    # own); later steps, recorded with concrete sizes, must record the same ops to match it
    from pydisc.frontend.lazy_tensor import RECORDER
    from pydisc.driver.step import clear_plans

    clear_plans()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    ref.load_state_dict(net.state_dict())
    pydisc.lazy(net)
    pydisc.reset_metrics()
    symbolic_ops = None
    with torch.no_grad():
        for n in (5, 7, 9, 31, 2):
            x = torch.randn(n, 8)
            out = net(x)
            if RECORDER.symbolic is not None:
                symbolic_ops = _ops(current_trace())
            pydisc.mark_step()
            torch.testing.assert_close(out.cpu(), ref(x), rtol=1e-5, atol=1e-6)
    assert symbolic_ops is not None and symbolic_ops.count(aten.linear.default) == 2
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] == 2, m
    clear_plans()
