"""Graphs traced with symbolic sizes: emitted once with dynamic dims, planned with `plan_graph`, run at
several sizes against eager torch, without compiling again."""
from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import pydisc.exec
from conftest import check, trace
from pydisc.config import CONFIG
from pydisc.frontend.decompositions import DECOMPOSITIONS
from pydisc.frontend.emit import TensorSpec, emit_cluster, unsupported_reason
from pydisc.frontend.lowering import reductions
from pydisc.frontend.lowering.size_exprs import known_multiple, reshape_groups
from pydisc.frontend.lowering.values import Value
from pydisc.metrics import METRICS
from pydisc.driver.plan import StepPlan, plan_graph
from pydisc.exec.clusters import CompiledCluster

aten = torch.ops.aten
CPU = torch.device("cpu")


# ---- helpers --------------------------------------------------------------------------------------
def fake_inputs(args: Sequence[torch.Tensor], dynamic: dict[int, Sequence[int]]) -> tuple[list[torch.Tensor], FakeTensorMode]:
    """Fake copies of `args` in a fresh ShapeEnv; dims `dynamic[i]` of argument i get their own symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
    fakes = []
    for i, arg in enumerate(args):
        dims = dynamic.get(i, ())
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(arg.dim())]
        )
        fakes.append(mode.from_tensor(arg, source=LocalSource(f"arg{i}"), symbolic_context=context))
    return fakes, mode


def symbolic_trace(fn: Callable, args: Sequence[torch.Tensor], dynamic: dict[int, Sequence[int]]) -> torch.fx.GraphModule:
    """The functional core-ATen graph of `fn` with the `dynamic` dims symbolic, the way pydisc's
    symbolic recording produces it."""
    fakes, _ = fake_inputs(args, dynamic)
    with enable_python_dispatcher():  # C++ composites (dropout, matmul) would specialise or fail
        return make_fx(
            torch.func.functionalize(fn, remove="mutations"), decomposition_table=DECOMPOSITIONS, tracing_mode="symbolic"
        )(*fakes)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of `compile_module` (what plan_graph compiles), by text."""
    calls: list[str] = []
    original = pydisc.exec.compile_module

    def counting(text: str, device: torch.device):  # noqa: ANN202
        calls.append(text)
        return original(text, device)

    monkeypatch.setattr(pydisc.exec, "compile_module", counting)
    return calls


def _flat(values: object) -> list[object]:
    return list(values) if isinstance(values, (list, tuple)) else [values]


def check_sizes(
    fn: Callable, args: Sequence[torch.Tensor], dynamic: dict[int, Sequence[int]],
    variants: Sequence[Sequence[torch.Tensor]], compiles: list[str], eager: Sequence[str] = (),
    rtol: float = 1e-4, atol: float = 1e-5, seed: int | None = None,
) -> StepPlan:
    """Plan `fn` traced with symbolic sizes once, then run the plan at every variant's sizes and compare
    with eager `fn`; nothing compiles after planning, and only `eager` ops run eagerly."""
    gm = symbolic_trace(fn, args, dynamic)
    plan = plan_graph(gm, CPU, [], 0)
    assert plan.clusters >= 1
    assert sorted(plan.eager_ops) == sorted(eager), plan.eager_ops
    assert len(compiles) == plan.clusters
    assert any("?x" in text for text in compiles)
    sizes = set()
    for inputs in variants:
        if seed is not None:
            torch.manual_seed(seed)
        got = _flat(plan.runner(*inputs))
        if plan.value_check:            # its last result: whether an index was out of range (none is)
            *got, refused = got
            assert not refused
        if seed is not None:
            torch.manual_seed(seed)
        want = _flat(fn(*inputs))
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"output {i}: {m}")
        sizes.add(tuple(tuple(t.shape) for t in inputs))
    assert len(sizes) == len(variants) >= 3
    assert len(compiles) == plan.clusters  # one compile served every size
    return plan


def _compiled(plan: StepPlan) -> list[CompiledCluster]:
    return [m for m in plan.runner.modules() if isinstance(m, CompiledCluster)]


# ---- specs and the builder ----------------------------------------------------------------------
def test_spec_prints_dynamic_dims() -> None:
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    assert str(TensorSpec((s0, 8), torch.float32)) == "tensor<?x8xf32>"
    assert str(TensorSpec((s0 * s1, sympy.Integer(3)), torch.int64)) == "tensor<?x3xi64>"
    spec = TensorSpec((sympy.Integer(4), 8), torch.float32)
    assert spec.shape == (4, 8) and type(spec.shape[0]) is int and spec.is_static
    assert not TensorSpec((s0, 8), torch.float32).is_static


def test_reshape_groups() -> None:
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    assert reshape_groups((s0 * s1, 8), (s0, s1, 2, 4)) == [([0], [0, 1]), ([1], [2, 3])]
    assert reshape_groups((s0, s1, 1), (s0 * s1,)) == [([0, 1, 2], [0])]
    assert reshape_groups((2 * s0, s1, 4), (s0, 2, s1, 4)) == [([0], [0, 1]), ([1], [2]), ([2], [3])]
    assert reshape_groups((s0, 4), (s0, 1, 4)) == [([0], [0]), ([1], [1, 2])]


def test_static_graph_emits_static_types() -> None:
    cluster = emit_cluster(trace(lambda x: (x * 2).sum(1, keepdim=True) + x, torch.randn(4, 8)))
    assert "tensor<4x8xf32>" in cluster.text and "?" not in cluster.text
    assert "tensor.dim" not in cluster.text and "dynamic" not in cluster.text
    assert not cluster.dynamic


def test_dynamic_emission_reads_sizes_from_arguments() -> None:
    gm = symbolic_trace(lambda x, w: (x @ w).reshape(-1) * x.shape[0], [torch.randn(5, 8), torch.randn(8, 4)], {0: (0,)})
    cluster = emit_cluster(gm)
    assert "%arg0: tensor<?x8xf32>" in cluster.text and "%arg1: tensor<8x4xf32>" in cluster.text
    assert "tensor.dim %arg0" in cluster.text
    assert "tensor.collapse_shape" in cluster.text and "stablehlo.dynamic_reshape" not in cluster.text
    assert cluster.text.count("tensor.dim") == 1  # one read per symbol, reused
    assert cluster.outputs[0].rank == 1 and str(cluster.outputs[0]) == "tensor<?xf32>"
    assert cluster.dynamic


# IREE 3.13 cannot compile a dot_general with dynamic sizes whose contracting dims, or (without batch
# dims) whose free dims on one side, are none or all 1 (pydisc emits those as a broadcast multiply and a
# sum); with batch dims and a free dim of 1 (decode attention) it compiles the product
VECTOR_PRODUCTS = {
    "linear_one_output": (lambda x, w: x @ w.t(), [torch.randn(5, 3), torch.randn(1, 3)], (5, 2, 9)),
    "row_times_matrix": (lambda x, w: x.sum(1, keepdim=True).t() @ x * w, [torch.randn(5, 3), torch.randn(1, 3)],
                         (5, 2, 9)),
    "outer_product": (lambda x, w: x[:, :1] @ w[:1], [torch.randn(5, 3), torch.randn(1, 4)], (5, 2, 9)),
    "matrix_vector": (lambda x, w: torch.mv(x, w[0]), [torch.randn(5, 3), torch.randn(1, 3)], (5, 2, 9)),
    "vector_dot": (lambda x, w: torch.dot(x[:, 0], x[:, 1]) * w, [torch.randn(5, 3), torch.randn(1, 3)], (5, 2, 9)),
    "one_output_grad": (lambda x, w: x.t() @ (x @ w.t()), [torch.randn(5, 3), torch.randn(1, 3)], (5, 2, 9)),
    "decode_attention": (lambda x, w: torch.bmm(w.expand(2, 1, 3), x.t().expand(2, 3, -1)),
                         [torch.randn(5, 3), torch.randn(1, 3)], (5, 2, 9)),
}


@pytest.mark.parametrize("name", sorted(VECTOR_PRODUCTS))
def test_products_of_vectors_with_dynamic_sizes_compile(name: str, compiles: list[str]) -> None:
    fn, (x, w), sizes = VECTOR_PRODUCTS[name]
    check_sizes(fn, [x, w], {0: (0,)}, [[torch.randn(n, x.shape[1]), w] for n in sizes], compiles)


# ---- whole training steps -------------------------------------------------------------------------
def _mlp_step(x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
              b2: torch.Tensor) -> list[torch.Tensor]:
    def loss_fn(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        h = F.relu(x @ w1.t() + b1)
        return F.cross_entropy(h @ w2.t() + b2, y)

    grads, loss = torch.func.grad_and_value(loss_fn, argnums=(0, 1, 2, 3))(w1, b1, w2, b2)
    return [loss, *grads]


def test_mlp_forward_backward_dynamic_batch(compiles: list[str]) -> None:
    params = [torch.randn(16, 8), torch.randn(16), torch.randn(3, 16), torch.randn(3)]
    batch = lambda n: [torch.randn(n, 8), torch.randint(0, 3, (n,)), *params]  # noqa: E731
    check_sizes(_mlp_step, batch(5), {0: (0,), 1: (0,)}, [batch(n) for n in (5, 2, 17)], compiles)


def _block_step(idx: torch.Tensor, targets: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor, ln_w: torch.Tensor,
                ln_b: torch.Tensor, qkv_w: torch.Tensor, proj_w: torch.Tensor, head_w: torch.Tensor) -> list[torch.Tensor]:
    """A GPT block: embeddings, layer norm, causal attention with (B*H, T, D) reshapes, gelu MLP
    projection, cross-entropy; loss and every parameter gradient."""

    def loss_fn(wte: torch.Tensor, wpe: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, qkv_w: torch.Tensor,
                proj_w: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        C, H = wte.shape[1], 2
        D = C // H
        x = F.embedding(idx, wte) + F.embedding(torch.arange(T), wpe)
        h = F.layer_norm(x, (C,), ln_w, ln_b)
        q, k, v = (h @ qkv_w.t()).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D) for t in (q, k, v))
        att = (q @ k.transpose(1, 2)) * D ** -0.5
        mask = torch.arange(T)[None, :] > torch.arange(T)[:, None]
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).view(B, H, T, D).transpose(1, 2).reshape(B, T, C)
        x = x + F.gelu(y @ proj_w.t())
        logits = x @ head_w.t()
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))

    grads, loss = torch.func.grad_and_value(loss_fn, argnums=tuple(range(7)))(wte, wpe, ln_w, ln_b, qkv_w, proj_w, head_w)
    return [loss, *grads]


def test_transformer_block_dynamic_batch_and_length(compiles: list[str]) -> None:
    C, V, P = 8, 11, 16
    params = [torch.randn(V, C), torch.randn(P, C), torch.randn(C), torch.randn(C), torch.randn(3 * C, C) * 0.3,
              torch.randn(C, C) * 0.3, torch.randn(V, C)]

    def batch(B: int, T: int) -> list[torch.Tensor]:
        return [torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)), *params]

    plan = check_sizes(_block_step, batch(3, 5), {0: (0, 1), 1: (0, 1)},
                       [batch(3, 5), batch(2, 7), batch(4, 3), batch(2, 16)], compiles)
    texts = "\n".join(compiles)
    for op in ("dynamic_broadcast_in_dim", "tensor.expand_shape", "tensor.collapse_shape", "dynamic_iota",
               "stablehlo.gather", "stablehlo.scatter", "dot_general"):
        assert op in texts, op
    assert plan.clusters == 1


def _cnn_step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bn_w: torch.Tensor,
              bn_b: torch.Tensor, fc: torch.Tensor) -> list[torch.Tensor]:
    def loss_fn(w: torch.Tensor, b: torch.Tensor, bn_w: torch.Tensor, bn_b: torch.Tensor, fc: torch.Tensor) -> torch.Tensor:
        h = F.conv2d(x, w, b, padding=1)
        h = F.batch_norm(h, None, None, bn_w, bn_b, training=True)
        h = F.max_pool2d(F.relu(h), 2)
        h = F.avg_pool2d(h, 2).flatten(1)
        return F.cross_entropy(h @ fc.t(), y)

    grads, loss = torch.func.grad_and_value(loss_fn, argnums=(0, 1, 2, 3, 4))(w, b, bn_w, bn_b, fc)
    return [loss, *grads]


def test_cnn_forward_backward_dynamic_batch(compiles: list[str]) -> None:
    params = [torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(4), torch.randn(4), torch.randn(4, 16)]
    batch = lambda n: [torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,)), *params]  # noqa: E731
    check_sizes(_cnn_step, batch(2), {0: (0,), 1: (0,)}, [batch(n) for n in (2, 5, 3)], compiles)


_POOLS = [((2, 2), (2, 2), (0, 0), True, None), ((3, 3), (2, 2), (1, 1), False, None),
          ((3, 2), (1, 2), (1, 0), True, None), ((2, 2), (1, 1), (1, 1), True, 3)]


def _pools(x: torch.Tensor, grad_source: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for kernel, stride, padding, include, divisor in _POOLS:
        y = aten.avg_pool2d(x, kernel, stride, padding, False, include, divisor)
        grad = grad_source[..., : y.shape[-2], : y.shape[-1]]
        outs += [y, aten.avg_pool2d_backward(grad, x, kernel, stride, padding, False, include, divisor)]
    return outs


def _max_pools(x: torch.Tensor, grad_source: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for kernel, stride, padding, dilation, ceil in [((2, 2), (2, 2), (0, 0), (1, 1), False),
                                                     ((3, 3), (1, 2), (1, 1), (1, 1), False),
                                                     ((2, 3), (2, 1), (1, 1), (2, 1), True)]:
        y, index = aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil)
        grad = grad_source[..., : y.shape[-2], : y.shape[-1]]
        outs += [y, index, aten.max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation, ceil, index)]
    return outs


def test_max_pool_backward_dynamic_batch(compiles: list[str]) -> None:
    variants = [[torch.randn(n, 2, 7, 6), torch.randn(n, 2, 8, 8)] for n in (2, 5, 3)]
    check_sizes(_max_pools, variants[0], {0: (0,), 1: (0,)}, variants, compiles)


def test_avg_pool_forward_and_backward_static() -> None:
    check(_pools, torch.randn(2, 3, 7, 6), torch.randn(2, 3, 8, 8))


def test_avg_pool_forward_and_backward_dynamic_batch(compiles: list[str]) -> None:
    variants = [[torch.randn(n, 3, 7, 6), torch.randn(n, 3, 8, 8)] for n in (2, 5, 3)]
    check_sizes(_pools, variants[0], {0: (0,), 1: (0,)}, variants, compiles)


# ---- op families ----------------------------------------------------------------------------------
def test_arange_and_mask(compiles: list[str]) -> None:
    def fn(scores: torch.Tensor) -> list[torch.Tensor]:
        T = scores.shape[-1]
        causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        positions = torch.arange(2, 2 + 3 * T, 3, dtype=torch.float32)
        masked = scores.masked_fill(~causal, -1e9)
        return [masked.softmax(-1), positions, torch.where(causal, scores, positions), torch.full((T, 2), 7.0),
                torch.zeros_like(scores[0]) + T]

    variants = [[torch.randn(n, n)] for n in (4, 2, 9)]
    check_sizes(fn, variants[0], {0: (0, 1)}, variants, compiles)


def test_reductions(compiles: list[str]) -> None:
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [x.sum(), x.sum(0), x.mean(1, keepdim=True), x.amax(-1), x.var(0), x.var(1, correction=0),
                x.argmax(1), x.max(0).values, x.max(0).indices, torch.logsumexp(x, 1), x.log_softmax(0),
                x.norm(dim=1), x.std()]

    variants = [[torch.randn(n, m)] for n, m in ((5, 6), (3, 2), (8, 9))]
    check_sizes(fn, variants[0], {0: (0, 1)}, variants, compiles)


def test_slicing_and_joining(compiles: list[str]) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        T = y.shape[1]
        head, tail = x[:, :T], x[:, T:]
        parts = x.split(2, dim=0)
        return [head * y, tail.sum(1), x[:, 1:-1], x[:, -1], x[1], x[::2], torch.cat([x, y], 1),
                torch.cat([x, x], 0), parts[0], x.unsqueeze(1).squeeze(1).t().contiguous(), x.flip(0),
                x.expand(2, -1, -1) * 2, x[:, x.shape[1] - 2:], x.select(1, x.shape[1] - 1), x[:, T // 2::2]]

    def pair(n: int, m: int, t: int) -> list[torch.Tensor]:
        return [torch.randn(n, m), torch.randn(n, t)]

    check_sizes(fn, pair(6, 7, 3), {0: (1,), 1: (1,)}, [pair(6, 7, 3), pair(6, 5, 2), pair(6, 11, 4)], compiles)


def test_padding_of_dynamic_dims(compiles: list[str]) -> None:
    """HF's causal-LM loss shifts the labels with `F.pad(labels, (0, 1), value=-100)`."""
    def fn(x: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        return [F.pad(x, (1, 2, 0, 1), value=0.5), F.pad(labels, (0, 1), value=-100)[:, 1:], F.pad(x, (-1, 1)),
                F.pad(x, (0, 0, 1, -1)), F.pad(x, (-1, -1, 2, 0), value=3.0)]
    # the crop of a dynamic dim (pad -1; the gradient of a pad along the length, MobileBERT's trigram
    # embedding), which IREE cannot legalize as a pad, is a slice

    def pair(n: int, t: int) -> list[torch.Tensor]:
        return [torch.randn(n, t), torch.randint(0, 9, (n, t))]

    check_sizes(fn, pair(3, 5), {0: (0, 1), 1: (0, 1)}, [pair(3, 5), pair(2, 7), pair(4, 3)], compiles)


def test_embedding_and_its_backward(compiles: list[str]) -> None:
    def fn(idx: torch.Tensor, table: torch.Tensor) -> list[torch.Tensor]:
        out, vjp = torch.func.vjp(lambda t: F.embedding(idx, t), table)
        return [out, vjp(torch.ones_like(out) * idx.unsqueeze(-1))[0], table[idx[:, 0]]]

    table = torch.randn(10, 3)
    variants = [[torch.randint(0, 10, (n, m)), table] for n, m in ((4, 3), (2, 5), (7, 2))]
    check_sizes(fn, variants[0], {0: (0, 1)}, variants, compiles)


def test_gather_and_scatter(compiles: list[str]) -> None:
    def fn(x: torch.Tensor, one: torch.Tensor, many: torch.Tensor) -> list[torch.Tensor]:
        return [x.gather(1, one), x.gather(1, many), x.scatter(1, one, -1.0), x.scatter_add(1, one, x[:, :1] * 3),
                x.scatter_add(1, many, torch.ones_like(many, dtype=x.dtype)), torch.zeros_like(x).scatter(1, many[:, :1], 2.0)]

    def sample(n: int) -> list[torch.Tensor]:
        return [torch.randn(n, 5), torch.randint(0, 5, (n, 1)), torch.randint(0, 5, (n, 3))]

    check_sizes(fn, sample(4), {0: (0,), 1: (0,), 2: (0,)}, [sample(n) for n in (4, 2, 9)], compiles)


def test_size_arithmetic_as_values(compiles: list[str]) -> None:
    """Sizes used as numbers: a mean's count, n / 4, n ** -0.5, integer products."""

    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        n = x.shape[0] * x.shape[1]
        return [x * (1.0 / (n / 4)), x * x.shape[0] ** -0.5, x + n, x.new_ones(x.shape[0] // 2 + 1) * (n % 3)]

    variants = [[torch.randn(n, 3)] for n in (5, 2, 8)]
    check_sizes(fn, variants[0], {0: (0,)}, variants, compiles)


# ---- SymInt inputs and outputs of a cluster, and what falls back ----------------------------------
def _graph_with_size_input() -> tuple[torch.fx.GraphModule, torch.Tensor, torch.SymInt]:
    """x (s0 x 4) and n = size 0 of x as a separate SymInt input; returns [x * 3n, 3n]."""
    (x,), mode = fake_inputs([torch.randn(5, 4)], {0: (0,)})
    n = x.shape[0]
    graph = torch.fx.Graph()
    px, pn = graph.placeholder("x"), graph.placeholder("n")
    px.meta["val"], pn.meta["val"] = x, n
    times = graph.call_function(operator.mul, (pn, 3))
    times.meta["val"] = n * 3
    scaled = graph.call_function(aten.mul.Tensor, (px, times))
    with mode:
        scaled.meta["val"] = x * (n * 3)
    graph.output([scaled, times])
    return torch.fx.GraphModule(torch.nn.Module(), graph), x, n


def test_size_inputs_are_dropped_and_size_outputs_computed_on_the_host(compiles: list[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CONFIG, "check_every", 1)  # PYDISC_CHECK=1: each call also compared with eager
    checks, mismatches = METRICS.numerics_checks, len(METRICS.numerics_mismatches)
    gm, _, _ = _graph_with_size_input()
    cluster = emit_cluster(gm)
    assert cluster.arguments == (0,) and len(cluster.inputs) == 1  # n is not an argument
    assert cluster.layout[0] == ("result", 0) and cluster.layout[1][0] == "size"
    plan = plan_graph(gm, CPU, [], 0)
    assert plan.clusters == 1 and not plan.eager_ops
    (compiled,) = _compiled(plan)
    assert "sympy" not in compiled.prepare.source
    for rows in (5, 2, 7):
        x = torch.randn(rows, 4)
        scaled, times = plan.runner(x, rows)
        assert times == 3 * rows and type(times) is int
        torch.testing.assert_close(scaled, x * 3 * rows)
    assert len(compiles) == 1
    assert METRICS.numerics_checks == checks + 3 and len(METRICS.numerics_mismatches) == mismatches


def test_size_no_tensor_carries_is_an_index_argument(compiles: list[str]) -> None:
    """A size that no tensor input of the cluster carries (here `n`) is passed as an `index` argument."""
    (x,), mode = fake_inputs([torch.randn(5, 4)], {0: (0,)})
    env = mode.shape_env
    n = env.create_symintnode(env.create_symbol(6, LocalSource("n")), hint=6, source=LocalSource("n"))
    graph = torch.fx.Graph()
    px, pn = graph.placeholder("x"), graph.placeholder("n")
    px.meta["val"], pn.meta["val"] = x, n
    filled = graph.call_function(aten.full.default, ([pn, 4], 2.0), {"dtype": torch.float32})
    with mode:
        filled.meta["val"] = torch.full((n, 4), 2.0)
    graph.output([filled])
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    text = emit_cluster(gm).text
    assert "@main(%arg0: tensor<?x4xf32>, %arg1: index," in text   # n, after the tensor's own argument
    assert "tensor.from_elements %arg1, " in text                   # the rows of the filled result
    plan = plan_graph(gm, CPU, [], 0)
    assert plan.clusters == 1 and not plan.eager_ops
    for rows in (6, 3, 11):
        (out,) = _flat(plan.runner(torch.randn(3, 4), rows))
        torch.testing.assert_close(out, torch.full((rows, 4), 2.0))
    assert len(compiles) == 1


def test_product_of_sizes_viewed_apart(compiles: list[str]) -> None:
    """A cluster input of (s0*s1, 8) rows, made by an eager op, viewed back as (s0, s1, 8): s0 and s1
    reach the cluster as size inputs."""
    def fn(x):
        flat = torch.sort(x.reshape(-1, 8), dim=-1).values    # sort stays eager with dynamic dims
        return (flat.view(x.shape[0], x.shape[1], 8) * 2).sum(1)
    check_sizes(fn, [torch.randn(3, 5, 8)], {0: (0, 1)},
                [[torch.randn(3, 5, 8)], [torch.randn(2, 7, 8)], [torch.randn(6, 2, 8)]], compiles,
                eager=["aten.sort.default"])   # the lone view feeding sort is metadata, not a fallback


def test_rules_without_dynamic_support_are_unsupported_not_failures() -> None:
    gm = symbolic_trace(lambda x: [torch.sort(x, 1).values, x + 1], [torch.randn(5, 4)], {0: (0,)})
    reasons = {str(n.target): unsupported_reason(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert "dynamic shapes are not supported" in reasons["aten.sort.default"]
    assert reasons["aten.add.Tensor"] is None
    negative = symbolic_trace(lambda x: x[:, x.shape[1] - 10:] * 2, [torch.randn(4, 6)], {0: (1,)})
    node = next(n for n in negative.graph.nodes if n.target is aten.slice.Tensor)
    assert "may be negative" in unsupported_reason(node)
    conv = symbolic_trace(lambda x, w: F.conv2d(x, w), [torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)], {0: (0, 2)})
    node = next(n for n in conv.graph.nodes if n.target is aten.convolution.default)
    assert "other than the batch" in unsupported_reason(node)


def test_size_nodes_are_not_fallbacks(compiles: list[str]) -> None:
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        y = torch.sort(x * 2, dim=1).values  # stays eager
        return [y.reshape(x.shape[0] * x.shape[1]) + 1, y[:, : x.shape[1] // 2].exp()]

    variants = [[torch.randn(n, 4)] for n in (5, 3, 6)]
    plan = check_sizes(fn, variants[0], {0: (0,)}, variants, compiles, eager=["aten.sort.default"])
    assert not any("sym" in op or "built-in" in op for op in plan.eager_ops)


def test_dropout_runs_eagerly_between_dynamic_clusters(compiles: list[str]) -> None:
    """Random ops stay eager (torch's RNG); their sizes come from the symbolic graph at run time."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        h = aten.native_dropout(x @ w, 0.5, True)[0]
        return [h.relu().sum(1), h * 2]

    w = torch.randn(8, 4)
    variants = [[torch.randn(n, 8), w] for n in (5, 3, 9)]
    check_sizes(fn, variants[0], {0: (0,)}, variants, compiles, eager=["aten.native_dropout.default"], seed=3)


def test_output_sizing_costs_microseconds(compiles: list[str]) -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        h = x @ w
        return [torch.relu(h + b), h.sum(1), h.reshape(-1)]

    args = [torch.randn(5, 8), torch.randn(8, 4), torch.randn(4)]
    plan = plan_graph(symbolic_trace(fn, args, {0: (0,)}), CPU, [], 0)
    (compiled,) = _compiled(plan)
    prepare = compiled.prepare
    assert prepare is not None and "sympy" not in prepare.source
    seen: list = []
    compiled.prepare = lambda inputs: seen.append(inputs) or prepare(inputs)  # type: ignore[method-assign]
    x = torch.randn(7, 8)
    for got, want in zip(_flat(plan.runner(x, *args[1:])), fn(x, *args[1:]), strict=True):
        torch.testing.assert_close(got, want)
    (inputs,) = seen
    _, outs, _ = prepare(inputs)
    assert [tuple(o.shape) for o in outs] == [(7, 4), (7,), (28,)]
    start = time.perf_counter()
    for _ in range(2000):
        prepare(inputs)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 100e-6, per_call  # typically a few us: dim reads and one torch.empty per output


def test_static_outputs_keep_the_static_path(compiles: list[str]) -> None:
    """A cluster with dynamic inputs but static outputs (a training step's loss and gradients) runs
    like a static one: no per-call sizing."""
    args = [torch.randn(5, 8), torch.randint(0, 3, (5,)), torch.randn(16, 8), torch.randn(16), torch.randn(3, 16),
            torch.randn(3)]
    (compiled,) = _compiled(plan_graph(symbolic_trace(_mlp_step, args, {0: (0,), 1: (0,)}), CPU, [], 0))
    assert compiled.prepare is None


def test_reductions_over_dynamic_token_dims_split_in_two(compiles: list[str]) -> None:
    # a bias gradient over the tokens of variable-length batches ([32 * s0, H] -> [H]) was one GPU thread
    # per result looping over every token; split by a power of two of the size's constant factor
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])
        return [x.sum((0, 1)), flat.sum(0), flat.amax(0), (flat * 2).mean(0), x.sum(), flat.amin()]

    variants = [[torch.randn(32, s, 24)] for s in (5, 2, 9)]
    check_sizes(fn, variants[0], {0: (1,)}, variants, compiles, rtol=1e-4, atol=1e-4)
    text = "\n".join(compiles)
    assert text.count('"stablehlo.reduce"') >= 2 * 6, text.count('"stablehlo.reduce"')

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)

    def split(shape, dims):
        return reductions._split(Value("%x", TensorSpec(shape, torch.float32)), dims)

    assert split((32 * s0, 768), [0]) == (s0, 32, (768,))
    assert split((32, s0, 768), [0, 1]) == (s0, 32, (768,))
    assert split((s0, 8 * s1), [0, 1]) == (s0 * s1, 8, ())
    assert split((s0, 768), [0]) is None                       # no constant factor to split by
    assert split((s0 + 1, 768), [0]) is None
    assert split((32, s0), [1]) is None                        # an inner reduction is parallel already


def test_split_reduction_of_an_input_that_carries_only_the_product(compiles: list[str]) -> None:
    # the cluster after dropout (run by torch) gets [32 * s0, 16] and no tensor with s0 alone: the split
    # reads s0 as that dim / 32 rather than failing to lower (the cluster would run eagerly)
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        h = aten.native_dropout(x.reshape(-1, 16) * 2, 0.5, True)[0]
        return [h.sum(0), h.amax(0) + 1]

    variants = [[torch.randn(32, s, 16)] for s in (5, 3, 9)]
    plan = check_sizes(fn, variants[0], {0: (1,)}, variants, compiles, eager=["aten.native_dropout.default"], seed=3)
    assert plan.clusters == 2


def test_a_size_read_from_an_input_dim_that_is_it_plus_a_constant(compiles: list[str]) -> None:
    # HF generate() on CUDA: a cluster gets the attention mask one column longer, [2, s + 1], made by an
    # op torch runs, and takes its last column: the slice starts at s, which the cluster reads as that
    # dim - 1 rather than failing to lower (its ops ran eagerly)
    def fn(m: torch.Tensor) -> torch.Tensor:
        longer = torch.sort(torch.cat([m, m[:, :1]], 1), dim=-1).values     # sort stays eager
        return longer[:, -1:] * 2 + longer[:, 1:].sum(1, keepdim=True)

    variants = [[torch.randn(2, s)] for s in (6, 3, 9)]
    check_sizes(fn, variants[0], {0: (1,)}, variants, compiles, eager=["aten.sort.default"])

    # ... and from [2, 2s + 1]: s is (dim - 1) // 2
    def twice(m: torch.Tensor) -> torch.Tensor:
        longer = torch.sort(torch.cat([m, m, m[:, :1]], 1), dim=-1).values
        return longer[:, -1:] * 2 + longer[:, 1:].sum(1, keepdim=True)

    compiles.clear()
    check_sizes(twice, variants[0], {0: (1,)}, variants, compiles, eager=["aten.sort.default"])


def test_concatenation_with_an_empty_piece(compiles: list[str]) -> None:
    # partial rotary embeddings that cover the whole head (Phi-3): `cat((rotated, x[..., 8:]), -1)` with an
    # empty pass-through; IREE's CPU code failed on the empty piece of a dynamic concatenation ("offset 3
    # is out-of-bounds") and the whole step ran eagerly
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat((x[..., :8] * 2, x[..., 8:]), dim=-1) + 1, torch.cat((x[:, :0], x), dim=1)]

    variants = [[torch.randn(2, n, 8)] for n in (5, 3, 9)]
    check_sizes(fn, variants[0], {0: (1,)}, variants, compiles)


def test_what_a_size_is_known_to_be_a_multiple_of():
    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    assert known_multiple(32 * s0, {}) == 32
    assert known_multiple(s0 * s1, {s0: 8}) == 8
    assert known_multiple(24 * s0 * s1, {s0: 8, s1: 8}) == 24 * 64
    assert known_multiple(s0 + 8, {s0: 8}) == 8
    assert known_multiple(s0 + 4, {s0: 8}) == 4
    assert known_multiple(s0 ** 2, {s0: 8}) == 64
    assert known_multiple(s0 + 1, {s0: 8}) == 1
    assert known_multiple(s1, {s0: 8}) == 1
    assert known_multiple(7, {}) == 7


def test_sizes_are_told_to_iree_only_for_a_template_that_guards_them():
    """emit_cluster's `multiples` (a template's guarded multiples): each dim read is declared a multiple
    (`util.assume.int`) where one is known; None (PYDISC_SIZE_MULTIPLES off) leaves the text as it was.
    The module runs right at sizes that keep the promise."""
    fn = lambda x, b: F.gelu(x * 2 + b)  # noqa: E731
    gm = symbolic_trace(fn, (torch.randn(8, 33), torch.randn(33)), {0: (0,)})
    symbol = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0].node.expr
    assert "util.assume.int" not in emit_cluster(gm).text
    assert "util.assume.int" not in emit_cluster(gm, multiples={}).text    # s0 alone: nothing known
    text = emit_cluster(gm, multiples={symbol: 8}).text
    assert "util.assume.int" in text and "udiv = 8" in text, text
    plan = plan_graph(gm, CPU, [], 0, multiples={symbol: 8})
    for n in (8, 24):
        x, b = torch.randn(n, 33), torch.randn(33)
        (out,) = _flat(plan.runner(x, b))
        torch.testing.assert_close(out, fn(x, b), rtol=1e-5, atol=1e-6)
