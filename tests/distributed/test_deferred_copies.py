"""The deferred copies behind pydisc's DDP hook, in one process: a gradient marked by its parameter's
post-accumulate-grad hook is copied into a plain tensor inside the recorded step, and lands there when
the step runs (at the end of backward at the latest); unmarked copies run at once, as before."""
from __future__ import annotations

import torch

import pydisc
from pydisc.frontend.collectives import defer_next_copy, flush_deferred_writes
from pydisc.metrics import METRICS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _backward_with_copies(model, bucket, mark: bool, seen: list, flush_after: int | None = None):
    """Copy each gradient into its slot of the flat plain tensor `bucket` from a post-accumulate-grad
    hook (as DDP's reducer does from its own hook); `seen` gets the slot's content right after."""
    offsets, start = {}, 0
    for p in model.parameters():
        offsets[p] = start
        start += p.numel()

    def copy_into_bucket(p):
        slot = bucket[offsets[p]: offsets[p] + p.numel()].view(p.shape)
        slot.copy_(p.grad)
        seen.append(slot.clone())
        if flush_after is not None and len(seen) == flush_after:
            flush_deferred_writes()

    handles = []
    for p in model.parameters():
        if mark:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: defer_next_copy(p.grad)))
        handles.append(p.register_post_accumulate_grad_hook(copy_into_bucket))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()
    for h in handles:
        h.remove()
    return offsets


def _expected(offsets, model, size):
    eager = _model()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    eager(x).square().sum().backward()
    out = torch.zeros(size)
    for (p, start), e in zip(offsets.items(), eager.parameters()):
        out[start: start + p.numel()] = e.grad.reshape(-1)
    return out


def test_marked_copies_are_recorded_and_land_at_the_end_of_backward():
    model = pydisc.lazy(_model())
    bucket = torch.zeros(sum(p.numel() for p in model.parameters()))
    METRICS.reset()
    seen = []
    offsets = _backward_with_copies(model, bucket, mark=True, seen=seen)
    assert all(bool((s == 0).all()) for s in seen), "a marked copy ran at once"
    assert METRICS.materializations == 0
    torch.testing.assert_close(bucket, _expected(offsets, model, bucket.numel()))
    pydisc.mark_step()


def test_flush_fills_the_slots_recorded_so_far():
    model = pydisc.lazy(_model())
    bucket = torch.zeros(sum(p.numel() for p in model.parameters()))
    seen = []
    offsets = _backward_with_copies(model, bucket, mark=True, seen=seen, flush_after=2)
    torch.testing.assert_close(bucket, _expected(offsets, model, bucket.numel()))
    pydisc.mark_step()


def test_unmarked_copies_run_at_once():
    model = pydisc.lazy(_model())
    bucket = torch.zeros(sum(p.numel() for p in model.parameters()))
    METRICS.reset()
    seen = []
    offsets = _backward_with_copies(model, bucket, mark=False, seen=seen)
    assert all(bool((s != 0).any()) for s in seen)
    assert METRICS.materializations == len(seen)     # each copy ran the part of the step it needs
    torch.testing.assert_close(bucket, _expected(offsets, model, bucket.numel()))
    pydisc.mark_step()
