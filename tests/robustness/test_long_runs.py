"""Long runs: host memory and pydisc's own tables stay flat over thousands of training steps, very large
steps plan and compile in one mark_step and equal eager, and pending graphs that are never marked do
not pile up.

The long versions are opt-in (`pytest --long`, or PYDISC_LONG=1); CI runs the short ones. Figures of
the last long run are in docs/robustness.md (`python scripts/long_run.py` prints them).
"""
from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

import pydisc
import pydisc.driver.step as pstep
from pydisc.frontend import lazy_tensor
from pydisc.frontend.lazy_tensor import RECORDER

from long_runs import rss_mb, train_mnist_mlp

# ------------------------------------------------------------------------------------------------
# memory over many steps


def _check_flat(before, after, rss_tolerance_mb: float) -> None:
    # Everything pydisc keeps per plan or per op is the same after warm-up as at the end.
    for name in ("lazy_tensors", "pending_entries", "trace_tensors", "plans", "seen_ops", "vmfb_cache",
                 "module_cache", "meta_cache", "op_infos", "metric_entries"):
        assert getattr(after, name) == getattr(before, name), (name, before, after)
    # Python objects: a few come and go (caches of torch and the interpreter), none per step.
    assert after.gc_objects - before.gc_objects < 200, (before, after)
    assert after.rss_mb - before.rss_mb < rss_tolerance_mb, (before, after)


def test_memory_is_flat_over_300_training_steps():
    readings, losses = train_mnist_mlp(300, {100, 200, 300})
    before, middle, after = readings
    _check_flat(before, after, rss_tolerance_mb=16)
    # A leak grows the process in both halves (a 60 KB buffer kept per step: by 3.5 and 5.7 MB); malloc in
    # a worker that had run half the suite (RSS 1.2 GB) once grew it by 8.7 MB in one go, with every exact
    # check above equal.
    assert min(middle.rss_mb - before.rss_mb, after.rss_mb - middle.rss_mb) < 4, readings
    assert losses[-1] < losses[0] / 2


@pytest.mark.long
def test_memory_is_flat_over_2000_training_steps():
    readings, losses = train_mnist_mlp(2000, {200, 1000, 2000})
    print()
    for r in readings:
        print(r)
    before, middle, after = readings
    _check_flat(before, after, rss_tolerance_mb=8)
    # and no slow creep either: the second half adds no more than the first
    assert after.rss_mb - middle.rss_mb <= max(middle.rss_mb - before.rss_mb, 0) + 2, readings
    assert losses[-1] < losses[0] / 4


@pytest.mark.cuda
def test_cuda_memory_is_flat_over_300_training_steps():
    # the same run on the GPU: device memory in torch's tensors does not move by a byte after warm-up,
    # what torch's allocator reserves does not grow, and neither does what the device has in use
    # (IREE's own buffers included)
    readings, losses = train_mnist_mlp(300, {100, 200, 300}, device="cuda")
    for r in readings:
        print(r)
    before, middle, after = readings
    _check_flat(before, after, rss_tolerance_mb=16)
    assert after.cuda_allocated_mb == middle.cuda_allocated_mb == before.cuda_allocated_mb, readings
    assert after.cuda_reserved_mb <= before.cuda_reserved_mb, readings
    assert after.cuda_used_mb - before.cuda_used_mb < 64, readings
    assert losses[-1] < losses[0] / 2


# ------------------------------------------------------------------------------------------------
# very large steps


def _layers(x: torch.Tensor, w: torch.Tensor, ops: int) -> torch.Tensor:
    """`ops` recorded ops: small matmuls, tanh, a multiply by a Python float (a lifted scalar input
    of the step, one per layer) and an add of the input, repeated."""
    y = x
    for k in range(ops // 4):
        y = torch.tanh(y @ w) * (0.5 + 1e-4 * (k % 7)) + x
    return y


def _big_step(ops: int) -> float:
    # dims that earlier tests' steps made dynamic (by step input position) would record this step as a
    # dynamic-shape template, which runs eagerly: start from a clean policy
    pstep.clear_plans()
    torch.manual_seed(0)
    w, x = torch.randn(8, 8) * 0.3, torch.randn(4, 8)
    want = _layers(x, w, ops)
    lazy_x, lazy_w = pydisc.to_lazy(x.clone()), pydisc.to_lazy(w.clone())
    y = _layers(lazy_x, lazy_w, ops)
    assert len(RECORDER.trace.entries) == ops
    started = time.perf_counter()
    pydisc.mark_step()
    elapsed = time.perf_counter() - started
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
    return elapsed


def test_step_of_2000_ops_matches_eager():
    before = pydisc.metrics()
    elapsed = _big_step(2000)
    after = pydisc.metrics()
    print("2000-op step: mark_step %.1f s" % elapsed)
    # compiled whole: in two clusters (at most MAX_CLUSTER_NODES graph nodes each), nothing eager
    assert after["clusters"] - before["clusters"] == 2
    assert after["fallback_ops"] == before["fallback_ops"]
    assert after["compile_failures"] == before["compile_failures"]


@pytest.mark.long
def test_step_of_20000_ops_matches_eager():
    before = pydisc.metrics()
    elapsed = _big_step(20000)
    after = pydisc.metrics()
    print("20000-op step: mark_step %.1f s, %d clusters" % (elapsed, after["clusters"] - before["clusters"]))
    assert after["fallback_ops"] == before["fallback_ops"]
    assert after["compile_failures"] == before["compile_failures"]


def test_same_scalars_in_every_layer_compile_one_executable_per_layer_kind(tmp_path, monkeypatch):
    """Layers that differ only in the lifted scalar they read are one executable for IREE: the scalars
    are read at the top of the cluster, not fused (with their offsets) into each layer's kernels."""
    monkeypatch.setattr(pstep.CONFIG, "dump_dir", str(tmp_path))
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    y = _layers(pydisc.to_lazy(x), pydisc.to_lazy(w), 40)
    pydisc.mark_step()
    torch.testing.assert_close(y.cpu(), _layers(x, w, 40), rtol=1e-5, atol=1e-5)
    texts = [p.read_text() for p in tmp_path.glob("step*_fused_*.mlir")]
    assert texts
    for text in texts:
        barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
        assert len(barriers) == 1 and barriers[0].count("tensor<f32>") == 10, barriers


def test_scalars_read_by_each_kernel_where_a_read_would_be_a_copy(tmp_path, monkeypatch):
    """On CUDA each scalar read behind the shared barrier is a buffer copy launched with the module:
    there the kernels read the scalars themselves. Same values as eager."""
    from pydisc.driver import plan as pplan
    monkeypatch.setattr(pplan, "_share_scalars", lambda device: False)
    monkeypatch.setattr(pstep.CONFIG, "dump_dir", str(tmp_path))
    pstep.clear_plans()
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    y = _layers(pydisc.to_lazy(x), pydisc.to_lazy(w), 40)
    pydisc.mark_step()
    torch.testing.assert_close(y.cpu(), _layers(x, w, 40), rtol=1e-5, atol=1e-5)
    texts = [p.read_text() for p in tmp_path.glob("step*_fused_*.mlir")]
    assert texts and not any("optimization_barrier" in t for t in texts)
    pstep.clear_plans()


# ------------------------------------------------------------------------------------------------
# pending graphs that are never marked


def _record_and_drop(n: int = 64) -> list[weakref.ref]:
    """Lazy ops in a function whose results all die at return; weak references to what they made."""
    x = pydisc.to_lazy(torch.randn(n, n))        # a step input wrapping an eager tensor
    y = (x @ x).relu() * 0.5 + x.sum(0)
    z = y.t().contiguous().exp()
    refs = [weakref.ref(t) for t in (x, y, z)]
    refs += [weakref.ref(t._storage) for t in (y, z)]
    return refs


def test_dead_unmarked_graph_is_freed_at_the_next_read():
    # warm up: the first meta kernels import modules (torch._dynamo), leaving reference cycles that
    # hold the tensors of that step until the cyclic GC runs again (it is paused while recording)
    _record_and_drop()
    pydisc.mark_step()
    refs = _record_and_drop()
    assert all(r() is None for r in refs[:3]), "lazy tensors outlive their last reference"
    keep = pydisc.to_lazy(torch.ones(3)) * 2
    assert keep.sum().item() == 6.0          # a read: runs what it needs, drops what nobody can see
    assert not RECORDER.trace.entries, "dead ops are kept pending after a read"
    gc.collect()
    assert all(r() is None for r in refs), "the storages of a dead graph are still held"


def test_repeated_unmarked_graphs_stay_bounded(monkeypatch):
    """Code that records and drops lazy tensors in a loop, never calling mark_step nor reading: the
    recorder drops the dead entries whenever the trace doubles, so the trace, the eager tensors it
    captured and the host memory stay bounded."""
    monkeypatch.setattr(lazy_tensor, "PRUNE_FIRST_AT", 500)
    monkeypatch.setattr(pstep, "PRUNE_FIRST_AT", 500)
    monkeypatch.setattr(RECORDER, "prune_at", 500)
    lengths, first_refs = [], None
    for i in range(400):
        refs = _record_and_drop(256)            # 256 KB of eager input per graph
        if i == 0:
            first_refs = refs
        lengths.append(len(RECORDER.trace.entries))
        if i == 100:
            rss_early = rss_mb()
    assert max(lengths) < 1100, max(lengths)
    gc.collect()
    assert all(r() is None for r in first_refs), "a dead graph's inputs are still held"
    assert rss_mb() - rss_early < 40, (rss_early, rss_mb())
    pydisc.mark_step()
    assert not RECORDER.trace.entries


def test_pruning_keeps_what_is_still_observable(monkeypatch):
    """Dead entries go; live results, writes into inputs and everything they depend on stay exact."""
    monkeypatch.setattr(lazy_tensor, "PRUNE_FIRST_AT", 50)
    monkeypatch.setattr(pstep, "PRUNE_FIRST_AT", 50)
    monkeypatch.setattr(RECORDER, "prune_at", 50)
    base = torch.arange(12.0).reshape(3, 4)
    p = pydisc.to_lazy(base.clone())
    alive = []
    want_p = base.clone()
    want = []
    for i in range(60):
        dead = (p * i).exp()                  # dies at the next iteration
        view = p[i % 3]                       # a view, dead too, but written through below
        view.add_(1.0)
        want_p[i % 3] += 1.0
        if i % 20 == 0:
            alive.append(p.sum(1) * i)
            want.append(want_p.sum(1) * i)
        del dead, view
    pydisc.mark_step()
    torch.testing.assert_close(p.cpu(), want_p)
    for got, expected in zip(alive, want):
        torch.testing.assert_close(got.cpu(), expected)
