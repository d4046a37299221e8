"""Foreach ops on lazy tensors: one recorded entry per call, run per tensor, equal to eager."""
from __future__ import annotations

import copy

import pytest
import torch

import pydisc
from pydisc.frontend.foreach import SplitForeach, _writes_grads
from pydisc.frontend.lazy_tensor import current_trace

SHAPES = [(3, 4), (5,), (2, 3, 2)]


def _tensors(seed: int, positive: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand if positive else torch.randn)(s, generator=g) for s in SHAPES]


def _adam_like(params, grads, ms, vs, step_sizes, bias2, decay):
    """AdamW's foreach update as torch writes it (torch/optim/adam.py), plus the other overloads
    optimizers and gradient clipping use."""
    torch._foreach_mul_(params, decay)                       # Scalar, lifted
    torch._foreach_lerp_(ms, grads, 0.1)                     # lerp weight, lifted
    torch._foreach_mul_(vs, 0.999)
    torch._foreach_addcmul_(vs, grads, grads, 0.001)         # addcmul value, lifted
    denom = torch._foreach_sqrt(vs)                          # new tensors
    torch._foreach_div_(denom, bias2)                        # ScalarList, lifted per tensor
    torch._foreach_add_(denom, 1e-8)                         # a constant
    torch._foreach_addcdiv_(params, ms, denom, step_sizes)   # ScalarList value, lifted
    torch._foreach_add_(params, grads, alpha=-0.25)          # List with an alpha, lifted
    norms = torch._foreach_norm(grads)
    total = torch.stack(norms).sum()
    torch._foreach_mul_(grads, 1.0 / (total + 1.0))          # Tensor: a 0-d lazy tensor
    return [*params, *ms, *vs, *denom, *norms, *grads]


def _state(seed):
    return _tensors(seed), _tensors(seed + 1), _tensors(seed + 2), _tensors(seed + 3, positive=True)


def test_foreach_update_records_one_entry_per_call_and_matches_eager() -> None:
    pydisc.reset_metrics()
    eager = _state(0)
    lazy = tuple([pydisc.to_lazy(t.clone()) for t in ts] for ts in eager)
    compiles = []
    for step in range(1, 4):     # per-step scalars, as Adam's bias corrections: one compiled step
        step_sizes = [-0.01 / step, -0.02 / step, -0.03 / step]
        bias2 = [1 - 0.999 ** step] * 3
        decay = 1 - 0.01 / step
        expected = _adam_like(*eager, step_sizes, bias2, decay)
        before = pydisc.metrics()["recorded_ops"]
        got = _adam_like(*lazy, step_sizes, bias2, decay)
        trace = current_trace()
        splits = [e for e in trace.entries if isinstance(e.fn, SplitForeach)]
        assert len(splits) == 11, [e.fn for e in trace.entries]
        assert pydisc.metrics()["recorded_ops"] - before < 20     # not one per tensor and op
        pydisc.mark_step()
        compiles.append(pydisc.metrics()["plans_compiled"])
        for i, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-6, msg=lambda m: "output %d: %s" % (i, m))
    assert compiles[0] > 0 and compiles[-1] == compiles[0], compiles
    m = pydisc.metrics()
    assert m["fallback_ops"] == {} and m["compile_failures"] == {}, m


@pytest.mark.parametrize("case", ["eager tensor in a list", "bf16 scalars", "symbolic"])
def test_foreach_calls_that_do_not_fit_one_entry_are_split_and_match_eager(case: str) -> None:
    xs, ys = _tensors(0), _tensors(1)
    if case == "bf16 scalars":    # a float next to a 0-d bf16 tensor is not lifted (it would promote)
        xs, ys = [torch.randn((), dtype=torch.bfloat16) for _ in range(3)], [torch.randn(()).bfloat16() for _ in range(3)]
    expected = [x.clone() for x in xs]
    torch._foreach_addcmul_(expected, ys, ys, 0.5)
    torch._foreach_mul_(expected, 0.75)
    copies = [x.clone() for x in xs]
    if case == "symbolic":        # a tensor with a symbolic size in the list
        pydisc.mark_dynamic(copies[0], 0)
    lazy = [pydisc.to_lazy(x) for x in copies]
    others = [pydisc.to_lazy(y) for y in ys]
    if case == "eager tensor in a list":
        others[1] = ys[1]
    torch._foreach_addcmul_(lazy, others, others, 0.5)
    torch._foreach_mul_(lazy, 0.75)
    entries = current_trace().entries
    whole = [str(e.fn) for e in entries if isinstance(e.fn, SplitForeach)]
    # the calls that do not fit are recorded per tensor (the mul of the first two cases fits)
    assert whole == ([] if case != "eager tensor in a list" else ["split(aten._foreach_mul_.Scalar)"]), whole
    assert len(entries) >= len(whole) + 3     # one or more entries per tensor
    pydisc.mark_step()
    for g, e in zip(lazy, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-6)


def test_split_foreach_replays_eagerly_like_the_op() -> None:
    """The entry's function on plain tensors (the eager fallback of a plan) is the foreach op."""
    xs, ys = _tensors(0), _tensors(1)
    split = SplitForeach(torch.ops.aten._foreach_addcdiv_.ScalarList)
    got = [x.clone() for x in xs]
    split(got, ys, [y.abs() + 1 for y in ys], [torch.tensor(0.5), torch.tensor(-1.0), torch.tensor(2.0)])
    expected = [x.clone() for x in xs]
    torch._foreach_addcdiv_(expected, ys, [y.abs() + 1 for y in ys], [0.5, -1.0, 2.0])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_split_foreach_calls_element_overloads_not_the_packet(monkeypatch) -> None:
    """Replayed, each element runs its own overload: calling the packet (`aten.lerp_`) resolves the
    overload at every call, and with a lifted 0-d weight tries `lerp_.Scalar` first and fails inside,
    some 30x the op's cost (a BERT-base AdamW step's eager replay took 172 ms in `lerp_` on the H200).
    The values are eager's."""
    packet_calls = []
    real_call = torch._ops.OpOverloadPacket.__call__

    def counting(self, *args, **kwargs):
        packet_calls.append(str(self))
        return real_call(self, *args, **kwargs)

    xs, ys = _tensors(0), _tensors(1)
    weights = [torch.tensor(0.25), torch.tensor(0.5)]
    expected = [x.clone() for x in xs]
    for w in weights:
        torch._foreach_lerp_(expected, ys, w.item())
        torch._foreach_addcmul_(expected, ys, ys, 0.5)
        torch._foreach_mul_(expected, 0.75)
    got = [x.clone() for x in xs]
    lerp = SplitForeach(torch.ops.aten._foreach_lerp_.Scalar)
    addcmul = SplitForeach(torch.ops.aten._foreach_addcmul_.Scalar)
    mul = SplitForeach(torch.ops.aten._foreach_mul_.Scalar)
    monkeypatch.setattr(torch._ops.OpOverloadPacket, "__call__", counting)

    def unwanted(*args, **kwargs):
        # formats each rejected argument's value into an error message: a device read for a CUDA tensor
        raise AssertionError("torch._C._jit_resolve_packet called for %s" % (args[0],))

    monkeypatch.setattr(torch._C, "_jit_resolve_packet", unwanted)
    for w in weights:
        lerp(got, ys, w)
        addcmul(got, ys, ys, 0.5)
        mul(got, 0.75)
    assert packet_calls == [], packet_calls
    assert lerp.overloads == {(torch.Tensor, torch.Tensor, torch.Tensor): torch.ops.aten.lerp_.Tensor}
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_element_overloads_are_the_ones_torch_resolves() -> None:
    """`_resolve` picks, for every kind of argument a foreach element passes (tensors, 0-d tensors,
    floats, ints, bools, the `alpha`/`value` keywords), the overload that torch's own resolution picks:
    numbers bind to Tensor parameters only for the ops torch allows it for (`mul_(t, 2.0)` runs
    `mul_.Tensor`, `pow(t, 2.0)` runs `pow.Tensor_Scalar`)."""
    import itertools

    from pydisc.frontend.foreach import _resolve

    t, zero_d = torch.randn(3), torch.tensor(0.5)
    names = ["lerp_", "mul_", "mul", "add_", "sub", "div_", "div", "addcmul_", "addcdiv_", "sqrt", "pow", "clamp",
             "clamp_min_", "maximum", "abs_", "neg", "copy_", "zero_", "fill_", "norm", "max"]
    checked = 0
    for name in names:
        packet = getattr(torch.ops.aten, name)
        for arity in (1, 2, 3):
            for rest in itertools.product([t, zero_d, 0.5, 2, True], repeat=arity - 1):
                for kwargs in ({}, {"alpha": 2.0}, {"value": 0.5}):
                    try:
                        expected = torch._C._jit_resolve_packet(packet._qualified_op_name, t, *rest, **kwargs)
                    except RuntimeError:
                        continue        # no overload takes these
                    assert _resolve(packet, [t, *rest], kwargs) is getattr(packet, expected), (name, rest, kwargs)
                    checked += 1
    assert checked > 100


def test_foreach_entries_in_steps_with_dynamic_dims_match_one_template() -> None:
    """AdamW (foreach) after a forward whose sequence length changes every step: the steps match the
    dynamic template (the foreach entries included) and train like eager."""
    import copy

    import torch.nn.functional as F
    from torch import nn

    from pydisc.driver import step as pstep

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin, self.out = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50)

        def forward(self, idx):
            return self.out(torch.tanh(self.lin(self.emb(idx))))

    pstep.clear_plans()
    pydisc.reset_metrics()
    torch.manual_seed(0)
    eager = LM()
    lazy = pydisc.lazy(copy.deepcopy(eager))
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=True)
    opt_l = torch.optim.AdamW(lazy.parameters(), lr=1e-2, foreach=True)
    g = torch.Generator().manual_seed(1)
    try:
        for length in (8, 12, 8, 10, 14, 9, 8, 12):
            idx = torch.randint(0, 50, (2, length + 1), generator=g)
            x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
            loss_e = F.cross_entropy(eager(x).flatten(0, 1), y.flatten())
            loss_e.backward()
            opt_e.step()
            opt_e.zero_grad()
            for t in (x, y):
                pydisc.mark_dynamic(t, 1)
            loss_l = F.cross_entropy(lazy(x).flatten(0, 1), pydisc.to_lazy(y).flatten())
            loss_l.backward()
            opt_l.step()
            opt_l.zero_grad()
            pydisc.mark_step()
            torch.testing.assert_close(loss_l.item(), loss_e.item(), rtol=1e-5, atol=1e-5)
        for pe, pl in zip(eager.parameters(), lazy.parameters()):
            torch.testing.assert_close(pl.cpu(), pe, rtol=1e-5, atol=1e-6)
        m = pydisc.metrics()
        assert m["dynamic_matches"] >= 3 and not m["fallback_ops"] and not m["compile_failures"], m
    finally:
        pstep.clear_plans()


def test_a_split_foreach_op_does_not_run_its_pending_arguments() -> None:
    """An op split per element (a list holds an eager tensor) resolves each element's overload without
    torch's resolution, which formats each argument an overload rejects into its error message: for a
    pending lazy tensor (`lerp_.Scalar` rejecting a weight of `_foreach_lerp_.List`), that ran what the
    weight needed."""
    ys = [pydisc.to_lazy(t) for t in _tensors(0)]
    w = pydisc.to_lazy(torch.tensor(0.25))
    expected = [t.clone() for t in _tensors(0)]
    pydisc.mark_step()
    pydisc.reset_metrics()
    xs = [pydisc.to_lazy(t) for t in _tensors(1)]
    xs[1] = _tensors(1)[1]      # an eager tensor in the list: the op is split
    weights = [w * 2] * len(ys)     # pending
    torch._foreach_lerp_(ys, xs, weights)
    assert pydisc.metrics()["materializations"] == 0
    pydisc.mark_step()
    torch._foreach_lerp_(expected, _tensors(1), 0.5)
    for y, e in zip(ys, expected):
        torch.testing.assert_close(y.cpu(), e)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
], ids=["sgd", "adamw"])
def test_cpu_optimizers_record_their_foreach_path_and_match_eager(make) -> None:
    """On the CPU eager's optimizers loop per parameter; for lazy parameters the step takes the foreach
    implementation (the same formulas), so an optimizer step is a few entries, not one per parameter and
    op, with eager's values; the group's `foreach` is the user's again after the step."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    lazy = pydisc.lazy(copy.deepcopy(eager))
    opts = make(eager.parameters()), make(lazy.parameters())
    x = torch.randn(5, 8)
    for step in range(3):
        losses = []
        for model, opt in zip((eager, lazy), opts):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            before = len(current_trace().entries) if model is lazy else 0
            opt.step()
            if model is lazy:
                entries = current_trace().entries[before:]
                assert any(isinstance(e.fn, SplitForeach) for e in entries), [e.fn for e in entries]
                if step:        # (the first step also makes the state: one zeros_like per parameter)
                    assert len(entries) <= 12, [e.fn for e in entries]    # per parameter: 20-40
            losses.append(loss)
        pydisc.mark_step()
        torch.testing.assert_close(losses[1].cpu(), losses[0], rtol=1e-5, atol=1e-6)
        assert [g["foreach"] for g in opts[1].param_groups] == [None]
        assert "foreach" in opts[1].state_dict()["param_groups"][0]
        assert opts[1].state_dict()["param_groups"][0]["foreach"] is None
    for p, q in zip(eager.parameters(), lazy.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6)


def test_a_step_that_raised_leaves_the_saved_foreach_setting_as_the_user_left_it() -> None:
    """The step's pre-hook sets `foreach` for lazy groups and its post-hook puts it back; a step that
    raises (here its closure) skips the post-hook, and `state_dict()` still saves what the user set."""
    lazy = pydisc.lazy(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    lazy(torch.randn(3, 4)).sum().backward()

    def closure():
        raise RuntimeError("the user's closure")
    with pytest.raises(RuntimeError, match="the user's closure"):
        opt.step(closure)
    assert opt.state_dict()["param_groups"][0]["foreach"] is None
    fresh = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["foreach"] is None
    opt.step()                  # the next step puts it back first
    pydisc.mark_step()
    assert opt.param_groups[0]["foreach"] is None


_CONFIGS = [(torch.optim.SGD, dict(momentum=m, nesterov=n, weight_decay=w, maximize=mx))
            for m in (0.0, 0.9) for n in (False, True) for w in (0.0, 0.1) for mx in (False, True) if not (n and not m)]
_CONFIGS += [(cls, dict(weight_decay=w, maximize=mx)) for cls in (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD) for w in (0.0, 0.1) for mx in (False, True)]


@pytest.mark.parametrize("cls,options", _CONFIGS, ids=["%s-%s" % (c.__name__, "-".join(
    "%s%s" % (k, v) for k, v in o.items())) for c, o in _CONFIGS])
def test_the_foreach_steps_that_write_gradients_are_the_ones_pydisc_leaves_to_the_loop(cls, options) -> None:
    """pydisc runs lazy CPU groups with torch's foreach step (`optimizers_take_their_foreach_path`) except
    where it writes `.grad` where eager's per-parameter loop does not (`_writes_grads`). This holds that
    list to what this torch does, in eager: a newer torch that writes gradients elsewhere fails here."""
    torch.manual_seed(0)
    base, x = torch.nn.Linear(4, 3), torch.randn(5, 4)
    grads = []
    for foreach in (False, True):
        model = copy.deepcopy(base)
        opt = cls(model.parameters(), lr=0.1, foreach=foreach, **options)
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        grads.append([p.grad for p in model.parameters()])
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))
    assert same != _writes_grads(opt, opt.param_groups[0])
