"""Run PyTorch OpInfo samples through pydisc and classify each one against eager PyTorch.

A *case* is one OpInfo entry in one dtype, forward only or forward + backward. Its samples are
recorded on lazy tensors together and run by a single `pydisc.mark_step()` (one plan, usually one
compile); when that step shows a fallback, a compile failure or an exception, every sample of the case
runs again on its own so that each outcome belongs to exactly one sample. Outcomes:

- compiled: matches eager and nothing ran eagerly (no `fallback_ops`, and a compiled executable ran or
  nothing was left to run: views of materialized tensors are taken directly);
- fallback: matches eager, but some ATen ops ran eagerly;
- wrong: differs from eager (values beyond the dtype's `assert_close` tolerance and less accurate than
  eager against a float64 reference, or different dtype/shape/structure);
- error: pydisc raised (or a cluster failed to compile) where eager did not.

Samples on which eager itself raises are skipped.

Each outcome also names the route whose executables ran (`Outcome.route`): "stablehlo", "torch-mlir"
(ops with no StableHLO rule, compiled through torch-mlir's FX importer), "both", or "" when none ran.
A batch whose step used both routes runs again sample by sample, so that each sample's route is its own.
"""
from __future__ import annotations

import itertools
import math
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

import pydisc
from pydisc.config import CONFIG
from pydisc.frontend.lazy_tensor import RECORDER

__all__ = ["DTYPES", "Outcome", "CaseResult", "run_case", "case_dtypes", "RANDOM_OPS", "UNINITIALIZED_OPS"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)

# Outputs whose values are not defined: only dtype and shape are compared.
UNINITIALIZED_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
# Values depend on the random generator's state: not comparable sample by sample.
RANDOM_OPS = {"randn", "rand", "randint", "randperm", "randn_like", "rand_like", "randint_like", "normal",
              "bernoulli", "multinomial", "nn.functional.dropout", "nn.functional.dropout2d",
              "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.rrelu",
              "nn.functional.feature_alpha_dropout", "uniform", "exponential", "geometric", "cauchy",
              "log_normal"}


@dataclass
class Outcome:
    kind: str               # compiled | fallback | wrong | error
    detail: str = ""        # fallback ops, mismatch or exception text
    route: str = ""         # stablehlo | torch-mlir | both | "" (no compiled executable ran)


@dataclass
class CaseResult:
    op: str
    dtype: torch.dtype
    grad: bool
    outcomes: list[Outcome] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.outcomes)


def full_name(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def case_dtypes(op: Any) -> list[torch.dtype]:
    supported = op.supported_dtypes("cpu")
    return [d for d in DTYPES if d in supported]


def differentiable(op: Any, dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and op.supports_autograd and \
        dtype in op.supported_backward_dtypes("cpu")


# ---- one sample -------------------------------------------------------------------------------------
@dataclass
class _Sample:
    index: int
    sample: Any
    expected: Any                   # eager outputs (and grads)
    reference: Callable[[], Any]    # float64 outputs (and grads), computed on demand
    actual: Any = None
    error: str | None = None


def _leaves(sample: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(op: Any, sample: Any, grad: bool, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Outputs of `op` on `sample` with every tensor passed through `convert`; with `grad`, also the
    gradients of the sum of all differentiable outputs with respect to the inputs that require grad."""
    inputs = tree_map(lambda t: convert(t) if isinstance(t, torch.Tensor) else t,
                      (sample.input, sample.args, sample.kwargs))
    out = op.op(inputs[0], *inputs[1], **inputs[2])
    if not grad:
        return out
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = [t for t in tree_flatten(sample.output_process_fn_grad(out))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves or not outs:
        raise _NoGrad()
    total = sum(t.sum() for t in outs)
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return out, list(grads)


class _NoGrad(Exception):
    """The sample has no differentiable output or input: no backward to test."""


def _copy_as(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    c = t.detach().clone() if dtype is None or not t.is_floating_point() else t.detach().to(dtype)
    return c.requires_grad_(t.requires_grad) if c.is_floating_point() else c


def _lazy(t: torch.Tensor) -> torch.Tensor:
    c = pydisc.to_lazy(t.detach().clone())
    return c.requires_grad_(t.requires_grad) if c.is_floating_point() and t.requires_grad else c


def _materialize(value: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, value)


# ---- comparison -------------------------------------------------------------------------------------
def _mismatch(actual: Any, expected: Any, reference: Callable[[], Any], values: bool) -> str | None:
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    if spec_a != spec_e:
        return f"structure {spec_a} vs eager {spec_e}"
    flat_r: list | None = None
    for i, (a, e) in enumerate(zip(flat_a, flat_e)):
        if not isinstance(e, torch.Tensor):
            if isinstance(e, float) and isinstance(a, float) and math.isnan(e) and math.isnan(a):
                continue
            if a != e and not (isinstance(e, float) and math.isclose(a, e, rel_tol=1e-5, abs_tol=1e-5)):
                return f"output {i}: {a!r} vs eager {e!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__} vs eager tensor"
        if a.dtype != e.dtype or a.shape != e.shape:
            return f"output {i}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}"
        if not values:
            continue
        try:
            torch.testing.assert_close(a, e, equal_nan=True, check_device=False, check_stride=False)
            continue
        except AssertionError as exc:
            message = str(exc).splitlines()
        if not e.dtype.is_floating_point:
            return f"output {i}: " + " ".join(message[:4])
        # torch's test_decomp criterion: no less accurate than eager against a float64 reference.
        if flat_r is None:
            try:
                flat_r = tree_flatten(reference())[0]
            except Exception:
                flat_r = []
        r = flat_r[i] if i < len(flat_r) and isinstance(flat_r[i], torch.Tensor) else None
        if r is None or r.shape != e.shape or not _as_accurate(a, e, r):
            return f"output {i}: " + " ".join(message[:4])
    return None


def _as_accurate(actual: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> bool:
    a, e, r = actual.double(), eager.double(), ref.detach().double()
    if not torch.equal(a.isnan(), e.isnan()):
        return False
    finite = ~(e.isnan() | e.isinf() | r.isnan() | r.isinf())
    if not torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()):
        return False
    if not finite.any():
        return True
    a_err = (a - r)[finite].abs().max().item()
    e_err = (e - r)[finite].abs().max().item()
    # Widened by the dtype's assert_close tolerances relative to the largest reference value: summed
    # low-precision gradients carry rounding errors of their summands, not of their (smaller) result.
    rtol = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2}.get(eager.dtype, 1.3e-6)
    return a_err <= 1.5 * e_err + 1e-5 + rtol * r[finite].abs().max().item()


# ---- a case -----------------------------------------------------------------------------------------
def _prepare(op: Any, dtype: torch.dtype, grad: bool, max_samples: int) -> list[_Sample]:
    torch.manual_seed(0)
    prepared = []
    samples = op.sample_inputs("cpu", dtype, requires_grad=grad)
    for index, sample in enumerate(itertools.islice(samples, max_samples)):
        if grad and not _leaves(sample):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = _materialize(_run(op, sample, grad, _copy_as))
        except _NoGrad:
            continue
        except Exception:
            continue  # eager rejects this sample: nothing to compare

        def reference(sample: Any = sample) -> Any:
            return _materialize(_run(op, sample, grad, lambda t: _copy_as(t, torch.float64)))

        prepared.append(_Sample(index, sample, expected, reference))
    return prepared


def _reset_pending() -> None:
    """Drop whatever a failed sample left recorded, so that the next samples start clean."""
    try:
        pydisc.mark_step()
    except Exception:
        RECORDER.new_trace()


def _run_batch(op: Any, batch: list[_Sample], grad: bool, values: bool) -> tuple[list[Outcome], bool]:
    """Run `batch` in one step; returns the outcomes and whether they can be attributed per sample."""
    _reset_pending()
    before = pydisc.metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in batch:
            s.actual, s.error = None, None
            try:
                s.actual = _run(op, s.sample, grad, _lazy)
            except Exception as exc:
                s.error = _describe(exc)
        step_error = None
        try:
            pydisc.mark_step()
            for s in batch:
                if s.error is None:
                    try:
                        s.actual = _materialize(s.actual)
                    except Exception as exc:
                        s.error = _describe(exc)
        except Exception as exc:
            step_error = _describe(exc)
            RECORDER.new_trace()
    after = pydisc.metrics()
    fallback = Counter(after["fallback_ops"]) - Counter(before["fallback_ops"])
    failures = Counter(after["compile_failures"]) - Counter(before["compile_failures"])
    ran_compiled = after["executions"] > before["executions"]
    nothing_to_run = after["steps"] == before["steps"]
    route = _route(before, after)
    clean = step_error is None and not fallback and not failures and all(s.error is None for s in batch)
    if len(batch) > 1 and (not clean or route == "both"):
        return [], False
    outcomes = []
    for s in batch:
        if step_error is not None or s.error is not None:
            outcomes.append(Outcome("error", step_error or s.error or ""))
            continue
        if failures:
            outcomes.append(Outcome("error", "compile failure: " + ", ".join(failures)))
            continue
        mismatch = _mismatch(s.actual, s.expected, s.reference, values)
        if mismatch is not None:
            outcomes.append(Outcome("wrong", mismatch))
        elif fallback:
            outcomes.append(Outcome("fallback", ", ".join(sorted(fallback))))
        elif ran_compiled or nothing_to_run:
            outcomes.append(Outcome("compiled"))
        else:
            outcomes.append(Outcome("fallback", "step ran without a compiled cluster"))
    for o in outcomes:
        o.route = route
    return outcomes, True


def _route(before: dict, after: dict) -> str:
    """Which route's executables ran between two metrics snapshots."""
    torch_mlir = after.get("executions_torch_mlir", 0) - before.get("executions_torch_mlir", 0)
    stablehlo = after["executions"] - before["executions"] - torch_mlir
    return {(True, True): "both", (True, False): "stablehlo", (False, True): "torch-mlir"}.get(
        (stablehlo > 0, torch_mlir > 0), "")


def _describe(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({frame[0].filename.rsplit('/', 1)[-1]}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300] + where


def run_case(op: Any, dtype: torch.dtype, *, grad: bool = False, max_samples: int = 4) -> CaseResult:
    """All samples (up to `max_samples`) of `op` in `dtype`; with `grad`, forward and backward."""
    name = full_name(op)
    result = CaseResult(name, dtype, grad)
    samples = _prepare(op, dtype, grad, max_samples)
    if not samples:
        return result
    values = op.name not in UNINITIALIZED_OPS
    # Static plans only: cases of one structure and other sizes (interpolate then upsample, a batch
    # then its samples one by one) would otherwise meet the dynamic-shape policy, whose first step with
    # a changed dim runs eagerly and counts as neither compiled nor fallback.
    dynamic, CONFIG.dynamic = CONFIG.dynamic, False
    try:
        outcomes, attributed = _run_batch(op, samples, grad, values)
        if not attributed:
            outcomes = [_run_batch(op, [s], grad, values)[0][0] for s in samples]
    finally:
        CONFIG.dynamic = dynamic
    result.outcomes = outcomes
    return result
