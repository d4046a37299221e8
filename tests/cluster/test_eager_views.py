"""A view left out of every cluster because only torch consumes it is metadata, not a fallback.

On CUDA, convolutions run in cuDNN through torch (library ops), so the view of a step input that
feeds only a convolution stays outside every cluster. The same policy is applied here on the CPU."""
import sys
from pathlib import Path

import pydisc
from pydisc import step as pstep
from pydisc.cluster import partition as P

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))


def test_view_feeding_only_library_ops_is_not_a_fallback(monkeypatch):
    import test_training

    original = P._Support.is_node_supported

    def library_policy(self, submodules, node):   # what the CUDA target does with convs and matmuls
        if node.op == "call_function" and node.target in P.LIBRARY_OPS:
            node.meta["pydisc_library"] = True
            return False
        return original(self, submodules, node)

    monkeypatch.setattr(P._Support, "is_node_supported", library_policy)
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

    original = P._Support.is_node_supported

    def library_policy(self, submodules, node):
        if node.op == "call_function" and node.target in P.LIBRARY_OPS:
            node.meta["pydisc_library"] = True
            return False
        return original(self, submodules, node)

    monkeypatch.setattr(P._Support, "is_node_supported", library_policy)
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
