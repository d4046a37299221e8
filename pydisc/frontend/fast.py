"""Training steps recorded at `__torch_function__`, differentiated when the step is planned.

For lazy modules on the devices `PYDISC_FAST_RECORD` names (all by default), a forward that records
gradients is recorded as the calls user code makes (`F.linear`, `F.scaled_dot_product_attention`,
`x + y`, views, ...), not as the ATen ops they and their backward expand into: this module's
`__torch_function__` handler appends each call to the open `Segment` (frontend/segment.py), and
`loss.backward()` turns the segment into one `FusedStep` entry of the step's trace (frontend/fused.py),
whose outputs are the parameters' gradients and the values still alive. The rest of the step
(optimizer, `zero_grad`) is recorded at the ATen level as before.

What the handler cannot follow demotes the segment (`Segment.demote`): its calls are run again through
the ATen-level recorder, with autograd, and every fast value still held forwards (`_redirect`) to its
ATen-level counterpart. A demoted step is as if the fast path had been off: slower, never different.
Causes (each counted in `metrics()["fast_demotions"]`, listed in docs/fast_recording.md): reads of
random values before `mark_step`, data-dependent shapes, writes into tensors the forward did not make,
`autograd.Function`s (so module backward hooks and reentrant checkpointing), tensor hooks, `backward`
with arguments, `torch.autograd.grad`, functorch transforms, autocast of another device. Segments are
not started under DDP or foreign dispatch modes, nor where the step driver's gate says no (a model's
dynamic-shape steps of input sizes not seen before: pydisc/driver/dynamic.py).
"""
from __future__ import annotations

import threading

import torch

from .. import metrics as _metrics
from . import inference
from ..config import applies
from .lazy_tensor import RECORDER, LazyTensor, materialize
from .symbolic import own_modes
from .fused import Demote, FusedStep
from .fast_state import FAST, GIVE_UP_AFTER
from .segment import Segment

__all__ = ["install", "uninstall", "installed", "arm", "flush", "read", "resolve", "refuse", "set_gate",
           "set_default", "FusedStep"]

METRICS = _metrics.METRICS
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_thread = threading.get_ident
_functorch = torch._C._are_functorch_transforms_active
_modes = torch._C._len_torch_dispatch_stack
_Tensor = torch.Tensor

# Calls the wrapper answers by itself (metadata), without recording.
_METADATA = {getattr(_Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "ndim", "is_cuda", "is_cpu", "layout", "is_sparse", "is_quantized", "is_meta",
    "is_nested", "names", "itemsize", "is_mkldnn", "is_xpu", "is_mps") if hasattr(_Tensor, name)} | {
    getattr(_Tensor, name) for name in (
        "size", "dim", "stride", "numel", "nelement", "element_size", "is_contiguous", "is_floating_point",
        "is_complex", "storage_offset", "get_device", "__len__", "ndimension", "is_signed", "has_names",
        "is_inference", "__hash__", "dim_order") if hasattr(_Tensor, name)}
_REQUIRES_GRAD = _Tensor.requires_grad.__get__
_IS_LEAF = _Tensor.is_leaf.__get__
_GRAD_FN = _Tensor.grad_fn.__get__
_GRAD = _Tensor.grad.__get__
_BACKWARDS = {_Tensor.backward, torch.autograd.backward}
_REQUIRES_GRAD_ = _Tensor.requires_grad_
_SETS_REQUIRES_GRAD = {_REQUIRES_GRAD_, _Tensor.requires_grad.__set__}
_RAW_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_     # (called with torch functions off)
_READS_OF_AUTOGRAD = {_REQUIRES_GRAD, _IS_LEAF, _GRAD_FN, _GRAD}


def set_gate(fn) -> None:
    FAST.gate = fn


def set_default(scope: str) -> None:
    """Which devices' lazy modules record fast unless they say otherwise: "all", "cpu", "cuda", "off"."""
    FAST.default = scope


def arm(module_choice: bool | None = None, device: torch.device | None = None,
        module: torch.nn.Module | None = None) -> None:
    """A lazy module's forward begins (its input hook): with grad on, its calls open a segment, if the
    module's choice (`pydisc.lazy(..., fast_record=)`, None: the process's default for `device`) is to
    record fast, and unless the module's forwards in its current mode (training or eval) were demoted at
    `GIVE_UP_AFTER` steps in a row: the same code would be recorded twice again (BatchNorm's running
    statistics in training), so it is recorded op by op at once."""
    if module_choice is None:
        module_choice = device is not None and applies(FAST.default, device)
    if not module_choice:
        return
    grad = _grad_enabled()
    if grad and FAST.segment is None and module is not None and \
            FAST.demoted_in_a_row.get(module, {}).get(module.training, 0) >= GIVE_UP_AFTER:
        METRICS.fast_skipped += 1
        return
    if not FAST.installed:
        install(default=False)
    me = _thread()
    with FAST.lock:
        owner = FAST.owner
        if owner is not None and owner != me and (FAST.segment is not None or FAST.armed):
            return      # another thread's forward is recorded fast: this one's calls take the dispatcher's path
        _handler_on()
        if FAST.segment is None and grad:
            FAST.owner = me         # (an idle owner, after a demoted segment, is taken over)
            FAST.armed = True
            FAST.armed_by = (module, module.training) if module is not None else None


def refuse(reason: str) -> None:
    """A fused step could not be planned: the process records op by op from now on."""
    if FAST.refused is None:
        FAST.refused = reason
        METRICS.fast_demotions[reason] += 1


def _can_start() -> bool:
    if FAST.refused is not None or FAST.demoted or RECORDER.passthrough or _functorch() or \
            _modes() != own_modes():
        return False
    # (the gate before a symbolic step's refusal: it notes a step kept off for its new sizes, dynamic.py)
    if FAST.gate is not None and not FAST.gate() or RECORDER.symbolic is not None:
        return False
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized())


def _asks_grad(args, kwargs) -> bool:
    """`requires_grad_`'s flag: its second argument, `requires_grad=`, True by default."""
    if len(args) > 1:
        return bool(args[1])
    return bool((kwargs or {}).get("requires_grad", True))


def _device_of(args) -> torch.device | None:
    for a in args:
        if type(a) is LazyTensor:
            return a.device
        if type(a) is list or type(a) is tuple:
            d = _device_of(a)
            if d is not None:
                return d
    return None


def _has_fast(a) -> bool:
    t = type(a)
    if t is LazyTensor:
        return a._fid is not None or a._redirect is not None
    if t is list or t is tuple or isinstance(a, (list, tuple)):     # (a namedtuple, a list subclass)
        return any(_has_fast(x) for x in a)
    return False


def _has_redirect(args) -> bool:
    return any(type(a) is LazyTensor and a._redirect is not None for a in args)


def _redirect_of(t: LazyTensor) -> LazyTensor:
    while t._redirect is not None:
        t = t._redirect
    return t


def _resolved(a):
    t = type(a)
    if t is LazyTensor:
        return resolve(a)
    if t is list or t is tuple:
        return t(_resolved(x) for x in a)
    if t is dict:
        return {k: _resolved(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)) and _has_fast(a):
        items = [_resolved(x) for x in a]
        if hasattr(a, "_fields"):
            return t(*items)        # a namedtuple
        try:
            return t(items)
        except Exception:           # noqa: BLE001 - a subclass with a constructor of its own: torch takes a plain one
            return list(items) if isinstance(a, list) else tuple(items)
    return a


def read(t: LazyTensor) -> torch.Tensor:
    """Device data of a fast value read before mark_step (`print(x)`, `x.tolist()`): computed by torch now
    where it can be, else its segment is demoted and the ATen-level tensor's data is read."""
    seg = t._fseg
    if t._fid is not None and seg is not None and seg is FAST.segment:
        with _NO_SUBCLASS():
            try:
                return seg.evaluate([t._fid])[t._fid]
            except Demote as exc:
                seg.demote(str(exc))
    elif t._fid is None and t._redirect is None and t._storage.fast_written:
        # an input the open forward wrote (a BatchNorm's running mean), read by a way around the handler:
        # its new data is recorded by the dispatcher first
        if FAST.segment is not None:
            FAST.segment.demote("a read of an input the forward wrote")
        t._storage.fast_written = False
    return materialize(resolve(t))


def resolve(t: LazyTensor, reason: str = "a value of the step used where the fast recorder cannot follow it"
            ) -> LazyTensor:
    """The ATen-level tensor a fast value stands for, demoting its segment first if it is open."""
    if t._fid is not None:
        seg = t._fseg
        if seg is not None and seg is FAST.segment:
            seg.demote(reason)
    return _redirect_of(t)


def _dispatched(args, kwargs):
    """(args, kwargs) of an op that reached the dispatcher (`Recorder.dispatch`) with fast values, which
    their handler did not see: a functorch transform (`torch.vmap`) wraps them in tensors of its own and
    hands the ops on unwrapped. As in `_default`, their segment is demoted and they stand for their
    ATen-level tensors. None where the op has none."""
    if FAST.segment is None and not FAST.redirected:
        return None
    if not (_has_fast(args) or (kwargs and _has_fast(tuple(kwargs.values())))):
        return None
    seg = FAST.segment
    if seg is not None and _grad_enabled() and _needs_grad(seg, (args, tuple((kwargs or {}).values()))):
        # Autograd has let the op pass without a node (it saw tensors that need no gradient): its
        # result would carry none, and the parameters behind it would get no gradient.
        seg.demote("a functorch transform or a dispatch mode")
        FAST.give_up(seg.armed_by)
        raise RuntimeError(
            "pydisc: a value of a forward recorded at __torch_function__ reached torch's dispatcher without "
            "passing pydisc's handler (a functorch transform such as torch.vmap inside the forward): its "
            "gradients would be lost. This model's forwards are recorded op by op from the next one on; to "
            "record it so from the start, use pydisc.lazy(model, fast_record=False) or PYDISC_FAST_RECORD=0.")
    return _resolved(args), (_resolved(kwargs) if kwargs else kwargs)


def _needs_grad(seg: Segment, a) -> bool:
    """Whether `a` holds a value of `seg` that requires grad."""
    t = type(a)
    if t is LazyTensor:
        return a._fid is not None and a._fseg is seg and seg.rg[a._fid]
    if isinstance(a, (list, tuple)):
        return any(_needs_grad(seg, x) for x in a)
    return False


def _set_data(t: LazyTensor, value):
    """`t.data = value` (Recorder.set_data) with fast recording installed: a segment open on this thread is
    demoted first (its calls read what `t` held until now, or `value` is one of its values), and values of
    a demoted segment stand for the ATen-level tensors they forward to."""
    seg = FAST.segment
    if seg is not None and FAST.owner == _thread():
        seg.demote(_AUTOGRAD_STATE[_Tensor.data.__set__])
    return _resolved(t), _resolved(value)


def flush() -> bool:
    """At mark_step: the open segment (a forward with no backward) becomes an entry of the trace. Returns
    whether a segment of this thread's step was demoted (its forward recorded twice: step_choice.py)."""
    me = _thread()
    owner = FAST.owner
    if owner == me:
        seg = FAST.segment
        if seg is not None:
            with _NO_SUBCLASS():
                try:
                    seg.close(None)
                except Demote as exc:
                    seg.demote(str(exc))
    elif owner is not None:
        return False    # another thread's forward is being recorded: it ends with its own backward or mark
    demoted = False
    with FAST.lock:
        if FAST.owner is None or FAST.owner == me:
            demoted = FAST.demoted
            FAST.demoted = FAST.armed = False
    park()
    return demoted


def _default(func, args, kwargs):
    # fast values exist only in an open segment, or forward to a demoted step's tensors
    if (FAST.segment is not None or FAST.redirected) and (
            _has_fast(args) or (kwargs and _has_fast(tuple(kwargs.values())))):
        args = _resolved(args)
        kwargs = _resolved(kwargs) if kwargs else kwargs
    with _NO_SUBCLASS():
        return func(*args, **(kwargs or {}))


def _torch_function(cls, func, types, args=(), kwargs=None):
    with _NO_SUBCLASS():    # the handler's own reads of lazy tensors do not come back here
        if func in _METADATA:
            if FAST.redirected and _has_redirect(args):
                # a value of a demoted step answers for the tensor it stands for: an in-place view op
                # (`h.unsqueeze_(0)`, which demotes) changed that tensor's sizes, not the wrapper's
                args = tuple(_redirect_of(a) if type(a) is LazyTensor else a for a in args)
            return func(*args, **(kwargs or {}))
        # `segment` and `armed` are the owning thread's, changed by it alone: another thread's calls neither
        # open a segment nor read or change that one
        mine = FAST.owner == _thread()
        seg = FAST.segment if mine else None
        if func in _AUTOGRAD_STATE:
            x = args[0] if args else None
            if seg is not None and type(x) is LazyTensor and x._fid is not None and x._fseg is seg:
                # (compared with ==: each access makes a new method-wrapper)
                if func == _REQUIRES_GRAD:
                    return seg.rg[x._fid]
                if func == _IS_LEAF:
                    return not seg.rg[x._fid]
                if func == _REQUIRES_GRAD_ and seg.rg[x._fid] and _asks_grad(args, kwargs):
                    return x        # already requires grad (HF's `enable_input_require_grads` hook): eager's no-op
                # grad_fn (module backward hooks read it to attach theirs), .grad, hooks: not followed
                seg.demote(_AUTOGRAD_STATE[func])
            elif seg is not None and func not in _READS_OF_AUTOGRAD and func != _GRAD_SET:
                seg.demote(_AUTOGRAD_STATE[func])     # a hook or requires_grad change on a parameter
            result = _default(func, args, kwargs)
            if func in _SETS_REQUIRES_GRAD and type(x) is LazyTensor and x._redirect is not None:
                # set on the tensor the value stands for: its wrapper's own flag follows (Segment.demote)
                _RAW_REQUIRES_GRAD_(x, _redirect_of(x).requires_grad)
                return x if func == _REQUIRES_GRAD_ else result     # (`requires_grad_` returns its tensor)
            return result
        if seg is None:
            if FAST.redirected and (_has_fast(args) or (kwargs and _has_fast(tuple(kwargs.values())))):
                return _default(func, args, kwargs)     # values of a demoted step
            if not _grad_enabled():
                return inference._torch_function(cls, func, types, args, kwargs)
            if not mine or not FAST.armed or func in _BACKWARDS or func is torch.autograd.grad:
                return _default(func, args, kwargs)
            if not _can_start():
                # the forward is recorded op by op: a segment opened by a later call would take this
                # one's results, with their autograd history, as inputs (and demote)
                FAST.armed = False
                return _default(func, args, kwargs)
            device = _device_of(args) or _device_of(tuple((kwargs or {}).values()))
            if device is None:
                return _default(func, args, kwargs)
            seg = FAST.segment = Segment(device, FAST.armed_by)
            FAST.armed_by = None
            FAST.armed = False
        try:
            if func in _BACKWARDS:
                return _backward(seg, func, args, kwargs)
            if func is torch.autograd.grad:
                raise Demote("torch.autograd.grad")
            if _functorch() or _modes() != own_modes():
                raise Demote("a functorch transform or a dispatch mode")
            return seg.record(func, args, kwargs)
        except Demote as exc:
            if FAST.segment is seg:
                seg.demote(str(exc))
            return _default(func, args, kwargs)


def _backward(seg: Segment, func, args, kwargs):
    names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs") \
        if func is torch.autograd.backward else ("self", "gradient", "retain_graph", "create_graph", "inputs")
    bound = dict(zip(names, args))
    bound.update(kwargs or {})
    loss = bound.get(names[0])
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    if type(loss) is not LazyTensor or loss._fid is None or loss._fseg is not seg:
        raise Demote("backward of a value the segment did not make")
    if bound.get("gradient") is not None or bound.get("retain_graph") or bound.get("create_graph") or \
            bound.get("inputs") is not None or bound.get("grad_tensors") is not None or \
            bound.get("grad_variables") is not None:
        raise Demote("backward with arguments")
    size = seg.metas[loss._fid][0]
    if not seg.rg[loss._fid] or any(s != 1 for s in size):
        raise Demote("backward of a value eager refuses")
    seg.close(loss)
    park()
    return None


_GRAD_SET = _Tensor.grad.__set__
# Calls about autograd's state: answered for fast values, demoting where the segment cannot follow them.
_AUTOGRAD_STATE = {
    _REQUIRES_GRAD: "requires_grad", _IS_LEAF: "is_leaf", _GRAD_FN: "grad_fn", _GRAD: "grad",
    _GRAD_SET: "a .grad written",
    _Tensor.register_hook: "tensor hooks",
    _Tensor.retain_grad: "retain_grad",
    _Tensor.requires_grad_: "requires_grad_",
    _Tensor.requires_grad.__set__: "requires_grad written",
    _Tensor.data.__set__: ".data written",
}
if hasattr(_Tensor, "register_post_accumulate_grad_hook"):
    _AUTOGRAD_STATE[_Tensor.register_post_accumulate_grad_hook] = "tensor hooks"


_INSTALLED = classmethod(_torch_function)
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


def _apply(cls, *args, **kwargs):
    """`autograd.Function.apply`: its backward is its own, which a fast segment cannot follow."""
    seg = FAST.segment
    if seg is not None and FAST.owner == _thread():
        # even on parameters alone: its forward's calls would be recorded without its backward
        seg.demote("autograd.Function (%s)" % cls.__name__)
    if _has_fast(args) or _has_fast(tuple(kwargs.values())):
        args, kwargs = _resolved(args), _resolved(kwargs)
    return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)


def installed() -> bool:
    return FAST.installed


def _handler_on() -> None:
    if LazyTensor.__dict__.get("__torch_function__") is not _INSTALLED:
        LazyTensor.__torch_function__ = _INSTALLED


def park() -> None:
    """Take the handler off the class until the next lazy forward (`arm`), where nothing needs it: no
    segment open or armed, no value of a demoted segment around. Every call and attribute read on a lazy
    tensor passes through a Python `__torch_function__` (~2 us, against ~0.2 us without one), and
    between forwards there are many: the optimizer's and `zero_grad`'s reads and writes of `.grad`,
    `mark_step`'s binding. The calls that follow go to the dispatcher as they would with fast recording
    off; a forward without grad turns the handler on too (`inference`), until the next `mark_step`."""
    with FAST.lock:
        if FAST.owner == _thread() and FAST.segment is None and not FAST.armed:
            FAST.owner = None
        if FAST.installed and FAST.owner is None and not FAST.still_redirected() and \
                LazyTensor.__dict__.get("__torch_function__") is _INSTALLED:
            _restore_class_handler()


def _restore_class_handler() -> None:
    if inference._DISABLED is None:
        del LazyTensor.__torch_function__
    else:
        LazyTensor.__torch_function__ = inference._DISABLED


def install(default: bool = True) -> None:
    """Record gradient-recording forwards at `__torch_function__` from now on (PYDISC_FAST_RECORD=1);
    `default`: for every lazy module, else only for those that ask for it."""
    if default:
        FAST.default = "all"
    FAST.refused = None
    FAST.installed = True
    LazyTensor.__torch_function__ = _INSTALLED
    torch.autograd.Function.apply = classmethod(_apply)
    inference.pin(_handler_on)
    RECORDER.fast_read = read
    RECORDER.fast_set_data = _set_data
    RECORDER.fast_dispatched = _dispatched


def uninstall() -> None:
    """Every op through the dispatcher again (a step in progress is ended first by `flush`)."""
    flush()
    FAST.default = "off"
    FAST.installed = False
    if LazyTensor.__dict__.get("__torch_function__") is _INSTALLED:
        _restore_class_handler()
    torch.autograd.Function.apply = _ORIGINAL_APPLY
    inference.pin(None)
