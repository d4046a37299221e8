"""The recording fast path (meta-cache recipes, layout keys, shared signature parts) and the step's
structural key: what they may reuse and what must tell steps apart. Values are checked against eager
PyTorch; plan reuse through the graph-cache counters. Speed lives in bench/record_overhead.py."""
import pytest
import torch

import pydisc
from pydisc.frontend.lazy_tensor import RECORDER

aten = torch.ops.aten


# plan-cache counters are asserted: no plan (or dynamic dim) of another test may serve these steps
pytestmark = pytest.mark.usefixtures("fresh_plans")


def lazy(t):
    return pydisc.to_lazy(t.clone())


def run_steps(fn, *inputs, steps=1):
    """Run `fn` on lazy copies of `inputs`, one mark_step per step: (outputs read back, cache hits and
    misses of the last step)."""
    for _ in range(steps):
        before = pydisc.metrics()
        out = fn(*(lazy(x) for x in inputs))
        pydisc.mark_step()
        after = pydisc.metrics()
    outs = [o.cpu() for o in (out if isinstance(out, (tuple, list)) else (out,))]
    return outs, (after["graph_cache_hits"] - before["graph_cache_hits"],
                  after["graph_cache_misses"] - before["graph_cache_misses"])


def same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_a_repeated_step_reuses_its_plan_and_records_the_same_values():
    def step(x, w):
        h = torch.tanh(x @ w).transpose(0, 1)
        return h.sum(1), h.reshape(-1)[:5] * 3

    x, w = torch.randn(4, 6), torch.randn(6, 3)
    want = step(x, w)
    outs, _ = run_steps(step, x, w)
    for got, ref in zip(outs, want):
        same(got, ref)
    outs, (hits, misses) = run_steps(step, x + 1, w)
    assert (hits, misses) == (1, 0)
    for got, ref in zip(outs, step(x + 1, w)):
        same(got, ref)


def test_output_layout_follows_the_input_layout():
    # one op, one shape, three input layouts: three meta-cache entries, each with eager's strides
    x = torch.randn(5, 7)
    for t in (x, x.t().contiguous().t(), torch.randn(5, 14)[:, ::2]):
        got = pydisc.to_lazy(t)
        out = (got * 2 + 1, got.transpose(0, 1) * 1)
        pydisc.mark_step()
        same(out[0].cpu(), t * 2 + 1)
        same(out[1].cpu(), t.transpose(0, 1) * 1)


def test_bool_and_int_constants_are_told_apart():
    # True == 1 in Python: a bool tensor plus the Scalar True stays bool, plus 1 becomes int64
    x = torch.tensor([True, False, True])
    for other in (True, 1, True):
        outs, _ = run_steps(lambda t: aten.add.Scalar(t, other), x)
        same(outs[0], aten.add.Scalar(x, other))


def test_signed_zero_and_nan_constants():
    x = torch.tensor([1, 2, 3])
    outs, _ = run_steps(lambda t: aten.mul.Scalar(t, 0.0), x)
    same(outs[0], aten.mul.Scalar(x, 0.0))
    outs, (hits, misses) = run_steps(lambda t: aten.mul.Scalar(t, -0.0), x)
    assert misses == 1, "-0.0 reused the plan compiled for 0.0"
    assert torch.signbit(outs[0]).all()
    # nan != nan: a step with a nan constant must still find its plan the second time
    outs, (hits, misses) = run_steps(lambda t: aten.mul.Scalar(t, float("nan")), x, steps=2)
    assert (hits, misses) == (1, 0)
    assert outs[0].isnan().all()


def test_a_changed_argument_changes_the_structural_key():
    x = torch.randn(3, 4)
    for dim in (0, 1, 0):
        outs, (hits, misses) = run_steps(lambda t: t.sum(dim) * 2, x)
        same(outs[0], x.sum(dim) * 2)
    assert (hits, misses) == (1, 0)        # dim=0 again: the first plan


def test_mixed_dtypes_record_eager_promotion():
    a = torch.randn(4, 3)
    b = torch.randn(4, 3).to(torch.float16)
    c = torch.arange(12).reshape(4, 3)
    for pair in ((a, b), (b, c), (c, a), (a, b)):
        outs, _ = run_steps(lambda x, y: (x + y, x * 2, (x - y).sum(0)), *pair)
        for got, ref in zip(outs, (pair[0] + pair[1], pair[0] * 2, (pair[0] - pair[1]).sum(0))):
            same(got, ref)


def test_multi_output_and_in_place_ops_on_the_fast_path():
    x = torch.randn(6, 4)

    def step(t):
        values, indices = t.max(dim=1)
        parts = t.split([2, 4], dim=0)
        u = t.clone()
        u.mul_(2).add_(1)
        return values, indices, parts[1] + 0, u

    for _ in range(2):
        outs, _ = run_steps(step, x)
        for got, ref in zip(outs, step(x.clone())):
            same(got, ref)


def test_recording_reuses_signature_objects_across_steps():
    # value ids restart at 0 every step, and the objects standing for them are shared: two steps of
    # the same program have signatures that are equal part by part and identical for value parts
    x = lazy(torch.randn(3, 3))
    pydisc.mark_step()
    sigs = []
    for _ in range(2):
        y = (x * 2).relu().sum(0)
        sigs.append([e.sig for e in RECORDER.trace.entries])
        pydisc.mark_step()
        torch.testing.assert_close(y.cpu(), (x.cpu() * 2).relu().sum(0))
    assert sigs[0] == sigs[1]
    for a, b in zip(sigs[0], sigs[1]):
        for pa, pb in zip(a, b):
            if type(pa) is tuple and pa[:1] == ("v",):
                assert pa is pb
