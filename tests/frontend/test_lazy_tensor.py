"""Recording semantics of the lazy tensor, checked against eager PyTorch."""
import copy
import io
import threading
import warnings

import pytest
import torch

import pydisc
from pydisc.frontend.lazy_tensor import RECORDER


def lazy(t):
    return pydisc.to_lazy(t.clone())


def assert_same(lazy_t, eager_t):
    assert pydisc.is_lazy(lazy_t)
    torch.testing.assert_close(lazy_t.cpu(), eager_t, rtol=1e-6, atol=1e-6)


def test_ops_are_recorded_not_run():
    pydisc.mark_step()
    x = lazy(torch.randn(4, 4))
    before = len(RECORDER.trace)
    y = (x * 2).relu().sum(0)
    assert len(RECORDER.trace) == before + 3
    assert y.shape == (4,) and y.dtype == torch.float32 and pydisc.is_lazy(y)
    pydisc.mark_step()
    assert len(RECORDER.trace) == 0
    assert_same(y, (x.cpu() * 2).relu().sum(0))


def test_mark_step_with_nothing_pending_is_a_noop():
    pydisc.mark_step()
    m = pydisc.metrics()
    pydisc.mark_step()
    assert pydisc.metrics()["steps"] == m["steps"]


def test_inplace_on_views_updates_base_and_other_views():
    x = torch.randn(4, 6)
    lx = lazy(x)
    for t in (x, lx):
        v = t[1:3]
        v.mul_(2)
        t.t()[0].add_(1)
        t.view(-1)[5] = 7.0
    pydisc.mark_step()
    assert_same(lx, x)
    assert_same(lx[1:3], x[1:3])


def test_views_of_materialized_tensor_see_later_writes():
    x = torch.randn(3, 3)
    lx = lazy(x)
    lrow, row = lx[0], x[0]
    pydisc.mark_step()
    lx.add_(1.5)
    x.add_(1.5)
    pydisc.mark_step()
    assert_same(lrow, row)


def test_reading_a_value_runs_only_what_it_needs():
    a = lazy(torch.ones(3))
    b = a * 2
    c = a + 1
    a.add_(5)           # must not be seen by b or c
    pydisc.reset_metrics()
    assert b.sum().item() == 6.0
    assert pydisc.metrics()["materializations"] == 1
    assert len(RECORDER.trace) > 0          # the rest is still pending
    assert_same(c, torch.full((3,), 2.0))
    assert_same(a, torch.full((3,), 6.0))
    pydisc.mark_step()
    assert len(RECORDER.trace) == 0


def test_reading_a_clean_value_counts_nothing():
    a = lazy(torch.arange(4.0))
    pydisc.mark_step()
    pydisc.reset_metrics()
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert float(a[1]) == 1.0
    assert pydisc.metrics()["materializations"] == 0


def test_reads_print_numpy_bool():
    a = lazy(torch.tensor([1.0, -2.0]))
    b = a.abs() * 3
    assert "6." in repr(b)
    assert (b.numpy() == [3.0, 6.0]).all()
    assert bool((b > 5).any())
    assert b.cpu().tolist() == [3.0, 6.0] and not pydisc.is_lazy(b.cpu())


def test_mixing_eager_tensors():
    x = torch.randn(5)
    mask = torch.tensor([True, False, True, True, False])
    lx = lazy(x)
    out = torch.where(mask, lx * 2, torch.zeros(5)) + torch.ones(5)
    pydisc.mark_step()
    assert_same(out, torch.where(mask, x * 2, torch.zeros(5)) + 1)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=0.05)], ids=["sgd", "adam"])
def test_an_eager_parameter_beside_a_lazy_model_trains_like_eager(make_opt):
    """A learnable tensor outside the lazy model (a loss weight, a temperature) in one optimizer with the
    model's parameters: the optimizer writes it in place (Adam in eager code alone) while the step's ops
    that read it are pending (the model's weight gradient). They read a copy of its value at the op, as
    eager's saved tensors do; the step failed at mark_step ("modified in place after a lazy op used
    it"), though the code had done nothing wrong."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    model = pydisc.lazy(copy.deepcopy(ref))
    w = torch.nn.Parameter(torch.randn(2))
    w_lazy = torch.nn.Parameter(w.detach().clone())
    opts = make_opt(list(ref.parameters()) + [w]), make_opt(list(model.parameters()) + [w_lazy])
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(3, 4, generator=g)
        for m, weight, opt in ((ref, w, opts[0]), (model, w_lazy, opts[1])):
            opt.zero_grad()
            (m(x) * weight).square().sum().backward()
            opt.step()
        pydisc.mark_step()
    assert not pydisc.is_lazy(w_lazy)
    torch.testing.assert_close(w_lazy.detach(), w.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_an_eager_tensor_written_with_a_lazy_value_after_a_lazy_op_read_it():
    """An eager op that writes an eager tensor with a lazy argument goes through pydisc, which runs what
    is pending first when a pending op reads that tensor: the op before read the old value, as in eager
    (the step was refused at mark_step, "modified in place after a lazy op used it")."""
    buf = torch.ones(3)
    x = lazy(torch.arange(3.0))
    y = x * buf
    buf.copy_(x + 1)
    pydisc.mark_step()
    assert_same(y, torch.arange(3.0))
    torch.testing.assert_close(buf, torch.arange(3.0) + 1)


def test_a_one_element_eager_tensor_is_read_at_the_op_as_eager_reads_it():
    """Code that updates a one-element eager tensor in place after a lazy op read it, within the step
    (`torch.optim.ASGD`'s `eta` and `mu`, a tensor learning rate an LR scheduler fills): each lazy op
    reads the value it had at the op, as in eager (the step was refused at mark_step, "modified in
    place after a lazy op used it", and `ASGD` could not train a lazy model)."""
    scale = torch.ones(())
    lx = lazy(torch.arange(3.0))
    first = lx * scale
    scale.add_(1)
    second = lx * scale
    scale.mul_(10)
    pydisc.mark_step()
    assert_same(first, torch.arange(3.0))
    assert_same(second, torch.arange(3.0) * 2)
    assert scale.item() == 20.0


def test_eager_tensor_modified_after_capture_is_refused():
    x = torch.ones(3)
    lx = lazy(torch.ones(3))
    y = lx + x
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        pydisc.mark_step()
    # the graph was not run: the tensor is still readable after a new step
    from pydisc.frontend.lazy_tensor import RECORDER as R
    R.new_trace()
    assert_same(lx, torch.ones(3))
    del y


def test_data_dependent_ops_fall_back_and_are_counted():
    pydisc.reset_metrics()
    x = lazy(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    idx = torch.nonzero(x * 3)
    assert pydisc.metrics()["fallback_ops"].get("aten.nonzero.default") == 1
    assert idx.cpu().tolist() == [[1], [3]]


def test_scalars_are_lifted_so_changing_values_reuse_the_plan():
    x = lazy(torch.ones(8))
    pydisc.mark_step()
    pydisc.reset_metrics()
    for lr in (0.1, 0.2, 0.3, 0.4):
        x.mul_(lr).add_(torch.ones(8), alpha=lr)
        pydisc.mark_step()
    m = pydisc.metrics()
    assert m["graph_cache_misses"] == 1 and m["graph_cache_hits"] == 3
    expected = torch.ones(8)
    for lr in (0.1, 0.2, 0.3, 0.4):
        expected = expected * lr + lr
    assert_same(x, expected)


def test_steps_read_their_own_lifted_values_where_the_last_ones_repeat():
    # a step whose lifted values equal the last step's reads the same tensor; a zero is made anew, since
    # 0.0 == -0.0 and its sign reaches the result
    x = lazy(torch.ones(4))
    for s in (0.5, 0.5, 0.25, 0.25, 0.0, -0.0, -0.0, 0.0, 0.5):
        y = 1 / (x * s)
        pydisc.mark_step()
        assert torch.equal(y.cpu(), 1 / (torch.ones(4) * s)), s


def test_save_load_and_deepcopy():
    import copy
    p = torch.nn.Parameter(lazy(torch.randn(3)))
    q = p.detach() * 2
    buf = io.BytesIO()
    torch.save({"q": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["q"]
    assert not pydisc.is_lazy(loaded)
    torch.testing.assert_close(loaded, q.cpu())
    c = copy.deepcopy(p)
    assert isinstance(c, torch.nn.Parameter) and pydisc.is_lazy(c)
    torch.testing.assert_close(c.cpu(), p.cpu())


def test_recording_from_another_thread_is_serialised():
    # autograd records backward ops from its own thread on CUDA: other threads must work, under a lock
    x = lazy(torch.ones(2))
    y = x + 1
    results = []
    t = threading.Thread(target=lambda: results.append(x * 3))
    t.start()
    t.join()
    pydisc.mark_step()
    assert_same(y, torch.full((2,), 2.0))
    assert_same(results[0], torch.full((2,), 3.0))


def test_cudnn_batch_norm_records_running_stat_updates():
    # what F.batch_norm calls for CUDA tensors; the rewrite never runs the cuDNN kernel, so this runs anywhere
    torch.manual_seed(0)
    x = torch.randn(6, 4, 3, 3, requires_grad=True)
    w, b = torch.rand(4, requires_grad=True), torch.rand(4, requires_grad=True)
    rm, rv = torch.zeros(4), torch.ones(4)
    lx, lw, lb = (pydisc.to_lazy(t.detach().clone()).requires_grad_() for t in (x, w, b))
    lrm, lrv = lazy(rm), lazy(rv)
    out = torch.ops.aten.cudnn_batch_norm(lx, lw, lb, lrm, lrv, True, 0.1, 1e-5)[0]
    (out * out).sum().backward()
    ref = torch.nn.functional.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
    (ref * ref).sum().backward()
    pydisc.mark_step()
    assert_same(out.detach(), ref.detach())
    assert_same(lrm, rm)
    assert_same(lrv, rv)
    for lt, t in ((lx, x), (lw, w), (lb, b)):
        torch.testing.assert_close(lt.grad.cpu(), t.grad, rtol=1e-4, atol=1e-5)


def test_batch_norm_eval_saved_statistics_as_eager():
    # in eval mode the CPU kernels return empty saved statistics; their meta kernels promise [C]
    aten = torch.ops.aten
    x, w, b, rm, rv = torch.randn(3, 2, 4), torch.rand(2), torch.rand(2), torch.randn(2), torch.rand(2) + 0.5
    cases = [(aten._native_batch_norm_legit.default, (x, w, b, rm, rv, False, 0.1, 1e-5)),
             (aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5)),
             (aten._native_batch_norm_legit.default, (x.bfloat16(), w, b, rm, rv, False, 0.1, 1e-5)),
             (aten._native_batch_norm_legit.default, (x.half(), None, None, rm.half(), rv.half(), False, 0.1, 1e-5))]
    for op, args in cases:
        eager = op(*args)
        got = op(*(lazy(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in eager]
        pydisc.mark_step()
        assert [(t.cpu().shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in eager]
        torch.testing.assert_close(got[0].cpu(), eager[0], rtol=1e-2, atol=1e-2)


def test_eager_inplace_fallback_runs_pending_readers_first(monkeypatch):
    # an in-place op with no meta kernel runs eagerly on the device data; pending ops that read the
    # old value must run before it writes
    original = RECORDER.compute_meta

    def no_meta_for_clamp(func, args, kwargs):
        if func is torch.ops.aten.clamp_.default:
            raise NotImplementedError("no meta kernel")
        return original(func, args, kwargs)

    monkeypatch.setattr(RECORDER, "compute_meta", no_meta_for_clamp)
    x = lazy(torch.arange(4.0))
    pydisc.mark_step()
    y = x * 2                            # pending, reads x
    pydisc.reset_metrics()
    x.clamp_(min=1.5, max=2.5)
    assert pydisc.metrics()["fallback_ops"] == {"aten.clamp_.default": 1}
    z = x + 1
    pydisc.mark_step()
    assert_same(y, torch.arange(4.0) * 2)
    assert_same(x, torch.tensor([1.5, 1.5, 2.0, 2.5]))
    assert_same(z, torch.tensor([2.5, 2.5, 3.0, 3.5]))


def test_wrapped_tensor_modified_by_eager_code_is_refused():
    base = torch.ones(3)
    x = pydisc.to_lazy(base)             # no copy: pydisc reads `base` at mark_step
    y = x + 1
    base.mul_(5)
    with pytest.raises(RuntimeError, match="without a copy"):
        pydisc.mark_step()
    del y


def test_resize_in_place_same_size_view_or_clear_error():
    x = pydisc.to_lazy(torch.arange(12.0))
    y = x * 2
    y.resize_(3, 4)                              # same number of elements: a view in place
    assert y.shape == (3, 4)
    z = y + 1
    y.resize_(3, 4)                              # same size: nothing happens
    with pytest.raises(RuntimeError, match="resize_ of a lazy tensor"):
        y.resize_(5, 5)                          # new storage: refused, not a stale shape
    pydisc.mark_step()
    torch.testing.assert_close(z.cpu(), (torch.arange(12.0) * 2).view(3, 4) + 1)
    torch.testing.assert_close(y.cpu(), (torch.arange(12.0) * 2).view(3, 4))


def test_data_assignment_gives_the_tensor_the_new_value():
    """`t.data = v`: torch's own setter changed only the wrapper's sizes and dtype, and the value was lost."""
    pairs = []
    for wrap in (lambda t: t.clone(), lazy):
        a, b = wrap(torch.ones(2, 3)), wrap(torch.arange(4.0)) * 2 + 1
        a.data = b                      # another shape and value, on b's storage
        b.add_(1)                       # a sees b's writes, as eager's tensors share their storage
        c = wrap(torch.zeros(3))
        c.data = torch.full((3,), 2.0)  # an eager tensor into a lazy one: wrapped as it is
        pairs.append((a, a + 1, c + 1))
    for lazy_t, eager_t in zip(pairs[1], pairs[0]):
        assert lazy_t.shape == eager_t.shape
        assert_same(lazy_t, eager_t)
    pydisc.mark_step()
    for lazy_t, eager_t in zip(pairs[1], pairs[0]):
        assert_same(lazy_t, eager_t)


def test_set_gives_the_tensor_another_ones_storage_and_layout():
    """`x.set_(y)` ran eagerly on the device data: the wrapper kept its sizes and its recorded value."""
    out = []
    for wrap in (lambda t: t.clone(), lazy):
        a, b = wrap(torch.ones(2, 3)), wrap(torch.arange(4.0)) * 2
        a.set_(b)
        before = a + 1
        b.add_(1)                           # one storage: a sees the write
        c = wrap(torch.zeros(2))
        c.set_(torch.full((3,), 7.0))       # an eager tensor's
        d = wrap(torch.zeros(2))
        d.set_(torch.arange(10.0).untyped_storage(), 2, (2, 2), (1, 2))    # a storage, in a layout
        out.append((a, before, a * 1, c + 1, d * 1))
    pydisc.mark_step()
    for lazy_t, eager_t in zip(out[1], out[0]):
        assert lazy_t.shape == eager_t.shape
        assert_same(lazy_t, eager_t)


def test_reads_of_the_data_that_bypass_the_dispatcher_do_not_crash():
    """`torch.from_dlpack(x)`, `torch.utils.dlpack.to_dlpack(x)` and `x.apply_(f)` read the wrapper's data
    directly, which it has not got: the process crashed (a segmentation fault)."""
    x = lazy(torch.arange(4.0)) * 2
    torch.testing.assert_close(torch.from_dlpack(x), torch.arange(4.0) * 2)     # the device data, run first
    y = lazy(torch.arange(4.0)) * 3     # (to_dlpack is C reading the data pointer: no __torch_function__)
    torch.testing.assert_close(torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(y)), torch.arange(4.0) * 3)
    torch.testing.assert_close(torch.from_dlpack(torch.to_dlpack(y + 1)), torch.arange(4.0) * 3 + 1)
    with pytest.raises(RuntimeError, match="apply_ calls Python on each element"):
        x.apply_(lambda v: v * 3)


def test_a_lazy_model_converted_with_double_and_data_assignments_trains_like_eager():
    """`Module.double()` (and `.half()`, `.to(dtype)`) sets each parameter's `.data`: the lazy model's
    parameters said float64 and held float32 values, and its first step failed at mark_step."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    model = pydisc.lazy(copy.deepcopy(ref))
    x = torch.randn(5, 4, dtype=torch.float64)
    losses = []
    for m in (ref, model):
        m.double()
        m[0].weight.data = m[0].weight.data * 0.5       # a parameter keeps its grad and its optimizer
        with pytest.raises(RuntimeError, match="floating point"):
            m[2].bias.data = torch.zeros(2, dtype=torch.long)     # eager's error
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            loss = m(x).square().sum()
            loss.backward()
            opt.step()
            pydisc.mark_step()
            losses.append(loss.item())
    assert losses[2:] == pytest.approx(losses[:2], rel=1e-9)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert b.dtype == torch.float64
        torch.testing.assert_close(b.cpu(), a, rtol=1e-9, atol=1e-9)


def test_an_op_that_makes_its_result_on_another_device_runs_eagerly_there():
    """`x.to("meta")`, `x.new_zeros(n, device=...)`: the recorder made such results on the lazy input's
    device (the op's meta kernel runs everything on meta), so a tensor said to be moved was not."""
    x = lazy(torch.arange(3.0)) * 2
    for moved in (x.to("meta"), x.to(torch.device("meta")), x.new_zeros(2, device="meta")):
        assert moved.device.type == "meta"
    same = x.to("cpu") + 1                  # no move: recorded
    assert same.device.type == "cpu"
    pydisc.mark_step()
    assert_same(same, torch.arange(3.0) * 2 + 1)


@pytest.mark.cuda
def test_a_cuda_value_moved_to_the_cpu_is_on_the_cpu():
    x = pydisc.to_lazy(torch.arange(3.0, device="cuda")) * 2
    moved = x.to("cpu")
    assert moved.device.type == "cpu" and x.to(device="cuda:0").device.type == "cuda"
    pydisc.mark_step()
    assert_same(moved + 1, torch.arange(3.0) * 2 + 1)


def test_an_eager_tensor_that_requires_grad_in_a_lazy_model_trains_like_eager():
    """The eager tensor's gradient is a lazy tensor after the first step; planning the second traced a
    fake copy of the tensor, which read that gradient's data from inside the step: mark_step hung."""
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 6)

        def forward(self, x):
            w = self.__dict__.setdefault("w", torch.full((6,), 0.5, requires_grad=True))     # not the module's
            return (self.lin(x) * w).square().sum()

    torch.manual_seed(0)
    ref = Scaled()
    model = pydisc.lazy(copy.deepcopy(ref), fast_record=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # planned and compiled, not run eagerly instead
        for _ in range(3):
            x = torch.randn(5, 4)
            for m in (ref, model):
                loss = m(x)
                loss.backward()
                pydisc.mark_step()
                assert_same(model.lin.weight.grad, ref.lin.weight.grad) if m is model else None
    assert_same(model.w.grad, ref.w.grad)


def test_a_read_of_lazy_data_while_a_plan_is_built_raises_instead_of_waiting():
    """A plan is traced in a thread of its own while mark_step holds the recorder: a read of lazy data there
    would wait for that step for ever. It raises (and the step then runs eagerly, with a warning)."""
    x = pydisc.to_lazy(torch.ones(3)) * 2
    errors = []

    def plan():
        RECORDER.planning.add(threading.get_ident())
        try:
            x.tolist()
        except RuntimeError as exc:
            errors.append(str(exc))
        finally:
            RECORDER.planning.discard(threading.get_ident())

    with RECORDER.lock:
        thread = threading.Thread(target=plan)
        thread.start()
        thread.join(timeout=30)
    thread.join()
    assert errors and "planning a step read the data" in errors[0]
    pydisc.mark_step()
    assert x.tolist() == [2.0, 2.0, 2.0]


def test_a_new_graph_runs_eagerly_and_compiles_when_it_comes_back(monkeypatch):
    # PYDISC_COMPILE_AFTER=2 (the default outside this suite): the first step of SGD with momentum
    # (it creates the momentum buffers) is a graph seen once: it runs eagerly and is never compiled;
    # the steady step runs eagerly once, compiles on its second run and is taken from the cache after
    from pydisc.config import CONFIG
    from pydisc.driver.step import clear_plans

    monkeypatch.setattr(CONFIG, "compile_after", 2)
    clear_plans()

    def train(lazy_mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        if lazy_mode:
            model = pydisc.lazy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        losses = []
        for k in range(5):
            loss = model(torch.randn(4, 6, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if lazy_mode:
                pydisc.mark_step()
                m = pydisc.metrics()
                assert (m["steps_before_compile"], m["plans_compiled"]) == [(1, 0), (2, 0), (2, 1), (2, 1),
                                                                              (2, 1)][k]
        return torch.stack([loss.cpu() for loss in losses]), [p.detach().cpu() for p in model.parameters()]

    expected_losses, expected_params = train(False)
    pydisc.reset_metrics()
    losses, params = train(True)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, expected_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert pydisc.metrics()["graph_cache_hits"] == 2 and not pydisc.metrics()["recompiles"]
