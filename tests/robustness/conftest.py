"""Shared fixtures for the robustness tests: every test starts and ends with nothing pending."""
from __future__ import annotations

import pytest
import torch

import pydisc
from pydisc.frontend.lazy_tensor import RECORDER


def _drain() -> None:
    try:
        pydisc.mark_step()
    except Exception:
        RECORDER.new_trace()     # a test that failed mid-step must not poison the next one
        RECORDER.end_step()


@pytest.fixture(autouse=True)
def _clean_step():
    _drain()
    torch.manual_seed(0)
    yield
    _drain()
