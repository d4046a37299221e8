"""Steps recorded at `__torch_function__` served by dynamic-shape templates (pydisc/driver/fast_match.py).

Each test trains a model under pydisc and a copy eagerly on batches whose length changes every step and
compares every parameter; the counters say how many steps the fast recorder made (`fast_segments`) and
how many a template served (`dynamic_matches`). Before fast_match.py, a model with dynamic dims was
recorded op by op by the dispatcher from its first size change on: `fast_segments` stayed at 2.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import pydisc
from pydisc.config import CONFIG
from pydisc.diagnostics import PydiscWarning
from pydisc.driver import dynamic, fast_match, step_choice
from pydisc.driver.step import clear_plans
from pydisc.frontend.lazy_tensor import RECORDER

# Lengths that come again, as a training loop's do: a model with dynamic dims records a step fast once
# its input sizes were seen before (`dynamic._fast_gate`)
LENGTHS = (8, 12, 16, 10, 8, 12, 16, 10, 12, 8, 16, 10, 14, 14)


@pytest.fixture(autouse=True)
def fresh():
    clear_plans()
    pydisc.reset_metrics()
    yield
    clear_plans()


class Encoder(torch.nn.Module):
    """Embeddings, one attention layer over a padding mask, a per-token classifier. `read_mask`: as HF's
    mask code does, `mask.all()` is read in the forward (the mask is used only where it has padding);
    `where_mask`: the scores are masked by `torch.where` on the mask (a uint8 eager mask when given)."""

    def __init__(self, vocab: int = 13, dim: int = 16, read_mask: bool = False) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)    # (a key bias's gradient is 0 plus rounding)
        self.out = torch.nn.Linear(dim, vocab)
        self.ln = torch.nn.LayerNorm(dim)
        self.read_mask = read_mask

    def forward(self, ids, mask):
        x = self.tok(ids)
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) * 0.25
        if not self.read_mask or not bool(mask.all()):
            scores = torch.where(mask[:, None, :].bool(), scores, float("-inf"))
        x = x + scores.softmax(-1) @ v
        return self.out(x)


def _batches(lengths, batch: int = 3, vocab: int = 13, padded: bool = True, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    out = []
    for n, t in enumerate(lengths):
        ids = torch.randint(0, vocab, (batch, t), generator=g)
        mask = torch.ones(batch, t, dtype=torch.long)
        if padded:
            mask[n % batch, t // 2:] = 0
        out.append(tuple(x.to(device) for x in (ids, mask, torch.randint(0, vocab, (batch, t), generator=g))))
    return out


def _train(model, batches, make_opt=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), schedule=None,
           accumulate: bool = False, read_loss: str = ""):
    """Train `model` under pydisc and a copy eagerly (inputs through the lazy module, targets through
    `to_lazy`), compare the parameters after every step; the metrics. `read_loss`: "after_backward" or
    "after_step" reads the loss there every step (`loss.item()`, to log it), "after_step_no_grad" an
    accuracy computed under `no_grad` after `opt.step()`, and compares it."""
    ref = copy.deepcopy(model)
    lazy = pydisc.lazy(model)
    opts = [make_opt(m.parameters()) for m in (lazy, ref)]
    scheds = [schedule(o) for o in opts] if schedule else []
    for step, (ids, mask, y) in enumerate(batches):
        logged = []
        for m, opt, target in ((lazy, opts[0], pydisc.to_lazy(y)), (ref, opts[1], y)):
            logits = m(ids, mask)
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss.backward()
            if read_loss == "after_backward":
                logged.append(loss.item())
            if not accumulate or step % 2:
                opt.step()
                opt.zero_grad()
            if read_loss == "after_step":
                logged.append(loss.item())
            elif read_loss == "after_step_no_grad":      # an accuracy, computed without grad
                with torch.no_grad():
                    logged.append((logits.argmax(-1) == target).float().mean().item())
        if logged:
            assert logged[0] == pytest.approx(logged[1], rel=1e-5), (step, logged)
        for s in scheds:
            s.step()
        pydisc.mark_step()
        for (name, p), q in zip(lazy.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=1e-5,
                                       msg=lambda msg, name=name, step=step: "step %d, %s: %s" % (step, name, msg))
    return pydisc.metrics()


def _fast_and_matched(m) -> None:
    # step 1 is fast; 2 and 3 have new lengths (recorded by the dispatcher, which finds the changed dim;
    # 3 runs eagerly); 4 is the template (recorded by the dispatcher, symbolically); then the steps of
    # lengths seen before are fast (all but the 13th)
    assert m["dynamic_templates"] == 1, m["recompiles"]
    assert m["dynamic_matches"] >= 5, (m["dynamic_matches"], m["recompiles"])     # one per length and path
    assert m["fast_segments"] >= len(LENGTHS) - 4, (m["fast_segments"], m["fast_demotions"])
    assert not m["fast_demotions"], m["fast_demotions"]


def test_steps_of_recurring_lengths_are_recorded_fast_and_run_the_template():
    torch.manual_seed(0)
    m = _train(Encoder(), _batches(LENGTHS))
    _fast_and_matched(m)
    assert m["plans_compiled"] <= 3, m["plans_compiled"]


def test_the_step_choice_probes_a_step_recorded_fast(monkeypatch):
    """The step choice's probe times a step's recording against a plain eager step, and keeps eager for good
    where recording is much slower. Steps of new lengths are recorded op by op and symbolically, at several
    times the cost of the steps of lengths seen before, which record fast: the probe waits for one of
    those. (It timed the first new length: variable-length BERT-base on an H100 recorded that step in 53 ms
    against a 24 ms eager step and kept eager, never compiling.)"""
    monkeypatch.setattr(CONFIG, "step_choice", "cpu")
    probed = []
    start = step_choice._start_probe
    monkeypatch.setattr(step_choice, "_start_probe",
                        lambda s, recorded, device: probed.append(s.probed) or start(s, recorded, device))
    step_choice.reset()
    try:
        torch.manual_seed(0)
        m = _train(Encoder(), _batches(LENGTHS))
    finally:
        step_choice.reset()
    assert probed[:1] == [True], (probed, m["step_choice"])


@pytest.mark.cuda
def test_steps_of_recurring_lengths_are_recorded_fast_on_cuda():
    """On a GPU autograd runs the ATen-level form's backward on a thread of its own, which records while
    mark_step holds the recorder's lock (fast_match._fused lets go of it meanwhile)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = _train(Encoder(read_mask=True).cuda(), _batches(LENGTHS, device="cuda"))
    _fast_and_matched(m)


def test_learning_rates_and_adams_corrections_follow_each_step():
    """The optimizer's floats are lifted scalars of the fast step: the template's plan gets this step's
    (a schedule changes the learning rate every step; Adam's bias corrections change by themselves)."""
    torch.manual_seed(0)
    m = _train(Encoder(), _batches(LENGTHS), make_opt=lambda p: torch.optim.AdamW(p, lr=0.01),
               schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)))
    _fast_and_matched(m)


def test_a_value_read_in_the_forward_and_used_after_it():
    """`if not mask.all():` then the mask: the dispatcher's read ran the ops that make the mask's bool form
    and its template reads it as an input; a fast step passes the value its forward computed for the read."""
    torch.manual_seed(0)
    m = _train(Encoder(read_mask=True), _batches(LENGTHS))
    _fast_and_matched(m)
    assert m["fast_reads"] >= len(LENGTHS) - 4


@pytest.mark.parametrize("where", ["after_step", "after_backward", "after_step_no_grad"])
def test_a_loss_read_every_step_to_log_it(where):
    """`loss.item()` before mark_step runs what is recorded so far: after `opt.step()` the whole step, one
    plan as without the read; after `backward()` the forward and backward, then the optimizer at mark_step.
    Each part is served by a template. (Before, the read ran only the ops the loss needs, and the parts
    were planned per shape: 15-18 plans in these 14 steps.) A read under `no_grad` that runs the rest of
    the step along with what it needs does not end the step (as a `generate()` token's read does): the
    step's input sizes are still noted at mark_step, and its next steps of those sizes record fast."""
    torch.manual_seed(0)
    m = _train(Encoder(), _batches(LENGTHS), read_loss=where)
    assert m["plans_compiled"] <= (5 if where == "after_backward" else 3), (m["plans_compiled"], m["recompiles"])
    assert m["fast_segments"] >= len(LENGTHS) - 4, (m["fast_segments"], m["fast_demotions"])
    assert not m["fast_demotions"], m["fast_demotions"]


def test_unpadded_batches_take_the_branch_without_the_mask():
    torch.manual_seed(0)
    m = _train(Encoder(read_mask=True), _batches(LENGTHS, padded=False))
    _fast_and_matched(m)


def test_gradients_accumulated_over_two_backwards():
    """`.grad` accumulated across steps (no zero_grad in between): whatever serves these steps, the
    parameters are eager's."""
    torch.manual_seed(0)
    m = _train(Encoder(), _batches(LENGTHS), accumulate=True)
    assert m["dynamic_templates"] <= 3, m["recompiles"]


class SlidingWindow(torch.nn.Module):
    """Attention under a boolean causal mask with a sliding window, made in the forward from `torch.arange`
    over the length, as HF's Mistral and Falcon make theirs: an eager tensor, which
    `F.scaled_dot_product_attention` turns into an additive float mask inside the call."""

    def __init__(self, vocab: int = 13, dim: int = 16, window: int = 6, changing: bool = False) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.window = window
        self.changing = changing    # the window an eager tensor of another value at each call
        self.calls = 0

    def forward(self, ids, mask):
        x = self.tok(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=x.device)
        self.calls += 1
        window = torch.tensor(2 + self.calls % 5) if self.changing else self.window
        keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None].expand(b, 1, t, t))
        return self.out(h.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("changing", [False, True], ids=["fixed_window", "window_changes_every_step"])
def test_an_eager_boolean_mask_made_in_the_forward(changing):
    """The float mask that torch makes inside the attention call from the eager boolean one is made again
    from each step's boolean mask, by the same ops: a step of a length seen before, whose mask differs
    (the window changes), gets its own (kept as the first step's, the parameters differ from eager's at
    step 8). Before, no template took such a fast step (that tensor came from no input of it) and after
    two of them the model went back to the dispatcher."""
    torch.manual_seed(0)
    m = _train(SlidingWindow(changing=changing), _batches(LENGTHS))
    _fast_and_matched(m)


def test_an_eager_input_torch_refuses_to_make_again_runs_the_step_eagerly(monkeypatch):
    """Where making a served step's float mask again raises (it has not been seen to), that step runs
    eagerly, warned once and counted, with eager's results, and its structure is matched anew."""
    def refuse(self, trace):
        raise RuntimeError("refused")

    monkeypatch.setattr(dynamic.Recomputed, "__call__", refuse)
    torch.manual_seed(0)
    with pytest.warns(PydiscWarning, match="passing a step.s inputs to its dynamic-shape plan failed"):
        m = _train(SlidingWindow(changing=True), _batches(LENGTHS))     # (compares the parameters every step)
    assert m["compile_failures"]["binding:RuntimeError"] >= 4, m["compile_failures"]


@pytest.mark.cuda
def test_an_eager_boolean_mask_made_in_the_forward_on_cuda():
    """On CUDA torch also pads the float mask's rows to a multiple of 8 inside the call (memory-efficient
    attention): made again at each step too. Lengths that are multiples of 8 are left out: there torch
    does not pad, and a template recorded at another length expects the padded layout (no guard says
    why), so they take a template of their own (docs/dynamic.md, limits)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    lengths = tuple(n + 1 if n % 8 == 0 else n for n in LENGTHS)
    m = _train(SlidingWindow(changing=True).cuda(), _batches(lengths, device="cuda"))
    _fast_and_matched(m)


class Gathered(torch.nn.Module):
    """Features picked by an eager index tensor of the step's data: `x[:, :, index]`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, index):
        return self.proj(x)[:, :, index].sum(-1)


def _beside_eager(model, lengths, batch, loss_of, lr: float = 0.1, lazy_target: bool = True,
                  keep_output: bool = False):
    """Train `model` under pydisc and a copy eagerly with SGD, a step per length `t` of `lengths` on
    `batch(g, step, t)` = (the model's inputs, a target for `loss_of(output, target)`, through `to_lazy`
    with `lazy_target`); compare the parameters after every step (and with `keep_output`, the outputs
    kept past mark_step); the metrics."""
    ref = copy.deepcopy(model)
    lazy = pydisc.lazy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (lazy, ref)]
    g = torch.Generator().manual_seed(0)
    for step, t in enumerate(lengths):
        inputs, target = batch(g, step, t)
        kept = []
        for m, opt, y in ((lazy, opts[0], pydisc.to_lazy(target) if lazy_target else target), (ref, opts[1], target)):
            out = m(*inputs)
            loss_of(out, y).backward()
            opt.step()
            opt.zero_grad()
            kept.append(out)
        pydisc.mark_step()
        for p, q in zip(lazy.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg="step %d" % step)
        if keep_output:
            torch.testing.assert_close(kept[0].detach().cpu(), kept[1].detach(), rtol=1e-4, atol=1e-5,
                                       msg="output, step %d" % step)
    return pydisc.metrics()


def test_an_eager_tensor_of_the_data_is_passed_anew_every_step():
    """The index's values change every step at the same shape: a step served from the plan cache must use
    its own index, never the one of the step that was matched first."""
    torch.manual_seed(0)

    def batch(g, step, t):
        x, index = torch.randn(2, t, 8, generator=g), torch.randint(0, 8, (3,), generator=g)
        return (x, index), torch.randn(2, t, generator=g)

    m = _beside_eager(Gathered(), (5, 7, 9, 6, 8, 7, 9, 6, 8, 7), batch, F.mse_loss)
    assert m["dynamic_matches"] >= 4 and m["fast_segments"] >= 6, (m["dynamic_matches"], m["fast_segments"])


def test_an_eager_scalar_whose_value_changes_every_step():
    """`x ** e` with `e` an eager 0-d tensor of another value each step: its gradient takes `e - 1`, a
    number torch computes inside the backward from `e`. Kept as a constant of the step's structure, a
    later step of the same length would have used the first one's (step 8 differed from eager); the
    fast step is not served by the template then, and the dispatcher's steps pass their own."""
    torch.manual_seed(0)

    def batch(g, step, t):
        return (torch.randn(2, t, 8, generator=g),), torch.tensor(1.5 + 0.1 * step)

    _beside_eager(torch.nn.Linear(8, 8), (5, 7, 9, 6, 8, 7, 9, 6, 8, 7), batch,
                  lambda out, exponent: (out.abs() + 1).pow(exponent).mean(), lr=0.01, lazy_target=False)


class Einsum(torch.nn.Module):
    """Logits from `einsum`, which returns a permuted view of the product it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        h = self.proj(x).unflatten(-1, (4, 6))                      # (b, t, 4, 6)
        return torch.einsum("bthd,bshd->bths", h, h)               # a view of a (b, t, h, s)-ordered product


def test_a_value_kept_that_is_a_view_of_what_a_call_made():
    """The logits the loop keeps past mark_step are a view of what `einsum` made: the template's plan
    returns that product, whose layout differs. Before, binding copied it into the logits' layout as if it
    were a reshape, and the kept logits of every matched step differed from eager's; now such a step is
    not served (the model goes back to the dispatcher)."""
    torch.manual_seed(0)

    def batch(g, step, t):
        return (torch.randn(2, t, 8, generator=g),), None

    m = _beside_eager(Einsum(), (5, 7, 9, 6, 5, 7, 9, 6, 5, 7), batch, lambda out, _: out.square().mean(),
                      lazy_target=False, keep_output=True)
    assert m["fast_demotions"] == {"dynamic shapes: no template takes the fast step": 1}, m["fast_demotions"]


class SometimesRead(Encoder):
    """Computes `mask.all()` of the mask's bool form at every step, reads it at every other step (the same
    calls either way), and uses the bool form after."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def forward(self, ids, mask):
        self.steps += 1
        mask = mask.bool()
        full = mask.all()
        if self.steps % 2 == 0:
            bool(full)
        return super().forward(ids, mask)


def test_a_read_at_some_steps_only():
    """The same calls with and without a read before them are two structures: the values computed for the
    read are passed to a template's plan by the steps that made them. With one key, a step without the
    read could find the binding of a step with it and look for values it never computed."""
    torch.manual_seed(0)
    model = pydisc.lazy(SometimesRead())
    ids, mask, y = _batches([8])[0]
    sigs = []
    for _ in range(2):
        F.cross_entropy(model(ids, mask).flatten(0, 1), y.flatten()).backward()
        sigs.append([e.sig for e in RECORDER.trace.entries if e.sig[0] == "fused"])
        model.zero_grad()
        pydisc.mark_step()
    assert len(sigs[0]) == len(sigs[1]) == 1 and sigs[0] != sigs[1]
    m = _train(SometimesRead(), _batches(LENGTHS + LENGTHS))     # (no template takes both: eager's values)
    assert m["dynamic_templates"] >= 1


def test_a_fast_step_no_template_takes_goes_back_to_the_dispatcher(monkeypatch):
    """A fast step whose ATen-level form no template takes: it runs eagerly, and after two such steps the
    model is recorded by the dispatcher again (counted in `fast_demotions`), its steps served as before."""
    monkeypatch.setattr(fast_match, "match_template", lambda *args: None)
    torch.manual_seed(0)
    m = _train(Encoder(), _batches(LENGTHS))
    assert m["fast_demotions"] == {"dynamic shapes: no template takes the fast step": 1}, m["fast_demotions"]
    # steps 5 and 6 (fast) match nothing and run eagerly; 7 is a template again; 8-14 match it
    assert m["dynamic_matches"] >= 3 and m["fast_segments"] == 3, (m["dynamic_matches"], m["recompiles"])
