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
