"""Compiled CPU steps that run on the worker thread while the next step records (PYDISC_ASYNC,
pydisc/driver/inflight.py), against eager: every way of reaching a step's data waits for it, a step never
reads what the user changed after `mark_step`, and a step that fails there is handled as at `mark_step`."""
import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import pydisc
from pydisc import diagnostics
from pydisc.config import CONFIG
from pydisc.driver.engine import ENGINE
from pydisc.driver.inflight import InFlight, Worker
from pydisc.exec.compiled import PreparedCall
from pydisc.metrics import METRICS

STEPS = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def _step(model, opt, x, y) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.fixture
def fresh():
    pydisc.clear_plans()
    pydisc.reset_metrics()
    yield
    pydisc.synchronize()


def _pair():
    eager = _model()
    lazy = pydisc.lazy(_model())
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    return eager, make(eager), lazy, make(lazy)


def _with_and_without_worker(monkeypatch, train) -> dict:
    """`train()`, one run (its lazy losses, eager's, the lazy and the eager model), with PYDISC_ASYNC on and
    off: each equals eager, the two equal each other bit for bit, and steps ran on the worker only with it
    on. Returns the metrics of the run with it on."""
    results = {}
    for on in (True, False):
        monkeypatch.setattr(CONFIG, "async_cpu", on)
        pydisc.clear_plans()
        pydisc.reset_metrics()
        losses, want, lazy, eager = train()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
        params = [p.detach().clone() for p in lazy.parameters()]
        for p, q in zip(params, eager.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
        results[on] = (losses, params, pydisc.metrics())
    (losses_on, params_on, m_on), (losses_off, params_off, m_off) = results[True], results[False]
    # (steps 1-2 make the momentum buffers and compile; a plan's first two runs stay on the main thread)
    assert m_on["async_runs"] >= 2 and m_off["async_runs"] == 0, (m_on["async_runs"], m_off["async_runs"])
    assert losses_on == losses_off
    for a, b in zip(params_on, params_off):
        assert torch.equal(a, b)
    return m_on


def test_training_equals_eager_and_the_synchronous_run(fresh, monkeypatch):
    """Losses read one step late (after the next step recorded, as a loop that logs does) and the final
    parameters equal eager's and those of the same run with PYDISC_ASYNC=0."""
    def train():
        eager, eager_opt, lazy, lazy_opt = _pair()
        losses, want, pending = [], [], None
        for x, y in _batches(STEPS):
            want.append(_step(eager, eager_opt, x, y).item())
            got = _step(lazy, lazy_opt, x, y)
            if pending is not None:
                losses.append(pending.item())   # a value of the step that may still run on the worker
            pydisc.mark_step()
            pending = got
        losses.append(pending.item())
        return losses, want, lazy, eager

    _with_and_without_worker(monkeypatch, train)


def test_results_held_when_a_step_is_bound_one_step_late_get_their_values(fresh, monkeypatch):
    """A step run on the worker is bound after the next one recorded, when most of its results are dropped
    (`zero_grad` let go of its gradients): the gradients a loop set aside before `zero_grad` (every other
    step's) and all its losses get their values, eager's, with and without the worker."""
    def train():
        eager, eager_opt, lazy, lazy_opt = _pair()
        losses, want, kept, want_grads = [], [], [], []
        for i, (x, y) in enumerate(_batches(STEPS)):
            loss = F.cross_entropy(eager(x), y)
            loss.backward()
            if i % 2:
                want_grads.append([p.grad.clone() for p in eager.parameters()])
            eager_opt.step()
            eager_opt.zero_grad()
            want.append(loss.item())
            got = F.cross_entropy(lazy(x), y)
            got.backward()
            if i % 2:
                kept.append([p.grad for p in lazy.parameters()])
            lazy_opt.step()
            lazy_opt.zero_grad()
            pydisc.mark_step()
            losses.append(got)
        losses = [loss.item() for loss in losses]
        assert len(kept) == STEPS // 2
        for grads, expected in zip(kept, want_grads):
            for g, w in zip(grads, expected):
                assert pydisc.is_lazy(g)
                torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)
        return losses, want, lazy, eager

    _with_and_without_worker(monkeypatch, train)


def test_a_step_with_dropout_runs_on_the_worker_and_draws_eagers_numbers(fresh, monkeypatch):
    """Dropout's masks are drawn by torch inside the step, into tensors a cluster makes: that cluster and the
    draws run on the main thread at mark_step, the rest of the step on the worker. The numbers drawn are
    eager's, and those of PYDISC_ASYNC=0, also with the loop's own draws between steps."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3),
                                   torch.nn.Linear(16, 4))

    def train():
        eager, lazy = model(), pydisc.lazy(model())
        eager_opt, lazy_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, lazy))
        losses, want = [], []
        torch.manual_seed(2)
        for x, y in _batches(STEPS):
            want.append(_step(eager, eager_opt, x, y).item())
            torch.rand(3)                   # the loop's own draw, between two steps
        torch.manual_seed(2)
        for x, y in _batches(STEPS):
            losses.append(_step(lazy, lazy_opt, x, y))
            pydisc.mark_step()
            torch.rand(3)
        return [loss.item() for loss in losses], want, lazy, eager

    _with_and_without_worker(monkeypatch, train)


def test_clusters_that_torchs_ops_do_not_read_run_on_the_worker(fresh, monkeypatch):
    """With PYDISC_CPU_MATMUL=torch the matmuls run in torch between the clusters, reading their results:
    those clusters run at mark_step, and the last one, which no op of torch reads (the optimizer's update),
    on the worker. Values equal eager's and PYDISC_ASYNC=0's."""
    monkeypatch.setattr(CONFIG, "cpu_matmul", "torch")

    def train():
        eager, eager_opt, lazy, lazy_opt = _pair()
        losses, want = [], []
        for x, y in _batches(STEPS):
            want.append(_step(eager, eager_opt, x, y).item())
            losses.append(_step(lazy, lazy_opt, x, y))
            pydisc.mark_step()
        return [loss.item() for loss in losses], want, lazy, eager

    assert _with_and_without_worker(monkeypatch, train)["library_ops"]


def _blocked_worker():
    """Holds the worker until the returned event is set: the next deferred run queues behind it."""
    if ENGINE.worker is None:
        ENGINE.worker = Worker()
    gate = threading.Event()
    ENGINE.worker.jobs.put(InFlight(lambda: gate.wait(30), lambda *a: None))
    return gate


def test_an_input_refilled_after_mark_step_is_not_read_by_the_step(fresh):
    """A loop that copies the next batch into its input buffer right after mark_step: the step still
    running must read the batch it was given (its copy), not the next one."""
    eager, eager_opt, lazy, lazy_opt = _pair()
    batches = _batches(STEPS + 1)
    buf_x, buf_y = batches[0][0].clone(), batches[0][1].clone()
    for k in range(STEPS):
        x, y = batches[k]
        want = _step(eager, eager_opt, x, y).item()
        got = _step(lazy, lazy_opt, buf_x, buf_y)
        gate = _blocked_worker() if k >= 4 else None
        pydisc.mark_step()
        buf_x.copy_(batches[k + 1][0])      # the next batch, while this step waits on the worker
        buf_y.copy_(batches[k + 1][1])
        if gate is not None:
            gate.set()
        torch.testing.assert_close(got.item(), want, rtol=1e-5, atol=1e-6)
    assert pydisc.metrics()["async_runs"] >= 2
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_value_of_the_step_before_is_read_without_waiting_for_the_step_in_flight(fresh):
    """A loss logged one step late (as PyTorch/XLA advises, so that logging keeps the steps overlapping): read
    while the next step is held on the worker, or after that step's run wrote its results and before they
    are bound, it is read at once, eager's value; a parameter, which that step writes, waits for it and
    reads its new value."""
    eager, eager_opt, lazy, lazy_opt = _pair()
    before = None
    for k, (x, y) in enumerate(_batches(STEPS)):
        want = _step(eager, eager_opt, x, y).item()
        loss = _step(lazy, lazy_opt, x, y)
        gate = _blocked_worker() if k >= 4 else None
        pydisc.mark_step()
        if gate is not None:
            run = ENGINE.in_flight
            assert run is not None
            if k % 2:       # the run has written all it writes, and is not bound yet
                gate.set()
                while run.done.locked():
                    time.sleep(0.001)
            waits = sum(METRICS.async_waits.values())
            torch.testing.assert_close(before[0].item(), before[1], rtol=1e-5, atol=1e-6)
            # (waiting would have held the read until the gate opened, or bound the run)
            assert ENGINE.in_flight is run and sum(METRICS.async_waits.values()) == waits
            assert gate.is_set() == bool(k % 2)
            threading.Timer(0.05, gate.set).start()
            torch.testing.assert_close(torch.tensor(lazy[0].weight.tolist()), eager[0].weight.detach(), rtol=1e-5,
                                       atol=1e-6)     # (a read of its memory, not an op recorded on it)
            assert ENGINE.in_flight is None
        before = (loss, want)
    assert pydisc.metrics()["async_runs"] >= 3


class _Checked(torch.nn.Module):
    """A forward that reads a value made from its input after a parameter was used (HF's attention-mask
    check after the embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if bool((x.abs() < 1e6).all()):
            h = torch.tanh(h)
        return self.b(h)


def test_a_read_in_a_forward_waits_only_for_what_it_reads(fresh):
    """The read in a fast-recorded forward computes its value from the inputs it needs (the batch), not
    from every input of the forward so far: it does not wait for the step running on the worker, which
    writes the parameters; the steps equal eager."""
    eager, lazy = _Checked(), pydisc.lazy(_Checked(), fast_record=True)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    eager_opt, lazy_opt = make(eager), make(lazy)
    wants, losses = [], []
    for x, y in _batches(STEPS):
        wants.append(_step(eager, eager_opt, x, y).item())
        losses.append(_step(lazy, lazy_opt, x, y))     # (read at the end: the next step records while it runs)
        pydisc.mark_step()
    torch.testing.assert_close(torch.tensor([loss.item() for loss in losses]), torch.tensor(wants), rtol=1e-5,
                               atol=1e-6)
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    assert m["async_runs"] >= 3 and m["fast_reads"] == STEPS, m
    assert "read" not in m["async_waits"], m["async_waits"]


def test_reads_of_a_step_in_flight_wait_for_it(fresh):
    """Every way of reaching a parameter's data while its step runs on the worker gives the updated
    values: an eager op, .item(), state_dict(), a clone; each wait is counted by what waited."""
    eager, eager_opt, lazy, lazy_opt = _pair()
    batches = _batches(STEPS)
    reads = [
        lambda m: m[0].weight.sum().item(),
        lambda m: m.state_dict()["2.bias"].tolist(),
        lambda m: m[2].weight.detach().clone().numpy().tolist(),
        lambda m: torch.mm(m[0].weight.detach(), torch.ones(6, 1)).flatten().tolist(),
    ]
    for k, (x, y) in enumerate(batches):
        _step(eager, eager_opt, x, y)
        _step(lazy, lazy_opt, x, y)
        gate = _blocked_worker() if k >= 3 else None
        pydisc.mark_step()
        if gate is not None:
            threading.Timer(0.05, gate.set).start()    # the read below starts while the step waits
        read = reads[k % len(reads)]
        with torch.no_grad():
            got, want = read(lazy), read(eager)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    assert m["async_runs"] >= 3 and sum(m["async_waits"].values()) >= m["async_runs"]
    assert set(m["async_waits"]) - {"mark_step", "synchronize", "metrics"}, m["async_waits"]


class _InterruptedOnce:
    """A lock whose first acquire raises KeyboardInterrupt (Ctrl-C while `inflight.start` waits for the
    worker to take the step), and then is the lock it wraps."""

    def __init__(self, lock) -> None:
        self.lock, self.raised = lock, False

    def acquire(self, *args, **kwargs):
        if not self.raised:
            self.raised = True
            raise KeyboardInterrupt
        return self.lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self.lock.release()


def test_an_interrupt_while_the_worker_takes_a_step_is_raised_once_it_has_it(fresh, monkeypatch):
    """Ctrl-C while mark_step hands the step to the worker: raised from mark_step, and the step runs and is
    bound all the same (its results equal eager's, and so does the next step; AdamW's step counters too)."""
    eager, lazy = _model(), pydisc.lazy(_model())
    eager_opt, lazy_opt = torch.optim.AdamW(eager.parameters(), lr=0.01), torch.optim.AdamW(lazy.parameters(), lr=0.01)
    batches = _batches(STEPS)
    real_init = InFlight.__init__

    def init(self, job, finish):
        real_init(self, job, finish)
        self.started = _InterruptedOnce(self.started)

    for k, (x, y) in enumerate(batches):
        want = _step(eager, eager_opt, x, y).item()
        got = _step(lazy, lazy_opt, x, y)
        if k == 4:
            runs = pydisc.metrics()["async_runs"]
            monkeypatch.setattr(InFlight, "__init__", init)
            with pytest.raises(KeyboardInterrupt):
                pydisc.mark_step()
            monkeypatch.setattr(InFlight, "__init__", real_init)
            assert pydisc.metrics()["async_runs"] == runs + 1
        else:
            pydisc.mark_step()
        torch.testing.assert_close(got.item(), want, rtol=1e-5, atol=1e-6)
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.fixture
def first_worker_call_fails(monkeypatch) -> list:
    """The first IREE call made on the worker thread raises; the list holds it once it has. Warnings
    pydisc gave once before this test (another test's failed run) are given again."""
    monkeypatch.setattr(diagnostics, "_WARNED", set())
    real = PreparedCall.run
    failed = []

    def run(self):
        if not failed and threading.current_thread().name == "pydisc-run":
            failed.append(self)
            raise RuntimeError("injected failure")
        return real(self)

    monkeypatch.setattr(PreparedCall, "run", run)
    return failed


def test_a_run_that_fails_on_the_worker_falls_back_to_eager(fresh, first_worker_call_fails):
    """An IREE call that raises on the worker: the step's ops run in torch at the wait, with one warning,
    the plan is given up for eager, and training still equals eager."""
    eager, eager_opt, lazy, lazy_opt = _pair()
    with pytest.warns(pydisc.PydiscWarning, match="running a compiled step failed"):
        for x, y in _batches(STEPS):
            _step(eager, eager_opt, x, y)
            _step(lazy, lazy_opt, x, y)
            pydisc.mark_step()
        pydisc.synchronize()
    assert first_worker_call_fails and pydisc.metrics()["compile_failures"]["runtime:RuntimeError"] == 1
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_failed_run_finished_under_autocast_runs_as_at_its_mark_step(fresh, first_worker_call_fails):
    """`pydisc.synchronize()` (or `metrics()`) called inside an autocast region waits for a run that
    failed on the worker: the step's ops that torch then runs are not autocast, as they would not be at
    the step's own mark_step (they ran in bfloat16, and the parameters took the rounded values)."""
    eager, eager_opt, lazy, lazy_opt = _pair()
    for x, y in _batches(STEPS):
        _step(eager, eager_opt, x, y)
        _step(lazy, lazy_opt, x, y)
        pydisc.mark_step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pydisc.synchronize()
    assert first_worker_call_fails and pydisc.metrics()["compile_failures"]["runtime:RuntimeError"] == 1
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_an_index_out_of_range_raises_at_the_wait_and_rolls_back_the_step(fresh):
    """Adam on an embedding: a bad index in a step that ran on the worker raises eager's IndexError at
    the wait; the step is abandoned (parameters, moments and Adam's step counters as before it), so
    training on good batches afterwards equals eager's, which raised in that step's forward."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten(), torch.nn.Linear(24, 3))

    eager, lazy = model(), pydisc.lazy(model())
    eager_opt, lazy_opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (eager, lazy))
    g = torch.Generator().manual_seed(2)
    good = [(torch.randint(0, 10, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(7)]
    bad = (torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 12], [0, 1, 2]]), good[0][1])
    for x, y in good[:4]:
        _step(eager, eager_opt, x, y)
        _step(lazy, lazy_opt, x, y)
        pydisc.mark_step()
    assert pydisc.metrics()["async_runs"] >= 1
    with pytest.raises(IndexError) as expected:
        _step(eager, eager_opt, *bad)
    eager_opt.zero_grad()
    _step(lazy, lazy_opt, *bad)
    with pytest.raises(IndexError, match=re.escape(str(expected.value).splitlines()[0])):
        pydisc.mark_step()
        pydisc.synchronize()
    for x, y in good[4:]:
        _step(eager, eager_opt, x, y)
        _step(lazy, lazy_opt, x, y)
        pydisc.mark_step()
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(lazy_opt.state.values(), eager_opt.state.values()):
        assert a["step"].item() == b["step"].item()
        torch.testing.assert_close(a["exp_avg"].cpu(), b["exp_avg"], rtol=1e-5, atol=1e-6)


def test_a_step_that_writes_its_input_in_place_runs_at_once(fresh):
    """A forward that writes into the user's own input tensor (`x.mul_`) is not deferred: the write is
    the user's to see right after mark_step, as in eager."""
    eager, eager_opt, lazy, lazy_opt = _pair()

    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            x.mul_(0.5)
            return self.inner(x)

    eager, lazy = Scaled(eager), pydisc.lazy(Scaled(_model()))
    lazy_opt = torch.optim.SGD(lazy.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(STEPS):
        xe, xl = x.clone(), x.clone()
        _step(eager, eager_opt, xe, y)
        _step(lazy, lazy_opt, xl, y)
        pydisc.mark_step()
        assert torch.equal(xl, xe)      # read at once, as a plain tensor: no wait could cover it
    assert pydisc.metrics()["async_runs"] == 0


def test_inputs_of_a_step_matched_to_a_dynamic_template_are_copied_too(fresh):
    """Steps whose length varies run one template's plan, which gets views of their inputs: those views
    are read from copies too, so a buffer refilled right after mark_step does not reach the step."""
    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model()

        def forward(self, x):
            return self.inner(x).mean(dim=1)

    torch.manual_seed(0)
    eager, lazy = Pool(), pydisc.lazy(Pool())
    eager_opt, lazy_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, lazy))
    g = torch.Generator().manual_seed(3)
    lengths = [5, 7, 9, 6, 8, 5, 7, 9, 6, 8, 5, 7]
    batches = [(torch.randn(4, n, 6, generator=g), torch.randint(0, 4, (4,), generator=g)) for n in lengths]
    buffers = {n: torch.zeros(4, n, 6) for n in set(lengths)}
    for k, (x, y) in enumerate(batches):
        want = _step(eager, eager_opt, x, y).item()
        buf = buffers[x.shape[1]]
        buf.copy_(x)
        got = _step(lazy, lazy_opt, buf, y)
        gate = _blocked_worker() if k >= 6 else None
        pydisc.mark_step()
        buf.normal_()       # the user's buffer changes while the step may wait on the worker
        if gate is not None:
            gate.set()
        torch.testing.assert_close(got.item(), want, rtol=1e-5, atol=1e-6)
    m = pydisc.metrics()
    assert m["async_runs"] >= 2 and m["dynamic_templates"] >= 1 and m["dynamic_matches"] >= 1, m
    for p, q in zip(lazy.parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def _kept(plan) -> list:
    """How many outputs each compiled cluster of `plan` writes into tensors kept from run to run."""
    return [sum(t is not None for t in cluster.kept or ()) for cluster, _ in plan.kept_outputs or ()]


def test_new_parameter_values_are_written_into_kept_tensors_of_the_plan_that_ran_last(fresh, monkeypatch):
    """A plan's compiled clusters write the step's new parameters and momentum buffers (copied into their
    tensors at once) into the same tensors at every run, with and without the worker; batches of two sizes
    taking turns run two plans, and only the plan that ran last keeps its tensors (a copy of the parameters
    per plan would add up); the plans of reads (the comparisons at the end) take nothing from it. Losses and parameters
    equal eager's throughout."""
    sizes = [8, 8, 8, 5, 8, 5, 5, 8, 5, 8]
    plans = []

    def train():
        eager, eager_opt, lazy, lazy_opt = _pair()
        g = torch.Generator().manual_seed(3)
        losses, want = [], []
        for n in sizes:
            x, y = torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)
            want.append(_step(eager, eager_opt, x, y).item())
            got = _step(lazy, lazy_opt, x, y)
            pydisc.mark_step()
            losses.append(got.item())
        pydisc.synchronize()
        plans[:] = [p for p in ENGINE.plans.values() if p.kept_outputs]
        return losses, want, lazy, eager

    monkeypatch.setattr(pydisc.config.CONFIG, "dynamic", False)     # (a plan per batch size)
    _with_and_without_worker(monkeypatch, train)
    # (the first step, which makes the momentum buffers, has a plan of its own)
    assert len(plans) == 3 and ENGINE.keeping in plans
    assert _kept(ENGINE.keeping) == [4 + 4]      # the weights and biases of two Linears, and their momentum
    assert all(_kept(plan) == [0] for plan in plans if plan is not ENGINE.keeping)
