"""Every decomposition pydisc uses against the real op, in every output slot, over PyTorch's OpInfo
samples (forward and backward, float32 and bfloat16).

A decomposition is traced into the step graph in place of its op, while ops that read its results may
run as torch's kernels (a backward op that has no decomposition, an op left eager): whatever it returns
in any slot must be what the kernel returns there. torch's decomposition of the CPU flash attention
returned the attention probabilities in the logsumexp's slot, and its eager backward trained on that.

The samples run under a dispatch mode that, at each call of a decomposed op, also runs the
decomposition on copies of the arguments and compares: the number of results, each one's shape and
dtype exactly, values as the OpInfo harness does (no less accurate than the kernel against a float64
reference). Strides are the business of `decompositions.conforming`, which makes every traced result
take the op's own layout: checked here by tracing the decomposition wherever its strides differ.
"""
from __future__ import annotations

import itertools
import threading
import warnings
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

pytest.importorskip("expecttest")  # needed by torch's op_db

from conftest import run_emitted  # noqa: E402
from pydisc.frontend.decompositions import DECOMPOSITIONS  # noqa: E402

aten = torch.ops.aten
CALLS_PER_OP = 8
SAMPLES_PER_OPINFO = 8
# Results whose values the op leaves undefined or draws from the random generator: shape and dtype only.
UNDEFINED_VALUES = ("empty", "new_empty", "rand", "bernoulli", "dropout", "normal", "uniform", "exponential",
                    "multinomial", "randperm", "rrelu", "cauchy", "geometric", "log_normal")
# Decompositions that torch's CPU kernels cannot run eagerly (nearest upsampling on int64 positions,
# a gather that pydisc compiles): compared after tracing and compiling them (tests/frontend/conftest.py).
COMPILED_ONLY = {aten.upsample_nearest1d_backward.default, aten.upsample_nearest2d_backward.default,
                 aten.upsample_nearest3d_backward.default, aten._upsample_nearest_exact1d_backward.default,
                 aten._upsample_nearest_exact2d_backward.default, aten._upsample_nearest_exact3d_backward.default}


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy with `t`'s exact layout (`clone` makes a view with zero strides contiguous)."""
    copy = torch.empty(0, dtype=t.dtype, device=t.device)
    return copy.set_(t.detach().untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())


def _clone(x):
    return tree_map(lambda t: _copy(t) if isinstance(t, torch.Tensor) else t, x)


class _Walk(TorchDispatchMode):
    """Keeps, per decomposed op, up to CALLS_PER_OP calls: copies of the arguments, of the results, and
    the results' strides."""

    def __init__(self, calls: dict) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        keep = func in DECOMPOSITIONS and not func._schema.is_mutable and len(self.calls[func]) < CALLS_PER_OP
        if keep:
            with _disable_current_modes():
                copies = _clone((args, kwargs))
        out = func(*args, **kwargs)
        if keep:
            with _disable_current_modes():
                strides = [t.stride() if isinstance(t, torch.Tensor) else None for t in tree_flatten(out)[0]]
                self.calls[func].append((copies, _clone(out), strides))
        return out


def _run_sample(op, sample, grad: bool) -> None:
    out = op.op(sample.input, *sample.args, **sample.kwargs)
    if not grad:
        return
    outs = [t for t in tree_flatten(sample.output_process_fn_grad(out))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = [t for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs and leaves:
        torch.autograd.grad(sum(o.sum() for o in outs), leaves, allow_unused=True)


def _attention_samples():
    """F.scaled_dot_product_attention with the inputs that reach its CPU kernel (OpInfo's samples mostly
    take the math path): plain, causal, masks, a scale, GQA, a rectangular causal, in both dtypes."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for kv_heads, rows, kwargs in ((4, 6, {}), (4, 6, {"is_causal": True}), (4, 5, {"is_causal": True}),
                                       (4, 6, {"attn_mask": "bool"}), (4, 6, {"attn_mask": "float"}),
                                       (4, 6, {"scale": 0.3}), (2, 6, {"enable_gqa": True, "is_causal": True})):
            q = torch.randn(2, 4, rows, 8, generator=g).to(dtype).requires_grad_()
            k, v = (torch.randn(2, kv_heads, 6, 8, generator=g).to(dtype).requires_grad_() for _ in range(2))
            if kwargs.get("attn_mask") == "bool":
                kwargs = {"attn_mask": torch.rand(rows, 6, generator=g) > 0.3}
            elif kwargs.get("attn_mask") == "float":
                kwargs = {"attn_mask": torch.randn(2, 1, rows, 6, generator=g).to(dtype)}
            yield lambda q=q, k=k, v=v, kwargs=kwargs: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k, v, **kwargs).sum(), (q, k, v))


@pytest.fixture(scope="module")
def calls() -> dict:
    # in a thread of its own: OpInfo's sample generators inspect the whole call stack each time
    # (`extract_test_fn`), which under pytest's deep stack took 4x as long as the samples themselves
    calls: dict = defaultdict(list)
    walker = threading.Thread(target=_walk, args=(calls,))
    walker.start()
    walker.join()
    return calls


def _walk(calls: dict) -> None:
    from torch.testing._internal.common_methods_invocations import op_db

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            for dtype in (torch.float32, torch.bfloat16):
                if dtype not in op.supported_dtypes("cpu"):
                    continue
                grad = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
                try:
                    samples = list(itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=grad),
                                                    SAMPLES_PER_OPINFO))
                except Exception:    # noqa: BLE001 - a sample generator torch cannot run here
                    continue
                for sample in samples:
                    try:
                        with _Walk(calls):
                            _run_sample(op, sample, grad)
                    except Exception:    # noqa: BLE001 - eager rejects the sample: nothing to compare
                        pass
        for sample in _attention_samples():
            with _Walk(calls):
                sample()


def _to64(x):
    return tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, x)


def _values_differ(got: torch.Tensor, real: torch.Tensor, reference) -> str | None:
    try:
        torch.testing.assert_close(got, real, equal_nan=True, check_stride=False)
        return None
    except AssertionError as exc:
        message = " ".join(str(exc).splitlines()[:4])
    if real.dtype in (torch.bfloat16, torch.float16):
        # a low-precision result: within two of its units in the last place, normwise (a backward
        # whose float64 reference is computed from saved statistics rounded to bfloat16 inherits that
        # rounding, and would call the more accurate of two computations the wrong one)
        ulp = 2.0 ** (-7 if real.dtype == torch.bfloat16 else -10)
        g, e = got.double(), real.double()
        finite = torch.isfinite(e)
        if torch.equal(g.isnan(), e.isnan()) and torch.equal(g[~finite].nan_to_num(), e[~finite].nan_to_num()) \
                and (not finite.any() or float((g - e)[finite].abs().max()) <= 2 * ulp * float(e[finite].abs().max())):
            return None
    reference = reference() if real.is_floating_point() else None
    if reference is None:
        return message
    # torch's test_decomp criterion: no less accurate than the kernel against a float64 reference
    g, e, r = got.double(), real.double(), reference.double()
    finite = torch.isfinite(e) & torch.isfinite(r)
    if not torch.equal(g.isnan(), e.isnan()) or not torch.equal(g[~finite].nan_to_num(), e[~finite].nan_to_num()):
        return message
    if not finite.any():
        return None
    slack = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}.get(real.dtype, 1.3e-6) * float(r[finite].abs().max())
    if float((g - r)[finite].abs().max()) <= 1.5 * float((e - r)[finite].abs().max()) + 1e-5 + slack:
        return None
    return message


def _compare(op, args, kwargs, real, got) -> str | None:
    flat_real, flat_got = tree_flatten(real)[0], tree_flatten(got)[0]
    if len(flat_real) != len(flat_got):
        return "%d results, the op has %d" % (len(flat_got), len(flat_real))
    references: list = []

    def reference(k: int) -> torch.Tensor | None:
        if not references:
            try:
                references.extend(tree_flatten(op(*_to64(args), **_to64(kwargs)))[0])
            except Exception:    # noqa: BLE001 - no float64 kernel: compare with the kernel alone
                references.append(None)
        ref = references[k] if k < len(references) else None
        return ref if isinstance(ref, torch.Tensor) and ref.shape == flat_real[k].shape else None

    for k, (r, g) in enumerate(zip(flat_real, flat_got)):
        if not isinstance(r, torch.Tensor):
            if r != g and not (isinstance(r, float) and r != r and g != g):
                return "result %d: %r, the op's %r" % (k, g, r)
            continue
        if not isinstance(g, torch.Tensor) or g.shape != r.shape or g.dtype != r.dtype:
            return "result %d: %s, the op's %s%s" % (k, "a tensor of %s%s" % (g.dtype, list(g.shape))
                                                    if isinstance(g, torch.Tensor) else type(g).__name__,
                                                    r.dtype, list(r.shape))
        if any(name in str(op) for name in UNDEFINED_VALUES):
            continue
        why = _values_differ(g, r, lambda k=k: reference(k))
        if why is not None:
            return "result %d: %s" % (k, why)
    return None


def _decomposed(op, args, kwargs):
    if op in COMPILED_ONLY:     # (each call is one IREE compile)
        flat, spec = tree_flatten((args, kwargs))
        positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

        def fn(*tensors):
            values = list(flat)
            for i, t in zip(positions, tensors):
                values[i] = t
            a, k = torch.utils._pytree.tree_unflatten(values, spec)
            return DECOMPOSITIONS[op](*a, **k)

        outs, _ = run_emitted(fn, *[flat[i] for i in positions])
        return outs[0] if len(outs) == 1 else tuple(outs)
    with torch.no_grad():
        return DECOMPOSITIONS[op](*_clone(args), **_clone(kwargs))


def test_the_walk_reaches_the_decompositions_steps_use(calls) -> None:
    functional = {op for op in DECOMPOSITIONS if not op._schema.is_mutable and
                  not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")}
    reached = set(calls) & functional
    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
               aten.native_layer_norm.default, aten.native_layer_norm_backward.default,
               aten._softmax.default, aten.embedding_dense_backward.default, aten.addmm.default):
        assert op in reached, op
    assert len(reached) >= 0.6 * len(functional), (len(reached), len(functional))


def test_every_decomposition_returns_what_its_op_returns(calls) -> None:
    wrong = {}
    for op, seen in calls.items():
        for (args, kwargs), real, _ in seen[:2] if op in COMPILED_ONLY else seen:
            try:
                got = _decomposed(op, args, kwargs)
            except Exception as exc:    # noqa: BLE001
                why = "raised %s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            else:
                why = None if got is NotImplemented else _compare(op, args, kwargs, real, got)
            if why is not None:
                dtypes = sorted({str(a.dtype) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)})
                wrong[str(op)] = "%s (%s)" % (why, ", ".join(dtypes))
                break
    assert not wrong, "\n".join("%s: %s" % kv for kv in sorted(wrong.items()))


def test_traced_decompositions_take_the_op_layout(calls) -> None:
    """Where a decomposition's strides differ from the kernel's, tracing it (as a step is traced) gives
    the op's own strides, or keeps the op whole."""
    wrong = {}
    for op, seen in calls.items():
        for (args, kwargs), real, strides in seen[:4]:
            try:
                with torch.no_grad():
                    got = DECOMPOSITIONS[op](*_clone(args), **_clone(kwargs))
            except Exception:    # noqa: BLE001 - reported by the test above
                continue
            real = [(r.shape, st) if isinstance(r, torch.Tensor) else None
                    for r, st in zip(tree_flatten(real)[0], strides)]
            pairs = [(g.shape, g.stride(), r) for g, r in zip(tree_flatten(got)[0], real)
                     if isinstance(g, torch.Tensor) and r is not None and g.shape == r[0]]
            if all(_strides_agree(shape, stride, r[1]) for shape, stride, r in pairs):
                continue
            flat, spec = tree_flatten((args, kwargs))
            positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]

            def fn(*tensors, op=op, flat=flat, spec=spec, positions=positions):
                values = list(flat)
                for i, t in zip(positions, tensors):
                    values[i] = t
                a, k = torch.utils._pytree.tree_unflatten(values, spec)
                return op(*a, **k)

            gm = make_fx(fn, decomposition_table=DECOMPOSITIONS, tracing_mode="fake")(
                *[flat[i] for i in positions])
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            traced = [n.meta["val"] if isinstance(n, torch.fx.Node) else n for n in tree_flatten(out)[0]]
            for k, (t, r) in enumerate(zip(traced, real)):
                if r is not None and isinstance(t, torch.Tensor) and not _strides_agree(t.shape, t.stride(), r[1]):
                    wrong[str(op)] = "result %d traced with strides %s, the op's %s" % (k, t.stride(), r[1])
    assert not wrong, "\n".join("%s: %s" % kv for kv in sorted(wrong.items()))


def _strides_agree(shape, stride, expected) -> bool:
    if shape.numel() <= 1:
        return True
    return all(n == 1 or x == y for n, x, y in zip(shape, stride, expected))


@pytest.mark.parametrize("dim, start, end, step", [
    (1, 2, 5, 1), (1, None, 3, 1), (1, -3, None, 1), (0, 0, None, 1), (1, 0, 12, 2), (1, 1, None, 2),
    (1, 3, 10, 3), (1, 2, 4, 2), (-1, 1, 4, 2), (1, 1, 9, 5), (1, 4, 4, 1), (1, 5, 100, 1)])
def test_slice_scatter_as_a_concatenation(dim: int, start, end, step: int) -> None:
    """pydisc's slice_scatter (concatenation; strided: of x viewed as (size / step, step)) is torch's."""
    x = torch.randn(3, 12, 2).transpose(0, 2)
    src = torch.randn_like(x[(slice(None),) * (dim % 3) + (slice(start, end, step),)])
    got = DECOMPOSITIONS[aten.slice_scatter.default](x, src, dim, start, end, step)
    torch.testing.assert_close(got, torch.slice_scatter(x, src, dim, start, end, step), rtol=0, atol=0)
