"""Fixtures for the exec tests: a `device` parameter over targets (cuda skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from pydisc.metrics import METRICS

CUDA = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[CUDA, needs_cuda])])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param, 0) if request.param == "cuda" else torch.device("cpu")


@pytest.fixture
def metrics():
    METRICS.reset()
    yield METRICS
    METRICS.reset()
