"""Eager's exceptions for mixed dtypes that meta functions accept.

The meta functions of matrix products, convolutions, `index_put`/`index_add`, the norms and some
in-place arithmetic accept tensors of mixed dtypes that eager's kernels refuse (a float64 batch into a
float32 Linear, float64 values put into a float32 tensor, norms with float64 weights, an integer result
written into a bool tensor). Both recorders ask `eager_dtype_error` where such an op gets mixed dtypes:
the op is run once in torch on uninitialised tensors of the same layouts, and eager's own exception and
message are raised at the op's line. The verdict is kept per (op, dtypes, device type).
"""
from __future__ import annotations

import torch

from .symbolic import hint

__all__ = ["EAGER_DTYPE_CHECKS", "eager_dtype_error"]

EAGER_DTYPE_CHECKS = frozenset((
    "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "linear", "matmul", "convolution",
    "_convolution", "addbmm", "index_put", "index_put_", "_index_put_impl_", "index_add", "index_add_",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "mul_", "div_", "sub_", "add_",
))

_VERDICTS: dict[tuple, BaseException | None] = {}


def eager_dtype_error(func, args, kwargs, device: torch.device | None = None) -> BaseException | None:
    """The exception eager's kernel raises for op `func` on these arguments, if their tensors have mixed
    dtypes, else None. `device`: where meta tensors among them stand for (the fast recorder's meta run)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]    # (not index_put's list of indices)
    tensors += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    if not tensors or all(t.dtype == tensors[0].dtype for t in tensors):
        return None
    device_type = device.type if device is not None and tensors[0].device.type == "meta" else \
        tensors[0].device.type
    key = (func, tuple(t.dtype for t in tensors), device_type)
    if key not in _VERDICTS:
        _VERDICTS[key] = _eager_verdict(func, args, kwargs, device)
    return _VERDICTS[key]


def _empty(x, device: torch.device | None):
    """A tensor of `x`'s layout holding nothing in particular (integers: zeros), on `device` for a meta one."""
    if isinstance(x, torch.Tensor):     # (sizes of a symbolic step: this step's, no guard added)
        shape, stride = [hint(d) for d in x.shape], [hint(d) for d in x.stride()]
        where = device if device is not None and x.device.type == "meta" else x.device
        if x.dtype.is_floating_point or x.dtype.is_complex:
            return torch.empty_strided(shape, stride, dtype=x.dtype, device=where)
        return torch.zeros(shape, dtype=x.dtype, device=where)
    if isinstance(x, (list, tuple)):
        return type(x)(_empty(v, device) for v in x)
    return hint(x)


def _eager_verdict(func, args, kwargs, device: torch.device | None) -> BaseException | None:
    """The exception eager's kernel raises for these arguments' dtypes and layouts, or None. Integer
    tensors (indices) hold zeros; an IndexError is about those values, not the dtypes: None."""
    with torch._C._DisableTorchDispatch(), torch.no_grad():
        try:
            real_args = [_empty(a, device) for a in args]
            real_kwargs = {k: _empty(v, device) for k, v in kwargs.items()}
        except Exception:  # noqa: BLE001 - no tensors to ask eager with: the meta function's verdict stands
            return None
        try:
            func(*real_args, **real_kwargs)
        except IndexError:
            return None
        except (RuntimeError, TypeError, ValueError) as exc:
            return exc
    return None
