"""Wrong results and faults found on the H200 with real models, each reduced to the pattern that caused
it; compared with eager under both CUDA executors."""
from __future__ import annotations

import pytest
import torch

import pydisc
from pydisc.config import CONFIG
from pydisc.exec import clear_cache

pytestmark = pytest.mark.cuda

EXECUTORS = ["direct", "iree"]


@pytest.fixture(params=EXECUTORS)
def executor(request, monkeypatch):
    monkeypatch.setattr(CONFIG, "gpu_executor", request.param)
    clear_cache()
    yield request.param
    clear_cache()


def _twice(fn, *args):
    """`fn` under pydisc twice (the second run from the cached plan) and eagerly."""
    want = fn(*args)
    for _ in range(2):
        got = fn(*[pydisc.to_lazy(a) for a in args])
        pydisc.mark_step()
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)
    assert pydisc.metrics()["executions"] > 0


def test_gather_of_a_slice_of_a_wider_tensor(executor):
    """Llama's RoPE backward indexes the last dim of `x[..., :4]`: IREE 3.13's CUDA code read the rows of
    the slice's width, not the buffer's (errors as large as the values). The gather now reads its operand
    behind a barrier (frontend/lowering/indexing.py, `_whole`)."""
    x = torch.randn(2, 4, 12, 8, device="cuda")
    idx = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], device="cuda")
    _twice(lambda x, i: (x * 2)[..., :4][..., i] + (x * 3)[..., 4:8][..., i], x, idx)


def test_a_host_scalar_written_into_a_cuda_tensor(executor):
    """T5's and BART's shift-right (`ids[:, 0] = start`): torch makes the 7 a 0-d CPU tensor, which the
    cluster received as is; its host address faulted in the kernel (illegal address)."""
    def shift_right(ids):
        out = ids.new_zeros(ids.shape)
        out[:, 1:] = ids[:, :-1].clone()
        out[:, 0] = 7
        return out * 3 + 1

    _twice(shift_right, torch.arange(12, device="cuda").reshape(2, 6))
