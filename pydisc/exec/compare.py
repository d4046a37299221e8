"""How a compiled result is compared with eager's: the numerics checks of a cluster
(`clusters.CompiledCluster.check`), of a torch-mlir region's first call and of a whole step
(PYDISC_CHECK, driver/step_check.py) all use `mismatch`."""
from __future__ import annotations

import torch

__all__ = ["mismatch", "tolerance"]


def mismatch(got, want) -> str | None:
    """Why a compiled result is not eager's, or None. Floats are compared normwise: the largest error
    against the largest magnitude of the result (`tolerance`), since a value that is zero in exact
    arithmetic (the gradient of a key bias) is rounding noise of its summands in either computation,
    and an elementwise comparison would call that noise wrong. NaN and infinities must be where eager's
    are."""
    if not isinstance(want, torch.Tensor):
        return None if got == want else "%r, expected %r" % (got, want)
    if got.dtype != want.dtype or got.numel() != want.numel():
        return "%s%s, expected %s%s" % (got.dtype, list(got.shape), want.dtype, list(want.shape))
    got, want = got.detach().reshape(want.shape), want.detach()
    if not want.dtype.is_floating_point and not want.dtype.is_complex:
        wrong = int((got != want).sum())
        return None if not wrong else "%d of %d elements differ" % (wrong, want.numel())
    g, w = got.double(), want.double()
    finite = torch.isfinite(w)
    if not torch.equal(torch.isnan(g), torch.isnan(w)) or not torch.equal(g[torch.isinf(w)], w[torch.isinf(w)]):
        return "NaN or infinite values where eager has none, or the other way round"
    if not finite.any():
        return None
    scale = float(w[finite].abs().max())
    error = (g[finite] - w[finite]).abs()
    rtol, atol = tolerance(want.dtype)
    if float(error.max()) <= rtol * scale + atol:
        return None
    worst = int(error.argmax())
    return "largest difference %.3g (at flat index %d: %.6g, eager %.6g) against a largest magnitude of %.3g" % (
        float(error.max()), worst, float(g[finite][worst]), float(w[finite][worst]), scale)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) of a compiled result against eager's, normwise (`mismatch`): one step's rounding."""
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2, 1e-3
    return 1e-3, 1e-6
