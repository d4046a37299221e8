"""A step plan replayed from a CUDA graph (pydisc/exec/graphs.py).

On the CPU the capture is simulated: `_fake_capture` gives the runner's outputs fixed buffers, and
each replay runs the runner again on the arguments it was captured with and writes into those
buffers, as a CUDA graph replays its kernels on fixed addresses. That checks what pydisc does around
the graph: which inputs are read in place and which are copied in, captures again when an input
moves, clones what it hands out, gives up cleanly. The real capture is tested on the GPU (`cuda`)."""
import gc
import weakref

import pytest
import torch

import pydisc
from pydisc.driver import bind as pbind
from pydisc.driver import step as pstep
from pydisc.driver.dynamic import Binding
from pydisc.driver.engine import ENGINE
from pydisc.exec import graphs
from pydisc.metrics import METRICS


class _FakeGraph:
    def __init__(self, runner, args, outputs):
        self.runner, self.args, self.outputs = runner, args, outputs

    def replay(self):
        for static, fresh in zip(self.outputs, self.runner(*self.args)):
            if static is not fresh:
                static.copy_(fresh)


def _fake_capture(runner, args, device):
    # nothing runs at capture: the runner sees copies (for the outputs' shapes), its writes are lost;
    # an output that is an argument stays that argument
    copies = [a.clone() for a in args]
    same = {id(c): a for a, c in zip(args, copies)}
    outputs = [same[id(o)] if id(o) in same else torch.full_like(o, float("nan"))
               for o in runner(*copies)]
    return _FakeGraph(runner, args, outputs), outputs


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "_capture_graph", _fake_capture)
    monkeypatch.setattr(graphs, "_not_capturable", lambda runner, device: None)
    monkeypatch.setattr(graphs, "enabled", lambda device: True)
    pydisc.reset_metrics()


def test_inputs_in_place_or_copied_in_outputs_cloned(fake_graphs):
    calls = []

    def runner(w, x):
        calls.append((w.data_ptr(), x.data_ptr()))
        return [w * 2 + x.sum()]

    w = torch.randn(4)
    g = graphs.StepGraph(runner, torch.device("cpu"), {})
    kept = []
    for step in range(6):
        x = torch.full((3,), float(step))       # a new tensor each step, like a batch
        out = g([w, x])[0]
        torch.testing.assert_close(out, w * 2 + 3 * step)
        kept.append(out)
    assert METRICS.cuda_graph_captures == 1 and METRICS.cuda_graph_replays == 3
    assert g.direct == [(0, w.data_ptr())] and list(g.staged) == [1]   # w read in place, x copied in
    # two plain runs, the capture, four replays (the third step's, then three more; the fake re-runs)
    assert len(calls) == 2 + 1 + 4
    for step, out in enumerate(kept):   # outputs handed out earlier keep their values
        torch.testing.assert_close(out, w * 2 + 3 * step)


def test_a_new_tensor_at_an_old_address_is_copied_in(fake_graphs):
    """An input in new memory on each run (an eager tensor made during the step, a causal mask) is
    copied in, even where the allocator gave it the same address twice: it would move later and cost
    a capture each time."""
    memory = bytearray(12)
    g = graphs.StepGraph(lambda w, m, x: [w + m + x], torch.device("cpu"), {})
    w, x = torch.randn(3), torch.randn(3)
    for step in range(6):
        if step < graphs.CAPTURE_AT:
            mask = torch.frombuffer(memory, dtype=torch.float32)   # a new storage, the same address
        else:
            mask = torch.zeros(3)                                  # later at another address
        mask.fill_(step)
        torch.testing.assert_close(g([w, mask, x[:]])[0], w + step + x)
    # w read in place; so is x, one storage seen through a new view each step; the mask copied in
    assert METRICS.cuda_graph_captures == 1 and list(g.staged) == [1], (METRICS.cuda_graph_captures, g.staged)


def test_an_input_that_moves_is_captured_again_then_given_up(fake_graphs):
    """An input read in place that moves is copied in from then on, after a new capture; when inputs
    keep moving (another one each step), the plan runs kernel by kernel."""
    g = graphs.StepGraph(lambda *xs: [sum(xs)], torch.device("cpu"), {})
    xs = [torch.full((2,), float(k)) for k in range(graphs.MAX_CAPTURES + 2)]
    for _ in range(3):
        g(xs)
    assert METRICS.cuda_graph_captures == 1 and not g.staged
    with pytest.warns(UserWarning, match="keep moving"):
        for k in range(graphs.MAX_CAPTURES + 1):
            xs[k] = xs[k].clone() + 1          # a new address (and value) for one more input
            torch.testing.assert_close(g(xs)[0], sum(xs))
            torch.testing.assert_close(g(xs)[0], sum(xs))
    assert METRICS.cuda_graph_captures == graphs.MAX_CAPTURES
    assert "keep moving" in g.off and METRICS.cuda_graph_fallbacks


def test_outputs_written_into_inputs_are_copied_by_the_graph(fake_graphs):
    """An output the step writes into an input's storage (`kept`: a parameter's update) is copied there
    by the graph itself and handed out as that input; the other outputs are cloned."""
    g = graphs.StepGraph(lambda a: [a + 1, a * 2], torch.device("cpu"), {0: 0})
    a = torch.zeros(2)
    kept = []
    for step in range(1, 6):
        first, second = g([a])
        if first is not a:          # a run kernel by kernel: the step copies it (driver/bind.py)
            a.copy_(first)
        torch.testing.assert_close(a, torch.full((2,), float(step)))
        kept.append(second)
    assert first is a and METRICS.cuda_graph_replays == 5 - graphs.CAPTURE_AT
    for step, second in enumerate(kept):
        torch.testing.assert_close(second, torch.full((2,), 2.0 * step))


def test_outputs_written_into_inputs_are_copied_together(fake_graphs, monkeypatch):
    """The graph's copies into its inputs are one multi-tensor copy per dtype pair (one copy each was
    ~600 memcpy nodes of a BERT-base step); a source that another copy writes is read first."""
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (calls.append(len(dst)), real(dst, src)))
    params = [torch.zeros(3), torch.zeros(2), torch.zeros(4, dtype=torch.float64)]
    g = graphs.StepGraph(lambda a, b, c: [a + 1, b + 2, c + 3], torch.device("cpu"), {0: 0, 1: 1, 2: 2})
    for step in range(1, 6):
        outs = g(params)
        if outs[0] is not params[0]:       # a run kernel by kernel: the step copies (driver/bind.py)
            for p, o in zip(params, outs):
                p.copy_(o)
        for p, inc in zip(params, (1, 2, 3)):
            torch.testing.assert_close(p, torch.full_like(p, inc * step))
    assert sorted(calls[:2]) == [1, 2], calls      # float32 pair together, float64 alone

    # a swap: each input's new value is the other input, as it was before the step
    a, b = torch.zeros(2), torch.ones(2)
    swap = graphs.StepGraph(lambda x, y: [y, x], torch.device("cpu"), {0: 0, 1: 1})
    for step in range(5):
        before = (a.clone(), b.clone())
        outs = swap([a, b])
        if outs[0] is not a:       # a run kernel by kernel: the step binds the new values (driver/bind.py)
            new = [o.clone() for o in outs]
            a.copy_(new[0]), b.copy_(new[1])
        assert torch.equal(a, before[1]) and torch.equal(b, before[0]), (step, a, b)


def test_released_memory_is_captured_again(fake_graphs):
    """`release_memory` (eager windows of the step choice, eager kept) drops every graph; a plan that
    runs again is captured again, and that capture does not count against `MAX_CAPTURES`."""
    g = graphs.StepGraph(lambda a: [a * 3], torch.device("cpu"), {})
    a = torch.ones(2)
    for _ in range(graphs.CAPTURE_AT):
        g([a])
    for round in range(graphs.MAX_CAPTURES + 1):
        assert g.graph is not None
        graphs.release_memory()
        assert g.graph is None and g.outputs is None
        torch.testing.assert_close(g([a])[0], a * 3)
    assert g.off is None and METRICS.cuda_graph_captures == graphs.MAX_CAPTURES + 2


def test_a_failed_capture_runs_the_plan_and_is_counted(fake_graphs, monkeypatch):
    def broken(runner, args, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture_graph", broken)
    g = graphs.StepGraph(lambda a: [a + 1], torch.device("cpu"), {})
    a = torch.zeros(2)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
        for _ in range(5):
            torch.testing.assert_close(g([a])[0], a + 1)
    assert METRICS.cuda_graph_captures == 0 and g.off.startswith("RuntimeError")
    assert sum(METRICS.cuda_graph_fallbacks.values()) == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_training_through_replayed_steps_matches_eager(device, request):
    """An MLP trained with SGD and momentum: steps 3 on are replays, with a new batch each step; the
    losses kept from every step, read at the end, and the weights equal eager's. On the GPU, a real
    CUDA graph."""
    if device == "cpu":
        request.getfixturevalue("fake_graphs")
    pydisc.reset_metrics()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    ref.load_state_dict(model.state_dict())
    batches = [(torch.randn(5, 8, device=device), torch.randn(5, 1, device=device)) for _ in range(7)]
    pstep.clear_plans()
    try:
        lazy = pydisc.lazy(model)
        opt = torch.optim.SGD(lazy.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        losses, ref_losses = [], []
        lazy_batches = [(pydisc.to_lazy(x.clone()), pydisc.to_lazy(y.clone())) for x, y in batches]
        for (x, y), (lx, ly) in zip(batches, lazy_batches):   # a batch at a new address each step
            loss = torch.nn.functional.mse_loss(lazy(lx), ly)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pydisc.mark_step()
            losses.append(loss)
            ref_loss = torch.nn.functional.mse_loss(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.detach())
        assert METRICS.cuda_graph_captures == 1 and METRICS.cuda_graph_replays == 3, pydisc.metrics_report()
        assert not METRICS.cuda_graph_fallbacks
        torch.testing.assert_close(torch.stack([l.cpu() for l in losses]), torch.stack(ref_losses).cpu())
        for p, q in zip(lazy.parameters(), ref.parameters()):
            torch.testing.assert_close(p.cpu(), q.cpu())
    finally:
        pstep.clear_plans()


@pytest.mark.cuda
def test_random_ops_draw_new_numbers_at_each_replay():
    """Dropout runs in torch inside the graph: each replay advances torch's generator, as eager steps
    do (CUDA graphs register the default generator), so the masks differ from step to step."""
    pydisc.reset_metrics()
    torch.manual_seed(0)
    w = pydisc.to_lazy(torch.ones(256, 256, device="cuda"))
    x = torch.ones(256, 256, device="cuda")
    pstep.clear_plans()
    try:
        outs = []
        for _ in range(6):
            out = torch.nn.functional.dropout(pydisc.to_lazy(x) @ w, 0.5, training=True) * 2
            pydisc.mark_step()
            outs.append(out.cpu())
        assert METRICS.cuda_graph_replays >= 3, pydisc.metrics_report()
        for a, b in zip(outs, outs[1:]):
            assert not torch.equal(a, b)
            kept = (a != 0).float().mean().item()
            assert 0.45 < kept < 0.55
    finally:
        pstep.clear_plans()


@pytest.mark.cuda
def test_a_capture_that_fails_leaves_random_ops_working(monkeypatch):
    """A capture broken by a synchronisation inside the step: the plan runs kernel by kernel, warned and
    counted, and dropout (torch's generator, which a failed capture can leave in capture mode) keeps
    working in the steps after it and outside pydisc."""
    real = graphs._capture_graph

    def syncing(runner, args, device):
        def runner_then_sync(*a):
            out = runner(*a)
            torch.cuda.synchronize()   # not allowed while a stream is captured
            return out
        return real(runner_then_sync, args, device)

    monkeypatch.setattr(graphs, "_capture_graph", syncing)
    pydisc.reset_metrics()
    w = pydisc.to_lazy(torch.ones(64, 64, device="cuda"))
    pstep.clear_plans()
    try:
        with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
            for _ in range(6):
                out = torch.nn.functional.dropout(pydisc.to_lazy(torch.ones(64, 64, device="cuda")) @ w, 0.5)
                pydisc.mark_step()
                kept = (out.cpu() != 0).float().mean().item()
                assert 0.4 < kept < 0.6
        assert METRICS.cuda_graph_captures == 0 and sum(METRICS.cuda_graph_fallbacks.values()) == 1
        assert not METRICS.compile_failures, METRICS.compile_failures
        torch.rand(8, device="cuda").sum().item()
    finally:
        pstep.clear_plans()


class _Tagger(torch.nn.Module):
    """Per-token classes over a sequence whose length changes from step to step."""

    def __init__(self, vocab: int = 11, dim: int = 16) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.ln(self.tok(ids))
        x = x + torch.tanh(self.mix(x)).cumsum(1) / ids.shape[1]
        return self.out(x)


@pytest.mark.parametrize("device,max_shapes,memory", [
    ("cpu", graphs.MAX_SHAPE_GRAPHS, False), ("cpu", 2, False), ("cpu", 2, True),
    pytest.param("cuda", graphs.MAX_SHAPE_GRAPHS, False, marks=pytest.mark.cuda)])
def test_each_shape_of_a_template_replays_its_own_graph(device, max_shapes, memory, request, monkeypatch):
    """Training at lengths that recur runs a dynamic-shape template: each length (a binding of it) is
    captured once it has run `CAPTURE_AT` times and replayed after, with its parameters and AdamW's state
    updated in place by the graph. The parameters equal eager's after every step. With room for fewer
    shapes than recur, the shape run longest ago gives its graph back and is captured again when it comes
    back, until it gave its graph back `MAX_EVICTIONS` times: from then on it runs kernel by kernel, and the
    steps capture nothing more (each capture would cost a device synchronisation). Where the graphs hold
    less memory than the device lends them (`memory`), more than `MAX_SHAPE_GRAPHS` keep theirs."""
    if device == "cpu":
        request.getfixturevalue("fake_graphs")
    monkeypatch.setattr(graphs, "MAX_SHAPE_GRAPHS", max_shapes)
    if memory:
        monkeypatch.setattr(graphs, "_shape_budget", lambda device: 1 << 30)
        max_shapes = 4
    pydisc.reset_metrics()
    torch.manual_seed(0)
    model = _Tagger().to(device)
    ref = _Tagger().to(device)
    ref.load_state_dict(model.state_dict())
    lengths = (8, 12, 16, 10) * 6
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 11, (3, t), generator=g).to(device), torch.randint(0, 11, (3, t), generator=g).to(device))
               for t in lengths]
    # the written inputs that the step copies itself after a run (driver/bind.py): none after a replay,
    # where the graph wrote them all
    copied_after = []
    write_inputs = pbind._write_inputs

    def counting(trace, indices, vals, copied=False, swaps=()):
        copied_after.append(0 if copied else sum(val.data_ptr() != trace.input_storages[i].real.data_ptr()
                                                 for i, val in zip(indices, vals)))
        return write_inputs(trace, indices, vals, copied, swaps)

    monkeypatch.setattr(pbind, "_write_inputs", counting)
    pstep.clear_plans()
    captured = []       # captures per step
    try:
        lazy = pydisc.lazy(model)
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (lazy, ref)]
        for step, (ids, y) in enumerate(batches):
            captures = METRICS.cuda_graph_captures
            for m, opt, target in ((lazy, opts[0], pydisc.to_lazy(y)), (ref, opts[1], y)):
                torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), target.flatten()).backward()
                opt.step()
                opt.zero_grad()
            replays = METRICS.cuda_graph_replays
            del copied_after[:]
            pydisc.mark_step()
            if METRICS.cuda_graph_replays > replays:
                assert copied_after == [0], (step, copied_after)
            captured.append(METRICS.cuda_graph_captures - captures)
            for (name, p), q in zip(lazy.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-5,
                                           msg=lambda msg, name=name, step=step: "step %d, %s: %s" % (step, name, msg))
        m = pydisc.metrics()
        assert m["dynamic_templates"] == 1 and m["dynamic_matches"] >= 3, m["recompiles"]
        bound = [b for b in ENGINE.plans.values() if type(b) is Binding and b.graph is not None]
        if max_shapes >= 4:
            # the three lengths that come back after the template: captured once each, then replayed
            assert not METRICS.cuda_graph_fallbacks, METRICS.cuda_graph_fallbacks
            assert METRICS.cuda_graph_captures >= 3 and METRICS.cuda_graph_replays >= 3, pydisc.metrics_report()
            assert sum(b.graph.graph is not None for b in bound) >= 3
        else:
            assert 3 < METRICS.cuda_graph_captures <= 4 * graphs.MAX_EVICTIONS, pydisc.metrics_report()
            assert sum(b.graph.graph is not None for b in bound) <= max_shapes
            given_up = [b for b in bound if b.graph.off is not None]
            assert given_up and all(b.graph.evictions == graphs.MAX_EVICTIONS for b in given_up)
            assert list(METRICS.cuda_graph_fallbacks) == [given_up[0].graph.off]
            assert sum(captured[-4:]) == 0, captured      # the last round of the four lengths
            assert METRICS.cuda_graph_replays >= max_shapes, pydisc.metrics_report()   # (the shapes that kept theirs)
        assert all(b.graph.kept and b.graph.direct for b in bound if b.graph.graph is not None)
    finally:
        pstep.clear_plans()


def test_shapes_give_their_graphs_back_until_the_rest_fit_the_memory_lent(monkeypatch):
    """Past `MAX_SHAPE_GRAPHS` captured shapes, those that ran longest ago give their graphs back until the
    rest hold no more memory than the device lends them (`_shape_budget`), the `MAX_SHAPE_GRAPHS` run last
    kept whatever they hold; a shape given back `MAX_EVICTIONS` times runs kernel by kernel. Graphs of
    another device count against theirs."""
    monkeypatch.setattr(graphs, "_SHAPES", {})
    monkeypatch.setattr(graphs, "_not_capturable", lambda runner, device: None)
    monkeypatch.setattr(graphs, "MAX_SHAPE_GRAPHS", 2)
    monkeypatch.setattr(graphs, "_shape_budget", lambda device: 100)
    cpu = torch.device("cpu")

    def captured(nbytes: int, device=cpu) -> graphs.StepGraph:
        g = graphs.StepGraph(lambda x: [x], device, {})
        g.graph, g.nbytes = object(), nbytes     # (a capture's state, as far as making room looks)
        graphs._SHAPES[id(g)] = weakref.ref(g)
        return g

    other = captured(1000, torch.device("meta"))
    shapes = [captured(30) for _ in range(6)]   # 180 bytes: the three that ran longest ago give theirs back
    graphs._make_room_for_shapes(cpu)
    assert [g.graph is not None for g in shapes] == [False] * 3 + [True] * 3
    assert [g.evictions for g in shapes] == [1] * 3 + [0] * 3 and other.graph is not None
    assert all(g.off is None for g in shapes)
    big = [captured(200) for _ in range(2)]      # the two run last keep theirs, over the budget as they are
    graphs._make_room_for_shapes(cpu)
    assert all(g.graph is None for g in shapes) and all(g.graph is not None for g in big)
    for g in shapes[:3]:        # captured again, and given back again: kernel by kernel from now on
        g.graph = object()
        graphs._SHAPES.pop(id(g), None)
        graphs._SHAPES[id(g)] = weakref.ref(g)
    newest = [captured(200) for _ in range(2)]
    graphs._make_room_for_shapes(cpu)
    assert all(g.graph is None for g in big + shapes) and all(g.graph is not None for g in newest)
    assert all(g.evictions == graphs.MAX_EVICTIONS and g.off is not None for g in shapes[:3])
    assert all(g.off is None for g in shapes[3:] + big) and other.graph is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_eager_windows_keep_the_graphs_where_the_device_has_room(device, request, monkeypatch):
    """Before the step choice's eager windows (`make_room`): on a GPU with as much free memory as the
    graphs hold, they are kept, so that the compiled steps after the window replay rather than capture
    again; short of memory, or off a GPU, they are given back."""
    if device == "cpu":
        request.getfixturevalue("fake_graphs")
    monkeypatch.setattr(graphs, "_not_capturable", lambda runner, device: None)   # (a plain function)
    a = torch.ones(256, 256, device=device)
    g = graphs.StepGraph(lambda x: [x @ x + 1], torch.device(device), {})
    for _ in range(graphs.CAPTURE_AT):
        g([a])
    assert g.graph is not None
    graphs.make_room(torch.device(device))
    if device == "cuda":
        assert g.graph is not None and g.nbytes > 0
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (g.nbytes - 1, 10 * g.nbytes))
        graphs.make_room(torch.device(device))
    assert g.graph is None
    torch.testing.assert_close(g([a])[0], a @ a + 1)
    assert g.graph is not None      # captured again
    graphs.release_memory()


def test_shapes_run_once_do_not_push_out_the_captured_ones(fake_graphs, monkeypatch):
    """Only captured shapes count toward `MAX_SHAPE_GRAPHS`: lengths seen once (never captured) leave the
    graphs of the lengths that recur alone; a new captured shape gives back the graph of the captured
    shape run longest ago; a shape whose binding is dropped takes its graph with it."""
    monkeypatch.setattr(graphs, "MAX_SHAPE_GRAPHS", 2)

    class Owner:     # a binding, as far as run_plan is concerned
        graph = None

    cpu = torch.device("cpu")
    a = torch.ones(3)

    def runner(x):       # the template's plan
        return [x * 2]

    def run(owner):
        out = graphs.run_plan(owner, runner, [a], dict, cpu, shape=True)[0]
        torch.testing.assert_close(out, a * 2)

    common = [Owner(), Owner()]
    for _ in range(graphs.CAPTURE_AT):
        for owner in common:
            run(owner)
    assert all(owner.graph.graph is not None for owner in common)
    for _ in range(5):
        run(Owner())                 # a length seen once
    assert all(owner.graph.graph is not None for owner in common)
    third = Owner()
    for _ in range(graphs.CAPTURE_AT):
        run(third)
    assert common[0].graph.graph is None and common[1].graph.graph is not None and third.graph.graph is not None
    held = weakref.ref(third.graph)
    del third
    gc.collect()
    assert held() is None
