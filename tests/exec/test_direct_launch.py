"""The direct launcher (pydisc/exec/direct): IREE's CUDA kernels launched by pydisc on torch's stream.

On the CPU (CI): every construct the emitter produces compiles for CUDA into a bundle whose launch
schedule is read from the host code, and the schedule, evaluated at several sizes, writes every byte of
every output and nothing outside any buffer. With a GPU (`cuda` mark): the same constructs run through
pydisc with the direct launcher, with IREE's runtime, and eagerly, with equal results; on side streams,
under CUDA-graph capture, with misaligned and non-contiguous inputs; a training step matches eager.
"""
from __future__ import annotations

import iree.compiler as ireec
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import pydisc
from pydisc.driver import step as pstep
from pydisc.config import CONFIG
from pydisc.exec import clear_cache
from pydisc.exec.direct.kernels import read_executables
from pydisc.exec.direct.launcher import compile_bundle, split_bundle
from pydisc.exec.direct.schedule import Schedule
from pydisc.exec.target import CUDA_DIRECT_TARGET
from pydisc.frontend.decompositions import DECOMPOSITIONS
from pydisc.frontend.emit import emit_cluster
from pydisc.metrics import METRICS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def _emb(idx, table):
    return F.embedding(idx, table) * 2


# name -> (function, argument factory(size), dynamic dims {argument: dims})
CASES = {
    "elementwise": (lambda a, b: a * 2 + b.sin(), lambda n: (torch.randn(n, 33), torch.randn(n, 33)), {0: [0], 1: [0]}),
    "broadcast": (lambda x, r, c: x + r * c, lambda n: (torch.randn(n, 40), torch.randn(40), torch.randn(n, 1)),
                  {0: [0], 2: [0]}),
    "reductions": (lambda x: (x.sum(0), x.amax(1), x.mean()), lambda n: (torch.randn(n, 50),), {0: [0]}),
    # written out: F.softmax itself runs in torch on a GPU (frontend/policy.py, SOFTMAXES)
    "softmax": (lambda x: (e := (x - x.amax(-1, keepdim=True)).exp()) / e.sum(-1, keepdim=True),
                lambda n: (torch.randn(6, n),), {0: [1]}),
    "layernorm_gelu": (lambda x, w, b: F.gelu(F.layer_norm(x, (64,), w, b)),
                       lambda n: (torch.randn(n, 64), torch.randn(64), torch.randn(64)), {0: [0]}),
    "gather": (_emb, lambda n: (torch.randint(0, 30, (n, 5)), torch.randn(30, 16)), {0: [0]}),
    "concat": (lambda a, b: torch.cat([a, b * 2], 1), lambda n: (torch.randn(n, 3), torch.randn(n, 5)), {0: [0], 1: [0]}),
    "slices": (lambda x: x[:, 1:5] * 2 + x[:, 6:10], lambda n: (torch.randn(n, 12),), {0: [0]}),
    "pad": (lambda x: F.pad(x, (1, 2)) + 1, lambda n: (torch.randn(n, 7),), {}),
    "convert": (lambda x: (x.to(torch.bfloat16) * 3).float() + x.half().float(), lambda n: (torch.randn(n, 9),), {0: [0]}),
    "integers": (lambda i: i * 3 + 1, lambda n: (torch.randint(-50, 50, (n, 4)),), {0: [0]}),
    "bf16_chain": (lambda x, r: F.layer_norm(torch.relu(x + r), (96,)),
                   lambda n: (torch.randn(n, 96, dtype=torch.bfloat16), torch.randn(96, dtype=torch.bfloat16)), {0: [0]}),
}


def _trace(fn, args, dynamic):
    if not dynamic:
        return make_fx(torch.func.functionalize(fn, remove="mutations_and_views"),
                       decomposition_table=DECOMPOSITIONS, tracing_mode="fake")(*args)
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
    fakes = []
    for i, arg in enumerate(args):
        dims = dynamic.get(i, ())
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(arg.dim())])
        fakes.append(mode.from_tensor(arg, source=LocalSource(f"arg{i}"), symbolic_context=context))
    return make_fx(torch.func.functionalize(fn, remove="mutations"), decomposition_table=DECOMPOSITIONS,
                   tracing_mode="symbolic")(*fakes)


def _written(schedule: Schedule, values: list[int]) -> dict[tuple, list[tuple[int, int]]]:
    """Byte ranges each command writes (dispatch bindings count as written: the kernels may write them)."""
    ranges: dict[tuple, list] = {}
    for c in schedule.commands:
        if c[0] == "dispatch":
            for buffer, offset, length in c[4]:
                ranges.setdefault(tuple(buffer), []).append((values[offset], values[offset] + values[length]))
        elif c[0] == "copy":
            ranges.setdefault(tuple(c[3]), []).append((values[c[4]], values[c[4]] + values[c[5]]))
        else:
            ranges.setdefault(tuple(c[1]), []).append((values[c[2]], values[c[2]] + values[c[3]]))
    return ranges


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_is_read_and_covers_every_output(name):
    """CPU only: compile for CUDA, read the launch schedule, evaluate it at several sizes."""
    fn, make, dynamic = CASES[name]
    torch.manual_seed(0)
    gm = _trace(fn, make(5), dynamic)
    emitted = emit_cluster(gm)
    blob = compile_bundle(ireec.compile_str, emitted.text, "stablehlo", CUDA_DIRECT_TARGET.flags)
    vmfb, schedule = split_bundle(blob)
    assert isinstance(schedule, Schedule), schedule            # the launcher understands it
    kernels = read_executables(vmfb).kernels
    dispatched = {c[1] for c in schedule.commands if c[0] == "dispatch"}
    assert dispatched <= set(kernels)
    n_out = len(emitted.outputs)
    first_output = schedule.arguments - n_out
    for n in (1, 5, 37) if dynamic else (5,):
        args = make(n)
        expected = fn(*args)
        expected = list(expected) if isinstance(expected, tuple) else [expected]
        buffers = [args[p] for p in emitted.arguments] + expected
        key = tuple(buffers[p].shape[d] for p, d in schedule.reads)
        values = schedule.evaluate(key)
        for k, spec in enumerate(schedule.shapes):   # the shapes each call is checked against
            if spec is not None:
                assert [values[v] for v in spec[1]] == list(buffers[k].shape)
                assert spec[0] == buffers[k].element_size()
        written = _written(schedule, values)
        for k, out in enumerate(expected):
            nbytes = out.numel() * out.element_size()
            covered = sorted(written.get(("arg", first_output + k), []))
            end = 0
            for lo, hi in covered:
                assert lo <= end, f"output {k} at n={n}: bytes {end}..{lo} never written"
                end = max(end, hi)
            assert end == nbytes, f"output {k} at n={n}: {end} of {nbytes} bytes written"
        for (kind, index), spans in written.items():
            if kind == "arg":
                limit = buffers[index].numel() * buffers[index].element_size()
                assert all(hi <= limit for _, hi in spans), (kind, index, spans, limit)
            else:
                assert all(hi <= values[schedule.transients[index]] for _, hi in spans)


def test_a_size_the_emitter_declares_a_multiple_is_read_by_the_launcher():
    """CPU only: a dim that a dynamic-shape template guarantees to be a multiple of 8 is declared so to
    IREE (`util.assume.int`, emit_cluster's `multiples`), which keeps the op in its host code. The
    launcher reads it as the size itself; before, such a module ran through IREE's runtime, with no
    CUDA graph (variable-length BERT: 82 ms a step against 26)."""
    fn, make, dynamic = CASES["layernorm_gelu"]
    gm = _trace(fn, make(8), dynamic)
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    symbol = placeholder.meta["val"].shape[0].node.expr
    emitted = emit_cluster(gm, multiples={symbol: 8})
    assert "util.assume.int" in emitted.text and "udiv = 8" in emitted.text, emitted.text
    blob = compile_bundle(ireec.compile_str, emitted.text, "stablehlo", CUDA_DIRECT_TARGET.flags)
    _, schedule = split_bundle(blob)
    assert isinstance(schedule, Schedule), schedule
    for n in (8, 40):
        args = make(n)
        buffers = [args[p] for p in emitted.arguments] + [fn(*args)]
        values = schedule.evaluate(tuple(buffers[p].shape[d] for p, d in schedule.reads))
        for k, spec in enumerate(schedule.shapes):
            if spec is not None:
                assert [values[v] for v in spec[1]] == list(buffers[k].shape)


@pytest.mark.parametrize("dynamic", [False, True])
def test_results_that_later_ops_read_are_written_in_place(dynamic):
    """A result that later ops of the cluster also read (a residual sum and the statistics of the layer
    norm after it) is computed into its output: IREE copied each such result from a buffer of its own
    when results were placed only at the end (`{iree.abi.output}`)."""
    def fn(x, r, w):
        h = x + r
        mean = h.mean(-1, keepdim=True)
        rstd = (h - mean).square().mean(-1, keepdim=True).add(1e-5).rsqrt()
        y = (h - mean) * rstd * w
        return h, mean, rstd, y, y.sum()

    gm = _trace(fn, (torch.randn(8, 64), torch.randn(8, 64), torch.randn(64)), {0: [0], 1: [0]} if dynamic else {})
    emitted = emit_cluster(gm)
    _, schedule = split_bundle(compile_bundle(ireec.compile_str, emitted.text, "stablehlo", CUDA_DIRECT_TARGET.flags))
    assert isinstance(schedule, Schedule), schedule
    assert [c for c in schedule.commands if c[0] == "copy"] == []
    assert sum(c[0] == "dispatch" for c in schedule.commands) >= 2      # the results cross dispatches


SCATTER_INTO_INPUT = """func.func @main(%x: tensor<4xf32>, %i: tensor<6x1xi64>, %u: tensor<6xf32>,
                 %out0: tensor<4xf32> {iree.abi.output = 0 : index}) -> tensor<4xf32> {
  %r = "stablehlo.scatter"(%x, %i, %u) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
  }) {scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [], inserted_window_dims = [0],
      scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false,
      unique_indices = false} : (tensor<4xf32>, tensor<6x1xi64>, tensor<6xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}"""


def test_inputs_iree_writes_in_place_are_listed():
    """IREE ties a scatter's result to its operand and writes the input's buffer: the schedule lists
    that argument, so the launcher runs the module on a copy of it (tools/repros/exec_inplace_writes_input.py
    shows IREE's runtime path writing the caller's tensor)."""
    _, schedule = split_bundle(compile_bundle(ireec.compile_str, SCATTER_INTO_INPUT, "stablehlo",
                                              CUDA_DIRECT_TARGET.flags))
    assert isinstance(schedule, Schedule)
    assert 0 in schedule.written and 1 not in schedule.written and 2 not in schedule.written


def test_unreadable_module_is_reported_not_launched():
    """A module whose host code holds a constant buffer (not handled): the bundle says why."""
    text = """func.func @main(%a: tensor<4xf32>, %out0: tensor<4xf32> {iree.abi.output = 0 : index}) -> tensor<4xf32> {
  %c = stablehlo.constant dense<[1.0, 2.0, 3.0, 4.5]> : tensor<4xf32>
  %r = stablehlo.multiply %a, %c : tensor<4xf32>
  return %r : tensor<4xf32>
}"""
    _, schedule = split_bundle(compile_bundle(ireec.compile_str, text, "stablehlo", CUDA_DIRECT_TARGET.flags))
    if isinstance(schedule, dict):
        assert schedule["unsupported"]
    else:  # IREE inlined the constant into the kernel: then it is launchable, which is fine too
        assert schedule.commands


# ---- on the GPU ------------------------------------------------------------------------------------


@pytest.fixture
def executor(monkeypatch):
    """Run with a given GPU executor, on fresh plans and modules."""
    def use(name: str) -> None:
        monkeypatch.setattr(CONFIG, "gpu_executor", name)
        pstep.clear_plans()
        clear_cache()
    yield use
    pstep.clear_plans()
    clear_cache()


def _run_pydisc(fn, args, dynamic):
    lazy = []
    for i, a in enumerate(args):
        if dynamic.get(i):
            pydisc.mark_dynamic(a, dynamic[i])
        lazy.append(pydisc.to_lazy(a))
    out = fn(*lazy)
    pydisc.mark_step()
    out = list(out) if isinstance(out, tuple) else [out]
    return [o.cpu() for o in out]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_equals_runtime_and_eager(name, executor):
    fn, make, dynamic = CASES[name]
    sizes = (3, 8, 21, 8) if dynamic else (8, 8)
    results = {}
    for which in ("direct", "iree"):
        executor(which)
        METRICS.reset()
        torch.manual_seed(0)
        results[which] = []
        for n in sizes:
            args = [a.cuda() for a in make(n)]
            results[which].append((_run_pydisc(fn, [a.clone() for a in args], dynamic), fn(*args)))
        if which == "direct":
            assert METRICS.direct_launches > 0 and not METRICS.direct_launch_fallbacks, METRICS.direct_launch_fallbacks
        else:
            assert METRICS.direct_launches == 0
    for (direct, eager), (runtime, _) in zip(results["direct"], results["iree"]):
        eager = list(eager) if isinstance(eager, tuple) else [eager]
        for d, r, e in zip(direct, runtime, eager):
            torch.testing.assert_close(d, r, rtol=0, atol=0)        # the same kernels: bit-identical
            torch.testing.assert_close(d, e.cpu(), equal_nan=True)


@pytest.mark.cuda
@needs_cuda
def test_an_input_iree_writes_in_place_is_left_untouched(executor):
    from pydisc.exec import compile_module
    executor("direct")
    module = compile_module(SCATTER_INTO_INPUT, torch.device("cuda", 0))
    x = torch.zeros(4, device="cuda")
    idx = torch.tensor([[0], [0], [1], [1], [1], [3]], device="cuda")
    src = torch.ones(6, device="cuda")
    for _ in range(3):
        out = torch.empty(4, device="cuda")
        module.run([x, idx, src], [out])
        assert out.tolist() == [2.0, 3.0, 0.0, 1.0] and x.tolist() == [0.0] * 4


@pytest.mark.cuda
@needs_cuda
def test_side_stream_graph_capture_and_odd_inputs(executor):
    executor("direct")
    fn = lambda x, w: F.layer_norm(x, (64,), w) * 2                         # noqa: E731
    x, w = torch.randn(32, 64, device="cuda"), torch.randn(64, device="cuda")
    expected = fn(x, w)
    # the plan is made on the default stream, then the same compiled cluster runs on a side stream
    got = _run_pydisc(fn, [x, w], {})[0]
    torch.testing.assert_close(got, expected.cpu())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = _run_pydisc(fn, [x, w], {})[0]
    torch.testing.assert_close(got, expected.cpu())
    # a misaligned view (4-byte offset) and a non-contiguous one are copied, never launched as they are
    base = torch.randn(32 * 64 + 1, device="cuda")
    odd = base[1:].view(32, 64)
    assert odd.data_ptr() % 64
    torch.testing.assert_close(_run_pydisc(fn, [odd, w], {})[0], fn(odd, w).cpu())
    wide = torch.randn(64, 32, device="cuda").t()
    assert not wide.is_contiguous()
    torch.testing.assert_close(_run_pydisc(fn, [wide, w], {})[0], fn(wide, w).cpu())


@pytest.mark.cuda
@needs_cuda
def test_cuda_graph_capture_of_a_direct_module(executor):
    """The module's launches are captured by torch.cuda.graph and replay on new data."""
    from pydisc.exec import compile_module
    executor("direct")
    fn = lambda x: F.softmax(x * 3, -1)                                      # noqa: E731
    x = torch.randn(16, 128, device="cuda")
    emitted = emit_cluster(_trace(fn, [x.cpu()], {}))
    module = compile_module(emitted.text, x.device)
    assert type(module).__name__ == "DirectModule"
    out = torch.empty(16, 128, device="cuda")
    module.run([x], [out])                 # warm-up outside capture (loads kernels, builds the plan)
    graph = torch.cuda.CUDAGraph()
    static_in = x.clone()
    with torch.cuda.graph(graph):
        module.run([static_in], [out])
    for _ in range(3):
        new = torch.randn(16, 128, device="cuda")
        static_in.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, fn(new))


@pytest.mark.cuda
@needs_cuda
def test_training_step_equals_eager_with_both_executors(executor):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 10)).cuda()
    data = [(torch.randn(16, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(4)]

    def train(use_lazy: bool, which: str | None):
        if which:
            executor(which)
        m = __import__("copy").deepcopy(model)
        run = pydisc.lazy(m) if use_lazy else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)     # after lazy(): it holds the lazy parameters
        losses = []
        for x, y in data:
            loss = F.cross_entropy(run(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if use_lazy:
                pydisc.mark_step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in m.parameters()]

    eager_losses, eager_params = train(False, None)
    for which in ("direct", "iree"):
        METRICS.reset()
        losses, params = train(True, which)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
        for p, e in zip(params, eager_params):
            torch.testing.assert_close(p, e, rtol=1e-4, atol=1e-5)
        assert (METRICS.direct_launches > 0) == (which == "direct")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_load_and_launch_their_own_modules(executor):
    """The same cluster on cuda:0 and cuda:1: one module per device, each launched in its own device's
    context and stream, while torch's current device stays cuda:0."""
    executor("direct")
    METRICS.reset()
    fn = lambda x, w: F.layer_norm(x, (64,), w) * 2 + x.sum(0)             # noqa: E731
    torch.cuda.set_device(0)
    results = {}
    for index in (0, 1, 0, 1):
        dev = torch.device("cuda", index)
        torch.manual_seed(index)
        x, w = torch.randn(32, 64, device=dev), torch.randn(64, device=dev)
        got = _run_pydisc(fn, [x, w], {})[0]
        torch.testing.assert_close(got, fn(x, w).cpu())
        results[index] = got
        assert torch.cuda.current_device() == 0
    assert METRICS.direct_launches > 0 and not METRICS.direct_launch_fallbacks
