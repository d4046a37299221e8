"""Threads: ops recorded from several threads at once, with `mark_step` and reads issued from yet another
thread, are serialised by the recorder's lock. Every thread's values must come out exactly as if it
had run alone: a mark in the middle of another thread's ops is just an earlier cut of the step."""
from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch

import pydisc
import pydisc.driver.step as pstep
from pydisc.driver import step_choice
from pydisc.frontend.lazy_tensor import RECORDER


def _work(x: torch.Tensor, k: int, n: int, record: list, halfway=lambda: None) -> torch.Tensor:
    """n small steps of thread k's own computation; every value is kept for the comparison."""
    acc = x
    for i in range(n):
        acc = torch.tanh(acc * (1.0 + 0.01 * k) + (i % 5)) @ x.t()[:, :4] if i % 7 == 6 else acc * 0.5 + k
        record.append(acc)
        if i == n // 2:
            halfway()
    return acc


def _run_threads(n_workers: int, n_ops: int, marks: int, reads: bool) -> None:
    torch.manual_seed(0)
    base = [torch.randn(4, 4) for _ in range(n_workers)]
    want: list[list] = []
    for k, b in enumerate(base):
        want.append([])
        _work(b, k, n_ops, want[k])
    lazy = [pydisc.to_lazy(b.clone()) for b in base]
    got: list[list] = [[] for _ in range(n_workers)]
    errors: list[BaseException] = []
    start = threading.Barrier(n_workers + 1)
    halfway = threading.Barrier(n_workers + 1)    # the first marks find both workers' ops pending
    done = threading.Event()

    def worker(k: int) -> None:
        try:
            start.wait()
            _work(lazy[k], k, n_ops, got[k], halfway.wait)
        except BaseException as exc:     # noqa: BLE001 - reported below
            errors.append(exc)

    def marker() -> None:
        try:
            start.wait()
            halfway.wait()
            for j in range(marks):
                pydisc.mark_step()
                if reads and got[0]:
                    got[0][len(got[0]) // 2].sum().item()      # a read of another thread's value
                if done.wait(0.002):
                    break
        except BaseException as exc:     # noqa: BLE001
            errors.append(exc)

    steps_before = pydisc.metrics()["steps"]
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_workers)]
    threads.append(threading.Thread(target=marker))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join()
    done.set()
    threads[-1].join()
    assert not errors, errors
    marked_midway = pydisc.metrics()["steps"] - steps_before
    pydisc.mark_step()
    assert not RECORDER.trace.entries
    assert marked_midway >= 1, "no mark ran while the workers recorded: nothing was tested"
    for k in range(n_workers):
        assert len(got[k]) == n_ops
        for i, (g, w) in enumerate(zip(got[k], want[k])):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5, msg=lambda m: "thread %d op %d: %s" % (k, i, m))


def test_two_threads_record_while_a_third_marks_and_reads(monkeypatch):
    """Many interleavings: every mark sees a different graph, so the steps run eagerly
    (PYDISC_DISABLE) to keep this fast; what is checked is the recorded graph."""
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    _run_threads(n_workers=2, n_ops=300, marks=200, reads=True)


def test_threads_with_compiled_steps():
    _run_threads(n_workers=2, n_ops=40, marks=3, reads=False)


def test_a_thread_marking_while_another_holds_pending_views():
    """mark_step from one thread while another keeps views of pending values and writes through them."""
    x = pydisc.to_lazy(torch.zeros(6))
    want = torch.zeros(6)
    marked = threading.Event()
    view = x[2:5]
    view.add_(1.0)
    want[2:5] += 1.0
    t = threading.Thread(target=lambda: (pydisc.mark_step(), marked.set()))
    t.start()
    t.join()
    assert marked.is_set()
    view.mul_(3.0)                 # the view now lives on device data; the write is recorded again
    want[2:5] *= 3.0
    pydisc.mark_step()
    assert x.tolist() == want.tolist()


def _train(model, seed, steps=6, first=0, lazy=True):
    """Steps `first` to `steps` of the training of `model` on batches of `seed` (SGD keeps no state), a
    mark_step after each where `lazy`."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(steps):
        x = torch.randn(8, 5, generator=g)
        if i < first:
            continue
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if lazy:
            pydisc.mark_step()
    return [p.detach().cpu().clone() for p in model.parameters()]


def _infer(model, seed, steps=6, lazy=True):
    g = torch.Generator().manual_seed(seed)
    outs = []
    with torch.no_grad():
        for _ in range(steps):
            y = model(torch.randn(8, 5, generator=g))
            if lazy:
                pydisc.mark_step()
            outs.append(y.cpu().clone())
    return outs


def _threads_train_their_own_models(n_threads: int, seed: int = 0, infer: bool = False) -> None:
    """`n_threads` threads each train their own model (`infer`: every other thread runs its model under
    no_grad instead), against the same done eagerly one after the other."""
    torch.manual_seed(seed)
    models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
              for _ in range(n_threads)]
    work = [_infer if infer and k % 2 else _train for k in range(n_threads)]
    lazy_models = [pydisc.lazy(copy.deepcopy(m)) for m in models]
    want = [work[k](m, k, lazy=False) for k, m in enumerate(models)]
    got: list = [None] * n_threads
    errors: list = []

    def run(k):
        try:
            got[k] = work[k](lazy_models[k], k)
        except BaseException as exc:     # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(n_threads):
        for g, w in zip(got[k], want[k]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.fixture
def short_switch_interval():
    """Threads take turns every 10 µs (5 ms by default): the interleavings a loaded machine makes once in a
    while, made in every run."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("n_threads", [4])
def test_many_threads_each_with_its_own_model(n_threads, monkeypatch):
    """Threads training their own small models, each calling mark_step: the marks of one thread run
    the others' pending ops too, and every model still ends exactly where it would alone."""
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    _threads_train_their_own_models(n_threads)


def test_threads_recording_forwards_fast_take_turns(monkeypatch, short_switch_interval):
    """Each lazy module's forward is recorded at `__torch_function__` by the one thread that owns the fast
    recorder at the time; other threads' forwards record op by op meanwhile. Without ownership claimed
    under a lock, a thread took over another's armed forward, recorded into its segment, or took the
    handler off the class under an open segment (losses without autograd history, `_mk` missing, ...)."""
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    for rep in range(8):
        _threads_train_their_own_models(4, seed=rep)


def test_threads_training_and_running_inference_side_by_side(monkeypatch, short_switch_interval):
    """Forwards without grad on other threads take the composite-op recording (`inference`) while one
    thread owns the fast recorder, and leave its segment alone."""
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    for rep in range(3):
        _threads_train_their_own_models(4, seed=rep, infer=True)


def test_the_step_choice_is_not_measured_where_several_threads_drive_steps(monkeypatch):
    """The step choice swaps every lazy tensor of the process for a plain one and back: under another
    thread's step that poisoned its autograd graph. With several threads nothing is released (or, once
    released, nothing is made lazy again) and each thread's training still equals eager."""
    monkeypatch.setattr(pstep.CONFIG, "step_choice", "cpu")
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    step_choice.reset()
    try:
        for rep in range(4):
            _threads_train_their_own_models(4, seed=rep)
        # (compiled kept, or eager where a thread's probe had released the tensors before another began)
        assert "several threads" in pydisc.metrics()["step_choice"], pydisc.metrics()["step_choice"]
    finally:
        step_choice.reset()


def test_tensors_released_for_a_probe_stay_plain_once_another_thread_drives_steps(monkeypatch):
    """A thread's probe (one plain eager step, timed) has released every lazy tensor when a second thread
    begins: its model is plain and trains eagerly. At the first thread's next mark eager is kept, and
    nothing is made lazy again (it would be swapped under the second thread's next step)."""
    monkeypatch.setattr(pstep.CONFIG, "step_choice", "cpu")
    monkeypatch.setattr(pstep.CONFIG, "disable", True)
    monkeypatch.setattr(step_choice, "RECORDING_BOUND", 1e9)     # the probe's timing does not decide
    step_choice.reset()
    try:
        torch.manual_seed(0)
        models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
                  for _ in range(2)]
        lazy_models = [pydisc.lazy(copy.deepcopy(m)) for m in models]
        want = [_train(m, k, lazy=False) for k, m in enumerate(models)]
        released, second_done = threading.Event(), threading.Event()
        got: list = [None, None]
        errors: list = []

        def first():
            try:
                got[0] = _train(lazy_models[0], 0, steps=2)         # the second mark starts the probe
                assert step_choice.measuring() and not pydisc.is_lazy(lazy_models[1][0].weight)
                released.set()
                second_done.wait()
                got[0] = _train(lazy_models[0], 0, first=2)
            except BaseException as exc:     # noqa: BLE001
                errors.append(exc)
            finally:
                released.set()

        def second():
            try:
                released.wait()
                got[1] = _train(lazy_models[1], 1)
            except BaseException as exc:     # noqa: BLE001
                errors.append(exc)
            finally:
                second_done.set()

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert "timed eager steps were running" in pydisc.metrics()["step_choice"], pydisc.metrics()["step_choice"]
        assert not any(pydisc.is_lazy(p) for m in lazy_models for p in m.parameters())
        for k in range(2):
            for g, w in zip(got[k], want[k]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    finally:
        step_choice.reset()
