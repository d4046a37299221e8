"""Record-time rewrites that keep one compiled step valid across steps.

- Python floats in arithmetic ops (learning rates, Adam's bias corrections, momentum factors) would be
  baked into the compiled code as constants, so a learning-rate schedule would recompile every step.
  They are lifted: recorded as scalar inputs of the step (0-d float32 tensors at run time), the way
  PyTorch/XLA uploads scalars as device data.
- `_foreach_*` ops are recorded as one entry that runs per tensor when replayed (`frontend/foreach.py`):
  the lowering rules then need no foreach variants, and per-tensor scalars of `ScalarList` overloads are
  lifted like any other.
- Matrix products and convolutions check that their tensors share a dtype, as eager's kernels do (the
  meta functions that record them do not: a float64 batch into a float32 `nn.Linear` compiled and ran
  where eager raises).
- `native_batch_norm` (and on CUDA `cudnn_batch_norm`) writes its running statistics without saying
  so in its schema; it is recorded as `_native_batch_norm_legit`, whose schema declares the writes, so
  functionalization sees them.
"""
from __future__ import annotations

import math

import torch
from torch.utils._mode_utils import no_dispatch

from .dtype_checks import EAGER_DTYPE_CHECKS, eager_dtype_error
from .foreach import optimizers_take_their_foreach_path, record_foreach
from . import optimizer_step
from .layout import contiguous_strides
from .lazy_tensor import RECORDER, LazyTensor, LiftedScalar, liftable, to_lazy
from .op_facts import REWRITES, opinfo

__all__ = ["install_rewrites"]

aten = torch.ops.aten


def _record(func, *args, **kwargs):
    return RECORDER.record(func, args, kwargs, opinfo(func))


def _binary_scalar(tensor_op):
    """`op(x, 0.9)` / `op.Scalar(x, 0.9)` -> `op.Tensor(x, lifted)`."""
    def rewrite(func, args, kwargs):
        if len(args) != 2 or kwargs.get("alpha", 1) != 1 or not liftable(args[0], args[1]):
            return NotImplemented
        return _record(tensor_op, args[0], LiftedScalar(args[1]))
    return rewrite


def _alpha(tensor_op):
    """`add(a, b, alpha=s)` -> `add(a, mul(b, lifted))`."""
    def rewrite(func, args, kwargs):
        alpha = kwargs.get("alpha", 1)
        if len(args) != 2 or alpha == 1 or not isinstance(args[1], torch.Tensor) or not liftable(args[0], alpha) \
                or args[1].dtype != args[0].dtype or args[1].device != args[0].device:
            return NotImplemented
        scaled = _record(aten.mul.Tensor, args[1], LiftedScalar(alpha))
        return _record(tensor_op, args[0], scaled)
    return rewrite


def _lerp(tensor_op):
    def rewrite(func, args, kwargs):
        if len(args) != 3 or not isinstance(args[1], LazyTensor) or not liftable(args[0], args[2]):
            return NotImplemented
        return _record(tensor_op, args[0], args[1], LiftedScalar(args[2]))
    return rewrite


def _addc(combine, add_op):
    """`addcmul(s, a, b, value=v)` -> `add(s, mul(combine(a, b), lifted v))`, evaluated in eager's order."""
    def rewrite(func, args, kwargs):
        value = kwargs.get("value", args[3] if len(args) > 3 else 1)
        s, a, b = args[:3]
        if not (isinstance(a, LazyTensor) and isinstance(b, LazyTensor)) or not liftable(s, value) \
                or a.shape != b.shape:
            return NotImplemented
        if combine is aten.mul.Tensor:      # s + (v * a) * b
            term = _record(aten.mul.Tensor, _record(aten.mul.Tensor, a, LiftedScalar(value)), b)
        else:                               # s + v * (a / b)
            term = _record(aten.mul.Tensor, _record(combine, a, b), LiftedScalar(value))
        return _record(add_op, s, term)
    return rewrite


def _batch_norm(func, args, kwargs):
    """native_batch_norm as the `_native_batch_norm_legit*` op that torch's own decomposition picks:
    the one whose schema declares the writes to the running statistics in training, and the same ops
    in every mode, so that a step recorded with symbolic sizes (where torch's Python dispatcher
    applies that decomposition itself) matches the steps recorded concretely."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    v = dict(zip(names, args))
    v.update(kwargs)
    if v["running_mean"] is None or v["running_var"] is None:
        if v["running_mean"] is not None or v["running_var"] is not None:
            return NotImplemented           # eager raises: let it
        return aten._native_batch_norm_legit.no_stats(v["input"], v["weight"], v["bias"], v["training"],
                                                      v["momentum"], v["eps"])
    if v["training"]:
        return aten._native_batch_norm_legit.default(*(v[n] for n in names))
    return aten._native_batch_norm_legit_no_training.default(
        v["input"], v["weight"], v["bias"], v["running_mean"], v["running_var"], v["momentum"], v["eps"])


def _batch_norm_eval_cpu(func, args, kwargs):
    """In eval mode the CPU kernels of _native_batch_norm_legit(_no_training) return empty saved
    statistics, where their meta kernels (what recording sees) promise [C]: give eager's (0,)."""
    x = args[0]
    training = args[5] if func is aten._native_batch_norm_legit.default and len(args) > 5 else \
        kwargs.get("training", False)
    if not isinstance(x, LazyTensor) or x.device.type != "cpu" or training:
        return NotImplemented
    out, mean, rstd = _record(func, *args, **kwargs)
    running_mean = args[3] if len(args) > 3 else kwargs.get("running_mean")
    # of the running statistics' dtype on the CPU (bf16 input, f32 stats: f32; all bf16: bf16)
    dtype = running_mean.dtype if isinstance(running_mean, torch.Tensor) else mean.dtype
    empty = _record(aten.new_zeros.default, x, [0], dtype=dtype)
    return out, empty, _record(aten.new_zeros.default, x, [0], dtype=dtype)


def _cudnn_batch_norm(func, args, kwargs):
    """On CUDA, F.batch_norm picks cudnn_batch_norm, whose schema hides its writes to the running
    statistics too. Recorded as torch's own decomposition of it: native_batch_norm (rewritten above into
    the op whose schema declares the writes) and the empty tensors cuDNN returns, exactly the ops a step
    recorded with symbolic sizes sees (torch's Python dispatcher decomposes cudnn_batch_norm there), so
    that both kinds of step match. Its 4th output (cuDNN's reserve space) is only passed back to the
    backward, which is rewritten below."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training",
             "exponential_average_factor", "epsilon")
    v = dict(zip(names, args))
    v.update(kwargs)
    x, w = v["input"], v["weight"]
    out, mean, invstd = aten.native_batch_norm.default(x, w, v["bias"], v["running_mean"], v["running_var"],
                                                       v["training"], v["exponential_average_factor"],
                                                       v["epsilon"])
    # the arguments as torch's decomposition passes them (`t.new_zeros((0,))` adds pin_memory=False):
    # other constants would be other entries
    if v["training"]:
        return out, mean, invstd, aten.new_zeros.default(x, (0,), dtype=torch.uint8, pin_memory=False)
    return (out, aten.new_zeros.default(w, (0,), pin_memory=False), aten.new_zeros.default(w, (0,), pin_memory=False),
            aten.new_zeros.default(x, (0,), dtype=torch.uint8, pin_memory=False))


def _cudnn_batch_norm_backward(func, args, kwargs):
    names = ("input", "grad_output", "weight", "running_mean", "running_var", "save_mean", "save_var",
             "epsilon", "reserveSpace")
    v = dict(zip(names, args))
    v.update(kwargs)
    # cuDNN's save_var holds the inverse standard deviation, as native_batch_norm's save_invstd does
    return aten.native_batch_norm_backward.default(
        v["grad_output"], v["input"], v["weight"], v["running_mean"], v["running_var"], v["save_mean"],
        v["save_var"], True, v["epsilon"], [True, v["weight"] is not None, v["weight"] is not None])


def _inplace_metadata(view_op):
    """`x.squeeze_(0)` and friends (torch.matmul of a 1-D tensor ends with one) change a tensor's sizes in
    place: the out-of-place view is recorded (or taken of the device data), the wrapper's own sizes are
    changed the way torch changes those of a wrapper subclass (`return_and_correct_aliasing`: the op
    run on the wrapper itself, on meta), and the wrapper takes the view's place."""
    def rewrite(func, args, kwargs):
        target = args[0]
        if not isinstance(target, LazyTensor):
            return NotImplemented
        view = view_op(*args, **kwargs)
        with no_dispatch():
            meta_in_tls = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
        RECORDER.adopt(target, view)
        return target
    return rewrite


def _set_tensor(func, args, kwargs):
    """`x.set_(y)`: x holds y's data, in y's layout and on its storage, from now on. Run eagerly on the
    device data, the wrapper kept its sizes and the values it was recorded with: reads disagreed with
    what x computed. Here x takes the place of an alias of y, its sizes changed as for the in-place view
    ops above (an eager `y` is wrapped without a copy)."""
    target, source = args[0], args[1]
    if not isinstance(target, LazyTensor) or kwargs:
        return NotImplemented
    if not isinstance(source, LazyTensor):
        source = to_lazy(source)
    alias = aten.alias.default(source)
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(target, source)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    target._storage = alias._storage
    RECORDER.adopt(target, alias)
    return target


def _set_storage(func, args, kwargs):
    """`x.set_(storage, offset, size, stride)`: as `x.set_(y)` for `y` the eager tensor over that storage."""
    target = args[0]
    if not isinstance(target, LazyTensor):
        return NotImplemented
    names = ("source", "storage_offset", "size", "stride")
    bound = dict(zip(names, args[1:]))
    bound.update(kwargs)
    storage = bound["source"]
    with no_dispatch():
        source = torch.empty(0, dtype=target.dtype, device=storage.device)
        if "storage_offset" in bound:
            stride = bound.get("stride") or contiguous_strides(bound["size"])
            source.set_(storage, bound["storage_offset"], bound["size"], stride)
        else:
            source.set_(storage)
    return _set_tensor(aten.set_.source_Tensor, (target, source), {})


def _resize(func, args, kwargs):
    """`x.resize_(size)`: a no-op at the same size, a view (taking the tensor's place, as above) at the
    same number of elements of a contiguous tensor; anything else would need new storage under a
    wrapper whose sizes torch fixed when it was made: a clear error instead of a silently stale shape."""
    target, size = args[0], tuple(args[1])
    if not isinstance(target, LazyTensor):
        return NotImplemented
    if size == tuple(target.shape):
        return target
    if math.prod(size) == target.numel() and target.is_contiguous():
        return _inplace_metadata(lambda t, s, **_: aten.view.default(t, s))(func, (target, list(size)), {})
    raise RuntimeError(
        "pydisc: resize_ of a lazy tensor from %s to %s changes its number of elements, which a lazy tensor "
        "cannot do in place; make a new tensor instead (x = x.new_empty(size)), or resize an eager "
        "tensor (x.cpu() or after pydisc.mark_step())" % (tuple(target.shape), size))


def _same_arguments(op, packet):
    """The overload of `packet` that takes the arguments `op` takes (transpose_.default: transpose.int)."""
    types = [str(a.type) for a in op._schema.arguments]
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        if [str(a.type) for a in candidate._schema.arguments] == types:
            return candidate
    return None


def _dtype_checked(then=None):
    """Eager's exception where an op whose meta function accepts mixed dtypes gets tensors eager's kernel
    refuses (`dtype_checks`), at the op's line; else the op's other rewrite, if any."""
    def rewrite(func, args, kwargs):
        error = eager_dtype_error(func, args, kwargs)
        if error is not None:     # (each raise with a traceback of its own)
            raise error.with_traceback(None)
        return then(func, args, kwargs) if then is not None else NotImplemented
    return rewrite


def install_rewrites() -> None:
    r = REWRITES
    for base in ("mul", "div"):
        for inplace in ("", "_"):
            packet = getattr(aten, base + inplace)
            rw = _binary_scalar(packet.Tensor)
            r[packet.Tensor] = rw
            r[packet.Scalar] = rw
    for base in ("add", "sub"):
        for inplace in ("", "_"):
            packet = getattr(aten, base + inplace)
            r[packet.Tensor] = _alpha(packet.Tensor)
    for inplace in ("", "_"):
        lerp = getattr(aten, "lerp" + inplace)
        r[lerp.Scalar] = _lerp(lerp.Tensor)
        add = getattr(aten, "add" + inplace).Tensor
        r[getattr(aten, "addcmul" + inplace).default] = _addc(aten.mul.Tensor, add)
        r[getattr(aten, "addcdiv" + inplace).default] = _addc(aten.div.Tensor, add)
    r["_foreach_"] = record_foreach     # matched by name: aten's namespace loads ops lazily
    optimizers_take_their_foreach_path()
    optimizer_step.install()     # (after the foreach hooks: its key reads the `foreach` they set)
    r[aten.native_batch_norm.default] = _batch_norm
    r[aten._native_batch_norm_legit.default] = _batch_norm_eval_cpu
    r[aten._native_batch_norm_legit_no_training.default] = _batch_norm_eval_cpu
    for name in ("squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_"):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            view = _same_arguments(getattr(packet, overload), getattr(aten, name[:-1]))
            if view is not None:
                r[getattr(packet, overload)] = _inplace_metadata(view)
    # conjugate and negative views are flag bits on a tensor, which a layout-only view cannot carry
    r[aten._conj.default] = lambda func, args, kwargs: aten.conj_physical.default(*args, **kwargs)
    r[aten._neg_view.default] = lambda func, args, kwargs: aten.neg.default(*args, **kwargs)
    r[aten.resize_.default] = _resize
    r[aten.set_.source_Tensor] = _set_tensor
    r[aten.set_.source_Storage] = _set_storage
    r[aten.set_.source_Storage_storage_offset] = _set_storage
    r[aten.cudnn_batch_norm.default] = _cudnn_batch_norm
    r[aten.cudnn_batch_norm_backward.default] = _cudnn_batch_norm_backward
    for name in EAGER_DTYPE_CHECKS:    # (last: around the rewrites above)
        packet = getattr(aten, name, None)
        for overload in (packet.overloads() if packet is not None else ()):
            if "out" not in overload:
                op = getattr(packet, overload)
                r[op] = _dtype_checked(r.get(op))
