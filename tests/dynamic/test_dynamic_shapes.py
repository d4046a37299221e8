"""Dynamic shapes: a step whose input sizes change is compiled once and reused for every size.

Every test trains or runs a model with pydisc and eagerly side by side and compares values; the
counters say how often pydisc planned (templates), matched a template (no compile) or ran eagerly.
"""
import copy
import gc
import math

import pytest
import torch

import pydisc
from pydisc.driver.engine import ENGINE
from pydisc.config import CONFIG
from pydisc.driver.step import clear_plans


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    clear_plans()
    pydisc.reset_metrics()
    yield monkeypatch
    clear_plans()


class TinyLM(torch.nn.Module):
    """Embedding + learned positions + one causal attention head + MLP + tied output."""

    def __init__(self, vocab=11, dim=16, max_len=64):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.heads = 2

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        h = self.ln(x)
        q, k, v = self.qkv(h).split(x.size(-1), dim=-1)
        hd = x.size(-1) // self.heads
        q = q.view(B, T, self.heads, hd).transpose(1, 2)
        k = k.view(B, T, self.heads, hd).transpose(1, 2)
        v = v.view(B, T, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(T, T, device=idx.device, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        x = x + y
        x = x + self.mlp(self.ln(x))
        logits = x @ self.tok.weight.t()
        return torch.nn.functional.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def _train(sizes, *, mark=False, device="cpu"):
    torch.manual_seed(0)
    model = TinyLM().to(device)
    ref = copy.deepcopy(model)
    pydisc.lazy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses, compiles = [], [], []
    g = torch.Generator().manual_seed(1)
    for B, T in sizes:
        idx = torch.randint(0, 11, (B, T), generator=g).to(device)
        tgt = torch.randint(0, 11, (B, T), generator=g).to(device)
        if mark:
            pydisc.mark_dynamic(idx, [0, 1])
            pydisc.mark_dynamic(tgt, [0, 1])
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        pydisc.mark_step()
        losses.append(loss.item())
        compiles.append(pydisc.metrics()["compiles"])
        r = ref(idx, tgt)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-4, atol=1e-5, msg=name)
    m = pydisc.metrics()
    m["compiles_per_step"] = compiles
    m["built"] = _built()       # (while the model, whose templates these are, is alive)
    return m


def _built():
    """Templates that were compiled (a template is compiled at its first match)."""
    return sum(t.plan is not None for t in ENGINE.dynamic.templates)


def test_sequence_length_changes_every_step_one_compiled_plan():
    sizes = [(2, 8), (2, 13), (2, 21), (2, 5), (2, 30), (2, 8), (2, 17), (2, 40)]
    m = _train(sizes)
    # steps 1-2 differ (the optimizer creates its state in step 1); step 3 reveals the changing dim
    # and runs eagerly; step 4 is recorded as a template; every later size matches it
    assert m["dynamic_templates"] == 1, m["recompiles"]
    assert m["dynamic_eager_steps"] == 1
    assert m["dynamic_matches"] == 4
    assert m["built"] == 1
    assert any("step input #0 dim 1 changed 13 -> 21" in r for r in m["recompiles"]), m["recompiles"]


def test_batch_and_length_marked_dynamic():
    sizes = [(3, 9), (2, 14), (4, 6), (3, 22), (2, 9), (5, 11), (2, 2)]
    m = _train(sizes, mark=True)
    # step 1 (optimizer state created) is a template that no later step matches, so it is never
    # compiled; steps 2-3 match nothing and run eagerly, step 4 is the template later steps match
    assert m["dynamic_templates"] == 2, m["recompiles"]
    assert m["dynamic_matches"] == len(sizes) - 4
    assert m["built"] == 1


def test_compiles_do_not_grow_with_new_sizes():
    sizes = [(2, 8), (2, 9), (3, 10), (2, 11), (2, 12), (2, 33), (3, 7), (4, 20), (2, 5), (6, 3)]
    m = _train(sizes, mark=True)
    first_match = len(sizes) - m["dynamic_matches"]    # index of the step that compiled the template
    per_step = m["compiles_per_step"]
    assert per_step[first_match:] == [per_step[first_match]] * (len(sizes) - first_match), per_step


def _sequences(sizes, classes: int) -> list:
    """(x, y) batches of sequences of 8 features: x (batch, length, 8), y a class per sequence."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, t, 8, generator=g), torch.randint(0, classes, (b,), generator=g)) for b, t in sizes]


def _trains_like_eager(model, loss_of, batches, atol: float = 1e-6) -> dict:
    """Train `model` under pydisc and its copy eagerly on `batches` (SGD with momentum, the targets
    through `to_lazy`: an eager target would pin the batch), compare the parameters, return the metrics."""
    ref = copy.deepcopy(model)
    pydisc.lazy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    for x, y in batches:
        for m, o, target in ((model, opt, pydisc.to_lazy(y)), (ref, ref_opt, y)):
            loss_of(m, x, target).backward()
            o.step()
            o.zero_grad()
        pydisc.mark_step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=atol, msg=name)
    m = pydisc.metrics()
    m["built"] = _built()       # (while the model, whose templates these are, is alive)
    return m


def test_a_regression_head_trained_on_batches_of_any_size_compiles():
    """One output per example (a regression or a binary classifier): the head's products with the
    batch are vector products, which IREE compiles with dynamic sizes only as a multiply and a sum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in (4, 6, 8, 5, 7, 9, 3, 12)]
    m = _trains_like_eager(model, lambda m, x, target: torch.nn.functional.mse_loss(m(x), target), batches,
                           atol=1e-5)
    assert not m["compile_failures"], m["compile_failures"]
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] >= 3 and m["built"] == 1, m["recompiles"]


def test_gradients_of_slices_compile_in_a_template():
    """The gradient of a slice (`slice_backward`, a `slice_scatter` into zeros) in a step of any length:
    of the last position's logits, of a slice of features, of rotary embeddings' even and odd features.
    torch's decomposition selected with an `index` that has no rule with dynamic sizes: each ran in
    torch and cut the template's cluster in pieces."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 6)

        def forward(self, x):
            h = self.inp(x)
            even, odd = h[..., ::2], h[..., 1::2]             # rotary embeddings' halves
            h = torch.stack((even * 0.8 - odd * 0.6, even * 0.6 + odd * 0.8), -1).flatten(-2)
            return self.out(torch.tanh(h))[:, -1, :4], h[:, 1:, 3:11]

    def loss_of(m, x, target):
        logits, feats = m(x)
        return torch.nn.functional.cross_entropy(logits, target) + feats.square().mean()

    torch.manual_seed(0)
    m = _trains_like_eager(Model(), loss_of, _sequences([(4, 6), (3, 8), (5, 7), (4, 10), (6, 5), (3, 9)], 4))
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] >= 2, m["recompiles"]
    assert not m["fallback_ops"] and not m["compile_failures"], (m["fallback_ops"], m["compile_failures"])


def test_group_norm_compiles_in_a_template():
    """GroupNorm over a sequence of any length: torch's decomposition takes `as_strided` views that read
    a whole value in order (reshapes), which had no rule with dynamic sizes and ran in torch."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.norm, self.out = torch.nn.Linear(8, 16), torch.nn.GroupNorm(4, 16), torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.norm(self.inp(x).transpose(1, 2)).transpose(1, 2).mean(1))

    torch.manual_seed(0)
    m = _trains_like_eager(Model(), lambda m, x, target: torch.nn.functional.cross_entropy(m(x), target),
                           _sequences([(4, 6), (3, 8), (5, 7), (4, 10), (6, 5)], 3))
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] >= 1, m["recompiles"]
    assert not m["fallback_ops"] and not m["compile_failures"], (m["fallback_ops"], m["compile_failures"])


def test_a_second_model_of_the_same_architecture_is_not_the_first_with_changed_sizes():
    """A sweep over widths in one process: the second model has the first one's ops with other sizes,
    which is not a dim that varies (it made the width dynamic, pinned it to the weights' size with a
    warning, and took the fast recorder away for the rest of the process)."""
    def train(width: int) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        ref = copy.deepcopy(model)
        pydisc.lazy(model)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
        pydisc.reset_metrics()
        for _ in range(4):
            x, y = torch.randn(8, width), torch.randint(0, 3, (8,))
            for m, o in ((model, opt), (ref, ref_opt)):
                torch.nn.functional.cross_entropy(m(x), y).backward()
                o.step()
                o.zero_grad()
            pydisc.mark_step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg=name)
        return pydisc.metrics()

    train(8)
    gc.collect()    # the first model's storages freed: the second's may take their addresses, and their ids
    m = train(4)
    # (its first step is recorded op by op: its input has other sizes than the step before's)
    assert not m["recompiles"] and m["dynamic_templates"] == 0 and m["fast_segments"] >= 3, m["recompiles"]
    assert not ENGINE.dynamic.flagged


def test_dims_one_model_made_dynamic_are_not_another_models():
    """Dims flagged dynamic, pins and templates are a model's: a model trained on batches of any size
    does not make another model's input #0 dynamic (it recorded that one's steps op by op, as a template
    no size needed), and it keeps its own template when it trains again."""
    def model_and_step(width: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        ref = copy.deepcopy(model)
        pydisc.lazy(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]

        def step(n: int) -> None:
            x, y = torch.randn(n, width), torch.randint(0, 3, (n,))
            for m, o in zip((model, ref), opts):
                torch.nn.functional.cross_entropy(m(x), pydisc.to_lazy(y) if m is model else y).backward()
                o.step()
                o.zero_grad()
            pydisc.mark_step()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
        return step

    varying, fixed = model_and_step(8), model_and_step(4)
    for n in (4, 6, 8, 5, 7):
        varying(n)
    assert _built() == 1
    pydisc.reset_metrics()
    for _ in range(4):
        fixed(8)
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 0 and not m["recompiles"] and m["fast_segments"] >= 3, m["recompiles"]
    pydisc.reset_metrics()
    for n in (9, 3, 11):
        varying(n)
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 0 and m["dynamic_matches"] == 3 and m["compiles"] == 0, m["recompiles"]


def test_size_one_gets_its_own_template():
    sizes = [(2, 8), (3, 8), (2, 9), (1, 8), (4, 8), (1, 5), (1, 12), (3, 3)]
    m = _train(sizes, mark=True)
    assert m["dynamic_templates"] <= 3, m["recompiles"]
    assert m["built"] >= 1


def test_static_mode_plans_per_shape(fresh):
    fresh.setattr(CONFIG, "dynamic", False)
    m = _train([(2, 8), (2, 9), (2, 10), (2, 9)])
    assert m["dynamic_templates"] == 0
    assert m["graph_cache_misses"] == 3
    assert m["graph_cache_hits"] == 1


def test_eager_tensor_that_pins_a_dynamic_dim_is_reported():
    """An eager (not lazy) target whose size varies is compared with the lazy logits in C++: the
    symbolic size gets pinned; pydisc says so and where, and stays correct."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    pydisc.lazy(lin)
    for n in (4, 6, 7, 9):
        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
        loss = torch.nn.functional.cross_entropy(lin(x), y)
        pydisc.mark_step()
        torch.testing.assert_close(loss.cpu(), torch.nn.functional.cross_entropy(ref(x), y))
    m = pydisc.metrics()
    pinned = [r for r in m["recompiles"] if "specialised" in r]
    assert pinned and "to_lazy" in pinned[0] and "test_dynamic_shapes.py" in pinned[0], m["recompiles"]


def _inference_at_sizes(net, reference, make_input, sizes, rtol, atol) -> dict:
    """Make `net` lazy, run it without grad at each batch size, compare with `reference`; the metrics."""
    pydisc.lazy(net)
    with torch.no_grad():
        for n in sizes:
            x = make_input(n)
            out = net(x)
            pydisc.mark_step()
            torch.testing.assert_close(out.cpu(), reference(x), rtol=rtol, atol=atol)
    return pydisc.metrics()


def _with_statistics(bn: torch.nn.BatchNorm2d) -> None:
    """Running statistics that are not the defaults."""
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)


def test_inference_with_varying_batch_matches_eager():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    m = _inference_at_sizes(net, copy.deepcopy(net), lambda n: torch.randn(n, 8), (5, 7, 9, 31, 2, 64),
                            rtol=1e-5, atol=1e-6)
    # 5: planned for its shape; 7: eager (batch is dynamic from now on); 9: template; 31, 2, 64: matched
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] == 3, m


def test_batch_norm_in_eval_mode_shares_one_template():
    """native_batch_norm is recorded as the op torch's decomposition picks in every mode, so the
    template recorded with a symbolic batch (where the decomposition applies) matches later steps."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    _with_statistics(net[1])
    net.eval()
    m = _inference_at_sizes(net, copy.deepcopy(net), lambda n: torch.randn(n, 3, 6, 6), (2, 3, 5, 7, 9, 11),
                            rtol=1e-5, atol=1e-5)
    # 2: planned for its shape; 3: eager (batch is dynamic from now on); 5: template; 7, 9, 11: matched
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] == 3, m


def test_cudnn_batch_norm_in_eval_mode_shares_one_template():
    """What F.batch_norm calls on CUDA, called here on the CPU: pydisc records cudnn_batch_norm as
    torch's decomposition of it, which is what a step with symbolic sizes records too."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x):
            b = self.bn
            return torch.ops.aten.cudnn_batch_norm(x, b.weight, b.bias, b.running_mean, b.running_var,
                                                   False, 0.1, 1e-5)[0].relu()

    torch.manual_seed(0)
    net = Net()
    _with_statistics(net.bn)
    net.eval()
    bn = copy.deepcopy(net.bn)
    reference = lambda x: torch.nn.functional.batch_norm(  # noqa: E731
        x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False).relu()
    m = _inference_at_sizes(net, reference, lambda n: torch.randn(n, 4, 3, 3), (2, 3, 5, 7, 9),
                            rtol=1e-5, atol=1e-5)
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] == 2, m


def test_mark_dynamic_rejects_bad_input():
    with pytest.raises(TypeError, match="before it is passed"):
        pydisc.mark_dynamic(pydisc.to_lazy(torch.ones(3)), 0)
    with pytest.raises(IndexError, match="out of range"):
        pydisc.mark_dynamic(torch.ones(3, 4), 2)


def test_reads_during_backward_of_a_symbolic_step():
    """A value read while autograd runs (a gradient hook, DDP's reducer) flushes part of a symbolic
    step; the rest of the step still records symbolically."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    pydisc.lazy(model)
    seen, ref_seen = [], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.sum().item()))
    for p in ref.parameters():
        p.register_post_accumulate_grad_hook(lambda p: ref_seen.append(p.grad.sum().item()))
    for n in (8, 6, 8, 5, 9, 12):
        x = torch.randn(n, 16)
        model(x).square().sum().backward()
        pydisc.mark_step()
        ref(x).square().sum().backward()
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(ref_seen), rtol=1e-5, atol=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad)
    # the symbolic steps' dispatch state ended with them (a step ended inside backward was restored by
    # autograd when its graph task ended, and every later op ran through the Python dispatcher)
    assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)


@pytest.mark.cuda
def test_cuda_lengths_and_batches_marked_dynamic():
    torch.backends.cuda.matmul.allow_tf32 = False
    sizes = [(3, 9), (2, 14), (4, 6), (3, 22), (2, 9), (5, 11), (2, 40), (7, 3)]
    m = _train(sizes, mark=True, device="cuda")
    assert m["dynamic_matches"] == len(sizes) - 4, m["recompiles"]
    assert m["built"] == 1


def test_a_template_never_serves_another_dtype(fresh):
    """The same ops on float64 inputs must not run the float32 template."""
    fresh.setattr(CONFIG, "dynamic", True)
    for dtype in (torch.float32, torch.float64):
        for n in (3, 5, 7, 9):
            x = torch.randn(n, 4, dtype=dtype)
            pydisc.mark_dynamic(x, 0)
            y = (pydisc.to_lazy(x) * 2).exp().sum(0)
            pydisc.mark_step()
            assert y.dtype == dtype
            torch.testing.assert_close(y.cpu(), (x * 2).exp().sum(0))


class Growing(torch.nn.Module):
    """A step that appends to a state the previous step made (a KV cache): its length is a dim of a
    tensor made by pydisc, not of a step input; the Python code reads that length."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        cache = torch.cat([cache, self.proj(x)], 0)
        position = torch.arange(1) + cache.shape[0]        # Python arithmetic on the length
        return cache, (cache.softmax(0) * position).sum(0)


def test_a_growing_tensor_made_by_earlier_steps_is_a_dynamic_dim():
    torch.manual_seed(0)
    model = Growing()
    lazy = pydisc.lazy(copy.deepcopy(model))
    xs = [torch.randn(1, 4) for _ in range(12)]
    cache_e = cache_l = torch.zeros(1, 4)
    with torch.no_grad():
        for x in xs:
            cache_e, want = model(x, cache_e)
            cache_l, got = lazy(x, cache_l)
            pydisc.mark_step()
            torch.testing.assert_close(got.cpu(), want)
            torch.testing.assert_close(cache_l.cpu(), cache_e)
    m = pydisc.metrics()
    assert m["dynamic_templates"] == 1 and m["dynamic_matches"] >= 8, m["recompiles"]
    assert any("a tensor an earlier step made" in r for r in m["recompiles"]), m["recompiles"]


def test_sizes_of_a_symbolic_step_are_numbers_afterwards():
    """Tensors the symbolically recorded step made hold its ShapeEnv's sizes until it ends; then they
    are numbers again (Python code computing with `s0 + 1` of a finished step got garbage)."""
    torch.manual_seed(0)
    model = Growing()
    lazy = pydisc.lazy(copy.deepcopy(model))
    cache = torch.zeros(1, 4)
    with torch.no_grad():
        for _ in range(6):
            cache, _ = lazy(torch.randn(1, 4), cache)
            pydisc.mark_step()
            assert all(type(s) is int for s in cache.shape), cache.shape
    assert pydisc.metrics()["dynamic_templates"] == 1


def test_sizes_that_were_multiples_of_8_get_a_template_that_assumes_it(fresh):
    """`PYDISC_SIZE_MULTIPLES`: a template recorded when every length so far was a multiple of 8 tells
    IREE so (`util.assume.int`, with which its GPU code is vectorized) and serves only such lengths, by a
    guard. A length that is not one gets a template that assumes nothing, at once; its steps never run
    the first template's code, which is only right for multiples of 8."""
    fresh.setattr(CONFIG, "size_multiples", "all")
    texts = []
    compile_module = pydisc.exec.compile_module

    def compiling(text, device, *args):
        texts.append(text)
        return compile_module(text, device, *args)

    fresh.setattr(pydisc.exec, "compile_module", compiling)
    lengths = [8, 16, 24, 16, 12, 20, 12, 32, 20]
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    pydisc.lazy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    served = []         # per step: the template whose plan ran it (None: eagerly, or recorded as one)
    for T in lengths:
        before = [t.steps for t in ENGINE.dynamic.templates]
        idx = torch.randint(0, 11, (2, T), generator=g)
        tgt = torch.randint(0, 11, (2, T), generator=g)
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        pydisc.mark_step()
        ref(idx, tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5, msg="%s after length %d" % (name, T))
        after = [t.steps for t in ENGINE.dynamic.templates]
        served.append(next((k for k, n in enumerate(before) if after[k] > n), None))
    aligned, unaligned = ENGINE.dynamic.templates
    assert list(aligned.session.multiples.values()) == [8] and unaligned.session.multiples == {}
    # 12 matches no template and runs eagerly, 20 is recorded as the second template; from then on the
    # multiples of 8 run the first template's code and the other lengths the second's
    assert served[4:] == [None, None, 1, 0, 1], served
    assert any("util.assume.int" in t and "udiv = 8" in t for t in texts)
    assert any("is not a multiple of 8" in r for r in pydisc.metrics()["recompiles"])
