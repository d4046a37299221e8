"""The lazy tensor: a torch tensor subclass whose ATen ops are recorded, not run.

`LazyTensor.__torch_dispatch__` hands every op to `Recorder.dispatch`, one ordered decision ladder:

1. ops that need data (`.item()`, `bool()`, a copy to another device, a write into an eager tensor) run
   eagerly on materialized inputs;
2. rewrites: Python scalars that vary between steps (learning rates, bias corrections) become lifted
   scalar inputs (`frontend/rewrites.py`), so one compiled step serves every value, and a `_foreach_*`
   op becomes one entry that runs per tensor when replayed (`frontend/foreach.py`);
3. views of materialized tensors are taken at once on the device data;
4. everything else is recorded, with output metadata from torch's meta kernels (cached per op and input
   layout), and falls back to eager when no meta kernel can say what the output looks like.

Running the pending trace is the job of a higher layer, which installs itself with `install_driver`.
"""
from __future__ import annotations

import gc
import time
import threading
import weakref
from typing import Any, Callable

import torch

from .. import metrics as _metrics
from ..config import CONFIG
from .source import user_source
from .symbolic import SymArg, SymbolicStep, hint
from .trace import OUT_KINDS, VALUE_REFS, VALUE_SIGS, Entry, LazyStorage, Trace, ValueRef, grow_values, out_kind

__all__ = ["StrictModeError", "LazyTensor", "is_lazy", "to_lazy", "materialize", "current_trace", "install_driver", "Recorder",
           "LiftedScalar", "liftable", "RECORDER"]

aten = torch.ops.aten
METRICS = _metrics.METRICS


class StrictModeError(RuntimeError):
    """PYDISC_STRICT=1 and a step fell back to eager or read a value before mark_step."""


class LiftedScalar:
    """A Python number that becomes a scalar input of the step instead of a compile-time constant."""

    __slots__ = ("value",)

    def __init__(self, value: float) -> None:
        self.value = value


_LIFTABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def liftable(t, value) -> bool:
    """Can the Python float `value`, an operand of an arithmetic op on `t`, become a `LiftedScalar`?"""
    # a 0-d half tensor times a 0-d float32 tensor would promote to float32, unlike times a Python float
    return isinstance(t, LazyTensor) and type(value) is float and \
        (t.dtype is torch.float32 or (t.dtype in _LIFTABLE_DTYPES and t.dim() > 0))


def _flat_base(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `t` (offset 0), the form in which storages are kept."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t.detach().reshape(-1)
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.detach().as_strided((n,), (1,), 0)


def _view_of_base(base: torch.Tensor, size, stride, offset) -> torch.Tensor:
    if offset == 0 and base.numel() == _numel(size) and tuple(stride) == _contiguous_strides(size):
        return base.view(size)
    return base.as_strided(size, stride, offset)


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _contiguous_strides(size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


_make_wrapper = torch.Tensor._make_wrapper_subclass


class LayoutKey:
    """One per distinct (size, stride, offset, dtype, storage bytes, device): a lazy tensor's part of
    the meta-cache key. It hashes and compares by identity, which is cheaper than the tuple, and it is
    made once per tensor (recorded outputs take it from their op's `Recipe`). Not an int, so that a
    tensor and an int constant in the same argument position never look alike."""

    __slots__ = ("layout",)

    def __init__(self, layout: tuple) -> None:
        self.layout = layout

    def __repr__(self) -> str:
        return "LayoutKey%r" % (self.layout,)


_LAYOUT_KEYS: dict[tuple, LayoutKey] = {}


def _layout_key(size: tuple, stride: tuple, offset: int, dtype: torch.dtype, nbytes: int, device) -> LayoutKey:
    layout = (size, stride, offset, dtype, nbytes, device)
    key = _LAYOUT_KEYS.get(layout)
    if key is None:
        key = _LAYOUT_KEYS[layout] = LayoutKey(layout)
    return key


class LazyTensor(torch.Tensor):
    """A tensor whose value is either device data (`_real`) or a value of the pending trace."""

    _storage: LazyStorage
    _mk: LayoutKey          # this step's concrete layout, as a meta-cache key part
    # Defaults, set on the instance only where they differ (recorded outputs set the fewest attributes).
    _real: torch.Tensor | None = None
    _vid: int = -1
    _epoch: int = -1
    _fake = None            # fake tensor of a symbolic step (`frontend/symbolic.py`)
    _fake_sid: int = 0      # ... and which step it belongs to
    _concrete: tuple | None = None   # this step's concrete (size, stride, offset) when sizes are symbolic
    # A fast value (frontend/fast.py): its id in the open segment, and the segment; or, once that
    # segment was demoted, the ATen-level tensor it stands for.
    _fid: int | None = None
    _fseg = None
    _redirect = None

    @staticmethod
    def __new__(cls, size, stride, offset, dtype, device, storage: LazyStorage, real=None, requires_grad=False):
        t = _make_wrapper(cls, size, strides=stride, storage_offset=offset, dtype=dtype, device=device,
                          requires_grad=requires_grad)
        t._storage = storage
        if real is not None:
            t._real = real
        if RECORDER.symbolic is not None and (  # only a symbolic step makes symbolic sizes
                any(type(x) is not int for x in size) or any(type(x) is not int for x in stride)
                or type(offset) is not int or type(storage.nbytes) is not int):
            # sizes of a symbolic step: keep this step's concrete layout for everything concrete
            t._concrete = concrete = (tuple(map(hint, size)), tuple(map(hint, stride)), hint(offset))
            t._mk = _layout_key(*concrete, dtype, hint(storage.nbytes), t.device)
        else:
            nbytes = storage.nbytes       # symbolic in a storage made by an earlier symbolic step
            t._mk = _layout_key(tuple(size), tuple(stride), offset, dtype,
                               nbytes if type(nbytes) is int else hint(nbytes), t.device)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return RECORDER.dispatch(func, args, kwargs or {})

    # Reading a value runs what it needs. These bypass the dispatcher, so they are overridden here.
    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(materialize(self, reason="repr"))

    def __format__(self, spec: str) -> str:
        return format(materialize(self, reason="format"), spec)

    def data_ptr(self) -> int:
        return materialize(self, reason="data_ptr").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        # the wrapper's own storage has no data (torch: "data is not allocated yet"): the device data's
        return materialize(self, reason="untyped_storage").untyped_storage()

    def tolist(self):
        return materialize(self, reason="tolist").tolist()

    def numpy(self, *, force: bool = False):
        return materialize(self, reason="numpy").detach().cpu().numpy(force=force)

    def cpu(self, memory_format=torch.preserve_format):
        return materialize(self, reason="cpu").cpu(memory_format=memory_format).clone() \
            if self.device.type == "cpu" else materialize(self, reason="cpu").cpu(memory_format=memory_format)

    def __array__(self, dtype=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __reduce_ex__(self, proto):
        # torch.save / pickle / deepcopy store the device data as a plain tensor.
        real = materialize(self, reason="pickle").detach()
        if isinstance(self, torch.nn.Parameter):
            return (torch.nn.Parameter, (real.clone(), self.requires_grad))
        return real.clone().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        real = materialize(self, reason="deepcopy").detach().clone()
        out = to_lazy(real)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out


def is_lazy(t: Any) -> bool:
    """True if `t` is a pydisc lazy tensor."""
    return isinstance(t, LazyTensor)


def to_lazy(real: torch.Tensor, *, step_input: bool = False) -> LazyTensor:
    """Wrap device data as a (materialized) lazy tensor, without a copy.

    `step_input`: `real` is an input of the step (a module input, `pydisc.to_lazy`): its dims may be
    dynamic (`pydisc.mark_dynamic`, or seen to change between steps), in which case the step is
    recorded with symbolic sizes."""
    if isinstance(real, LazyTensor):
        return real
    storage = LazyStorage(real.untyped_storage().nbytes(), _flat_base(real))
    # an input that requires grad is a leaf of the step's graph; mark_step hands its gradient on to
    # `real` (`Recorder.grad_inputs`)
    grad = step_input and real.requires_grad and torch.is_grad_enabled()
    t = None
    if step_input:
        with RECORDER.lock:
            t = RECORDER.symbolic_input(real, storage, grad)
    if t is None:
        t = LazyTensor(tuple(real.shape), real.stride(), real.storage_offset(), real.dtype, real.device,
                       storage, real=real.detach(), requires_grad=grad)
    if grad:
        RECORDER.grad_inputs.append((real, t))
    return t


def _layout(t: LazyTensor) -> tuple:
    """(size, stride, offset) of `t` in this step's concrete numbers."""
    c = t._concrete
    return c if c is not None else (tuple(t.shape), t.stride(), t.storage_offset())


# --------------------------------------------------------------------------------------------------
# Schema facts per op, computed once.

class OpInfo:
    __slots__ = ("name", "returns", "written_args", "needs_eager", "is_view", "rewrite", "unruled")

    def __init__(self, func) -> None:
        # OpOverload hashes in Python: everything per op is looked up once by id() and kept here.
        self.name = str(func)
        self.rewrite = RECORDER.rewrites.get(func)
        if self.rewrite is None and RECORDER.foreach_rewrite is not None and func.__name__.startswith("_foreach_"):
            self.rewrite = RECORDER.foreach_rewrite
        if self.rewrite is None:   # whole namespaces: torch.distributed's (frontend/collectives.py)
            self.rewrite = RECORDER.namespace_rewrites.get(func.namespace)
        schema = func._schema
        sets: dict[str, tuple[int, str]] = {}
        written = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    sets[s] = (i, a.name)
                if a.alias_info.is_write:
                    written.append((i, a.name))
        returns = []
        for r in schema.returns:
            ai = r.alias_info
            if ai is not None and ai.before_set:
                i, name = sets[next(iter(ai.before_set))]
                returns.append(("write" if ai.is_write else "view", i, name))
            elif ai is not None and func.is_view:
                # `Tensor(a)[]` (split, unbind, chunk): the alias set sits on the list's elements, and
                # every element views the aliased argument
                i, name = next((i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None)
                returns.append(("view", i, name))
            else:
                returns.append(None)
        self.returns = returns
        self.written_args = tuple(written)
        self.is_view = any(r is not None and r[0] == "view" for r in returns)
        self.needs_eager = func in _EAGER_OPS or (not schema.returns and not written) \
            or any(str(r.type) not in _TENSOR_RETURN_TYPES for r in schema.returns)
        # neither a StableHLO rule nor a decomposition: a likely fallback, whose source line the ledger
        # wants even in steps recorded without source lines
        from .decompositions import DECOMPOSITIONS
        from .lowering.registry import LOWERINGS
        functional = func
        if schema.is_mutable and func._opname.endswith("_"):   # add_ is recorded, add is lowered
            packet = getattr(torch.ops.aten, func._opname[:-1], None)
            functional = getattr(packet, func._overloadname, func) if packet is not None else func
        # (composite ops, such as `linear` recorded whole in steps without grad, are split by torch)
        self.unruled = functional not in LOWERINGS and functional not in DECOMPOSITIONS and \
            not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


_TENSOR_RETURN_TYPES = {"Tensor", "List[Tensor]", "Tensor[]", "Optional[Tensor]", "Tensor?"}
# Ops that read data on the host, move data between devices, or change a tensor's metadata in place.
_EAGER_OPS = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.allclose.default,
    aten.nonzero.default, aten._unique2.default, aten.masked_select.default,
    aten.view.dtype, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
    aten.resize_.default, aten.as_strided_.default, aten._has_compatible_shallow_copy_type.default,
}
ABANDONED = ("pydisc: this lazy tensor has no data: the step that computes it was abandoned after an error. "
             "Recompute it (run the forward pass again) before using it.")
PRUNE_FIRST_AT = 10_000   # entries of a never-marked trace before the dead ones are first dropped
_OPINFO: dict[int, OpInfo] = {}    # id(OpOverload) -> facts; overloads live as long as the process


def _opinfo(func) -> OpInfo:
    info = _OPINFO.get(id(func))
    if info is None:
        info = _OPINFO[id(func)] = OpInfo(func)
    return info


def _arg(args, kwargs, index: int, name: str):
    return args[index] if index < len(args) else kwargs.get(name)


# --------------------------------------------------------------------------------------------------

class Recorder:
    """Owns the pending trace and records ops into it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.epoch = 0
        self.trace = Trace(epoch=0)
        self.meta_cache: dict[Any, Any] = {}
        self.executor: Callable[[LazyTensor | None, str], None] | None = None
        self.rewrites: dict[Any, Callable] = {}
        self.foreach_rewrite: Callable | None = None
        self.namespace_rewrites: dict[str, Callable] = {}   # op namespace -> rewrite of all its ops
        # Source lines cost 1-3 µs per op: captured for every op until a step reuses a plan, again
        # after a new plan; always for ops with no StableHLO rule (OpInfo.unruled), the likely fallbacks.
        self.capture_sources = True
        self.gc_paused = False
        # Dynamic shapes: `dims_of(ordinal, real)` says which dims of the ordinal-th step input are
        # dynamic (installed by pydisc/driver/dynamic.py); a step with any is recorded symbolically.
        self.dims_of: Callable[[int, torch.Tensor], tuple] | None = None
        # ... and `carried_dims(index, real)` which dims of the index-th input storage of the step, a
        # lazy tensor a previous step made (a KV cache that grows by a token each step), are dynamic;
        # installed only while some are (pydisc/driver/dynamic.py), so that ops of other steps pay nothing.
        self.carried_dims: Callable[[int, torch.Tensor], tuple] | None = None
        self.inputs_seen = 0
        self.input_shapes: list[tuple] = []    # shape of each step input, by ordinal
        self.last_input_shapes: list[tuple] = []   # ... of the step before
        self.step_id = 0                       # mark_step count (a step may span several traces)
        self.symbolic: SymbolicStep | None = None
        # A trace that is never marked: every time it doubles, `pruner` (installed by pydisc/driver/step.py)
        # drops the entries whose tensors have all died.
        self.pruner: Callable[[], None] | None = None
        self.prune_at = PRUNE_FIRST_AT
        # Every op runs at once in torch, nothing is recorded: a step measured faster eagerly than
        # compiled (pydisc/driver/step_choice.py), or the eager half of that measurement.
        self.passthrough = False
        # ... and the live lazy tensors were made plain (frontend/release.py): inputs stay plain too
        self.released = False
        # When the pending trace's first op was recorded, and the seconds its ops not seen before spent
        # in meta kernels: how long recording a step takes once its ops are all known (step_choice.py)
        self.trace_started = 0.0
        self.meta_seconds = 0.0
        # Step inputs that require grad, (the user's tensor, its lazy leaf): at mark_step the leaf's
        # gradient is passed on with `torch.autograd.backward(tensor, grad)` (pydisc/driver/step.py)
        self.grad_inputs: list[tuple[torch.Tensor, LazyTensor]] = []
        # frontend/fast.py, where installed: the device data of a fast value read before mark_step
        self.fast_read: Callable[[LazyTensor], torch.Tensor] | None = None

    def run(self, t: LazyTensor | None, reason: str) -> None:
        """Run the pending trace (all of it, or at least what `t` needs) through the driver's hook, for a
        read or an eager op. Often called inside a `__torch_dispatch__`, where torch has excluded
        autograd from the dispatch (`fused.FusedStep` turns it back on where it differentiates)."""
        self.executor(t, reason)

    def new_trace(self) -> Trace:
        """A fresh pending trace. Within a step (after a read ran everything recorded so far) the
        step's symbolic state carries over; `end_step` ends it."""
        self.epoch += 1
        self.prune_at = PRUNE_FIRST_AT
        self.trace = Trace(epoch=self.epoch)
        self.trace.symbolic = self.symbolic
        if self.gc_paused:      # after the old trace is let go of: what it alone held is freed first
            self.gc_paused = False
            gc.enable()
        return self.trace

    def end_step(self) -> None:
        """At mark_step: the next ops belong to a new step (new inputs, maybe other sizes)."""
        if self.symbolic is not None:
            self.symbolic.exit()
            self.symbolic = None
            self.trace.symbolic = None
        self.inputs_seen = 0
        self.last_input_shapes, self.input_shapes = self.input_shapes, []
        self.step_id += 1

    # ---- symbolic steps --------------------------------------------------------------------------
    def symbolic_input(self, real: torch.Tensor, storage: LazyStorage, requires_grad: bool) -> LazyTensor | None:
        ordinal = self.inputs_seen
        self.inputs_seen += 1
        storage.ordinal = ordinal
        self.input_shapes.append(tuple(real.shape))
        if self.dims_of is None:
            return None
        dims = self.dims_of(ordinal, real)
        if not dims or real.storage_offset() != 0 or not real.is_contiguous() or \
                real.untyped_storage().nbytes() != real.numel() * real.element_size():
            return None
        session = self.symbolic_session()
        size, stride, made = session.symbolic_layout(real, dims, ("conv", ordinal))
        if not made:
            return None
        session.conversions[ordinal] = (storage, made, real.dim())
        storage.nbytes = _numel(size) * real.element_size()
        t = LazyTensor(size, stride, 0, real.dtype, real.device, storage, real=real.detach(),
                       requires_grad=requires_grad)
        t._fake = session.fake_symbolic(size, stride, real.dtype, real.device)
        t._fake_sid = session.id
        return t

    def symbolic_session(self) -> SymbolicStep:
        """This step's SymbolicStep, started at its first symbolic input."""
        if self.symbolic is None:
            self.symbolic = SymbolicStep(self.record_factory)
            self.symbolic.enter()
            self.trace.symbolic = self.symbolic
        return self.symbolic

    def carried_input(self, t: LazyTensor, storage: LazyStorage) -> None:
        """`t`, the first tensor of this step to read `storage` (a previous step's result), gets symbolic
        sizes in the dims `carried_dims` names: its fake and concrete layout, not its Python sizes, which
        stay those of this step (code that reads a KV cache's length gets a number)."""
        real = t._real
        index = storage.input_index
        if real is None or real.storage_offset() != 0 or not real.is_contiguous() or \
                real.untyped_storage().nbytes() != real.numel() * real.element_size():
            return
        dims = self.carried_dims(index, real)
        if not dims:
            return
        session = self.symbolic_session()
        size, stride, made = session.symbolic_layout(real, dims, ("carried", index))
        if not made:
            return
        session.conversions[("carried", index)] = (storage, made, real.dim())
        t._fake = session.fake_symbolic(size, stride, real.dtype, real.device)
        t._fake_sid = session.id
        t._concrete = (tuple(real.shape), real.stride(), 0)

    def note_carried(self, args) -> None:
        """Before an op is recorded: its lazy arguments not read yet in this step get their input
        storage now, and with it any dynamic dims (`carried_input`), so that the op sees them."""
        epoch = self.trace.epoch
        for a in args:
            if type(a) is LazyTensor:
                if a._epoch != epoch and a._real is not None:
                    self.ref(a)
            elif type(a) is list or type(a) is tuple:
                self.note_carried(a)

    def fake_of(self, a):
        """The fake tensor standing for argument `a` in this symbolic step."""
        session = self.symbolic
        if isinstance(a, LazyTensor):
            if a._fake is None or a._fake_sid != session.id:
                size, stride, offset = _layout(a)
                a._fake = session.fake_static(size, stride, offset, a.dtype, a.device, hint(a._storage.nbytes))
                a._fake_sid = session.id
            return a._fake
        if isinstance(a, LiftedScalar):
            with session.faking():
                return torch.empty((), dtype=torch.float32)
        if isinstance(a, torch.Tensor):
            fake = session.real_fakes.get(id(a))
            if fake is None:
                # eager tensors keep static sizes: C++ compares them with lazy sizes before any
                # dispatch, which would pin a symbolic size anyway (pass them through to_lazy)
                fake = session.fake_static(tuple(a.shape), a.stride(), a.storage_offset(), a.dtype,
                                           a.device, a.untyped_storage().nbytes())
                session.real_fakes[id(a)] = fake
            return fake
        if isinstance(a, (list, tuple)):
            return type(a)(self.fake_of(x) for x in a)
        return a

    def record_factory(self, func, args, kwargs):
        with self.lock:
            return self.record(func, args, kwargs, _opinfo(func))

    # ---- value references ------------------------------------------------------------------------
    def ref(self, t: LazyTensor) -> ValueRef:
        trace = self.trace
        if t._epoch == trace.epoch:
            return ValueRef(t._vid)
        if t._real is None:
            if t._fid is not None or t._redirect is not None:
                raise RuntimeError("pydisc: a value recorded at __torch_function__ reached the dispatcher "
                                   "directly; set PYDISC_FAST_RECORD=0 and report this")
            raise RuntimeError(ABANDONED)
        storage = t._storage
        if storage.epoch != trace.epoch:
            storage.epoch = trace.epoch
            storage.creator = None
            storage.written = False
            storage.input_index = -1
        if storage.input_index < 0:
            storage.input_index = len(trace.storage_inputs)
            trace.storage_inputs.append(storage.real)
            trace.input_storages.append(storage)
            trace.storage_versions.append(storage.real._version)
            if self.carried_dims is not None and storage.produced == self.step_id - 1:
                self.carried_input(t, storage)
        concrete = t._concrete
        if concrete is not None and self.symbolic is not None:
            fake = t._fake if t._fake is not None and t._fake_sid == self.symbolic.id else t
            layout = (tuple(fake.shape), tuple(fake.stride()), fake.storage_offset())
            vid = trace.new_value(("in", storage.input_index, layout), storage, concrete + (t.dtype,))
            trace.sym_metas[vid] = layout + (t.dtype,)
        elif concrete is not None:
            vid = trace.new_value(("in", storage.input_index, concrete), storage, concrete + (t.dtype,))
        else:   # the layout key holds (size, stride, offset, dtype, ...): no calls into the tensor
            layout = t._mk.layout
            vid = trace.new_value(("in", storage.input_index, layout[:3]), storage, layout[:4])
        t._vid = vid
        t._epoch = trace.epoch
        trace.tensors[vid] = weakref.ref(t)
        return ValueRef(vid)

    def adopt(self, t: LazyTensor, view: LazyTensor) -> None:
        """`t`, whose sizes an in-place view op has just changed, becomes `view` (that op's out-of-place
        result, on the same storage): it holds the view's value from now on."""
        trace = self.trace
        if t._epoch == trace.epoch:
            ref = trace.tensors.get(t._vid)
            if ref is not None and ref() is t:
                del trace.tensors[t._vid]
        t._real, t._vid, t._epoch = view._real, view._vid, view._epoch
        t._fake, t._fake_sid, t._concrete, t._mk = view._fake, view._fake_sid, view._concrete, view._mk
        if view._epoch == trace.epoch:
            trace.tensors[view._vid] = weakref.ref(t)

    def is_clean(self, t: LazyTensor) -> bool:
        if t._real is None:
            return False
        s = t._storage
        return not (s.epoch == self.trace.epoch and s.written)

    # ---- the ladder ------------------------------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        # One lock serialises recording: autograd runs backward on its own thread per CUDA device, so
        # several threads legitimately record into one step; the lock keeps the trace consistent.
        with self.lock:
            info = _OPINFO.get(id(func))
            if info is None:
                info = _opinfo(func)
            if self.passthrough and not self.trace.entries:
                return self.run_eager(func, args, kwargs, info, fallback=False, count=False)
            if not self.trace.entries:
                self.trace_started = time.perf_counter()
                self.meta_seconds = 0.0
                if CONFIG.gc_pause and gc.isenabled():
                    # A step allocates thousands of small objects that all live until mark_step; letting
                    # the cyclic GC scan them (and the whole heap) as they pile up costs more than
                    # recording.
                    gc.disable()
                    self.gc_paused = True
            symbolic = self.symbolic
            if symbolic is not None and len(symbolic.shape_env.guards) != symbolic.guards_seen:
                symbolic.note_guards(user_source(3))
            if info.rewrite is not None:
                result = info.rewrite(func, args, kwargs)
                if result is not NotImplemented:
                    return result
            if info.needs_eager:
                return self.run_eager(func, args, kwargs, info, fallback=func not in _READ_OPS)
            if info.written_args and self.writes_eager_tensor(args, kwargs, info):
                return self.run_eager(func, args, kwargs, info, fallback=False)
            if self.carried_dims is not None and info.is_view:
                self.note_carried(args)     # a view of a dynamic input is recorded, with its sizes
            if info.is_view and not info.written_args and self.all_clean(args) and \
                    (self.symbolic is None or not _symbolic_args(args, kwargs)):
                return self.run_eager(func, args, kwargs, info, fallback=False, count=False)
            return self.record(func, args, kwargs, info)

    def all_clean(self, args) -> bool:
        for a in args:
            if isinstance(a, LazyTensor) and not self.is_clean(a):
                return False
        return True

    def writes_eager_tensor(self, args, kwargs, info: OpInfo) -> bool:
        for i, name in info.written_args:
            a = _arg(args, kwargs, i, name)
            items = a if isinstance(a, (list, tuple)) else (a,)
            for x in items:
                if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
                    return True
        return False

    # ---- eager execution -------------------------------------------------------------------------
    def run_eager(self, func, args, kwargs, info: OpInfo, *, fallback: bool, count: bool = True):
        def unwrap(a):
            if isinstance(a, LazyTensor):
                return a._real if self.is_clean(a) else materialize(a, reason=str(func))
            if isinstance(a, LiftedScalar):
                return torch.tensor(a.value, dtype=torch.float32)
            if isinstance(a, (list, tuple)):
                return type(a)(unwrap(x) for x in a)
            return a

        if count and fallback:
            source = user_source(3)
            if CONFIG.strict:
                raise StrictModeError("pydisc strict mode: %s has no compiled form and would run eagerly, "
                                      "at %s" % (func, source))
            METRICS.note_fallback(str(func), 1, {a.dtype for a in args if isinstance(a, torch.Tensor)}, source)
        for i, name in info.written_args:
            a = _arg(args, kwargs, i, name)
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(x, LazyTensor) and x._storage.epoch == self.trace.epoch and self.trace.entries:
                    # pending ops may read this memory: run them before an eager op writes into it
                    self.run(None, "eager write")
                    break
        real_args = tuple(unwrap(a) for a in args)
        real_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        out = func(*real_args, **real_kwargs)
        return self.wrap_eager_outputs(out, args, kwargs, info)

    def wrap_eager_outputs(self, out, args, kwargs, info: OpInfo):
        def wrap(o, plan):
            if not isinstance(o, torch.Tensor) or isinstance(o, LazyTensor):
                return o
            if plan is not None:
                src = _arg(args, kwargs, plan[1], plan[2])
                if plan[0] == "write" and isinstance(src, LazyTensor):
                    return src
                if isinstance(src, LazyTensor) and o.dtype == src.dtype and o.untyped_storage().data_ptr() == \
                        src._storage.real.untyped_storage().data_ptr():
                    return LazyTensor(tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, o.device,
                                      src._storage, real=o)
                if not isinstance(src, LazyTensor) and not isinstance(src, (list, tuple)):
                    return o
            # in pass-through a fresh result stays a plain tensor: the ops that only see plain tensors
            # (most activations) then run in torch without entering this subclass at all
            return o if self.passthrough else to_lazy(o)

        plans = info.returns
        if isinstance(out, (tuple, list)) and len(plans) == len(out) and len(plans) > 1:
            return type(out)(wrap(o, p) for o, p in zip(out, plans))
        if isinstance(out, (tuple, list)):
            plan = plans[0] if plans else None
            return type(out)(wrap(o, plan) for o in out)
        return wrap(out, plans[0] if plans else None)

    # ---- recording -------------------------------------------------------------------------------
    # Recording an op costs a few microseconds: the op's output metadata, the layouts of its outputs
    # and where they live are computed once per meta-cache key (`Recipe`), and the common arguments
    # (lazy tensors, ints, None) are encoded inline; everything else goes through `encode`.

    def encode(self, a, sig: list, reads: list):
        t = type(a)
        if t is LazyTensor:
            vid = a._vid if a._epoch == self.trace.epoch else self.ref(a).vid
            sig.append(VALUE_SIGS[vid])
            reads.append(a._storage)
            return VALUE_REFS[vid]
        if t is list or t is tuple or t is torch.Size:
            sig.append(("list", len(a)))
            epoch = self.trace.epoch
            if a and type(a[0]) is LazyTensor:
                # a foreach op's list, one lazy tensor per parameter: whole-list comprehensions (an
                # element that is not a lazy tensor has no `_vid`: the loop below takes the list)
                ref = self.ref
                try:
                    vids = [x._vid if x._epoch == epoch else ref(x).vid for x in a]
                except AttributeError:
                    pass
                else:
                    sig += [VALUE_SIGS[v] for v in vids]
                    reads += [x._storage for x in a]
                    return [VALUE_REFS[v] for v in vids]
            items = []
            for x in a:     # lazy tensors inline: a foreach op's lists hold one per parameter
                if type(x) is LazyTensor:
                    vid = x._vid if x._epoch == epoch else self.ref(x).vid
                    sig.append(VALUE_SIGS[vid])
                    reads.append(x._storage)
                    items.append(VALUE_REFS[vid])
                else:
                    items.append(self.encode(x, sig, reads))
            return items
        if t is LiftedScalar:
            sig.append("scalar")
            return self.trace.add_scalar(a.value)
        if t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
            if self.symbolic is None:      # a size kept from an earlier symbolic step
                a = hint(a)
                sig.append(a)
                return a
            sig.append("sym")
            return SymArg(a)
        if isinstance(a, torch.Tensor):
            r = self.trace.add_real_input(a)
            sig.append(("r", r.index))
            return r
        sig.append(_constant_part(a))
        return a

    def meta_key(self, func, args, kwargs) -> tuple:
        """What an op's output metadata depends on: the op, its inputs' layouts, its constants."""
        key = [id(func)]
        for a in args:
            t = type(a)
            if t is LazyTensor:
                key.append(a._mk)
            elif t is int or a is None:
                key.append(a)
            else:
                key.append(_key_part(a))
        if kwargs:
            key.append(_KWARGS)
            for k, v in kwargs.items():
                key.append(k)
                key.append(_key_part(v))
        return tuple(key)

    def compute_meta(self, func, args, kwargs):
        def to_meta(a):
            if isinstance(a, torch.Tensor):
                if isinstance(a, LazyTensor):
                    base = torch.empty((hint(a._storage.nbytes) // a.element_size(),), dtype=a.dtype,
                                       device="meta")
                    return base.as_strided(*_layout(a))
                return torch.empty_strided(tuple(a.shape), a.stride(), dtype=a.dtype, device="meta")
            if isinstance(a, LiftedScalar):   # a 0-d float32 tensor at run time
                return torch.empty((), dtype=torch.float32, device="meta")
            if isinstance(a, (list, tuple)):
                return type(a)(to_meta(x) for x in a)
            if isinstance(a, torch.device):
                return torch.device("meta")
            return a

        margs = tuple(to_meta(a) for a in args)
        mkwargs = {k: to_meta(v) for k, v in kwargs.items()}
        out = func(*margs, **mkwargs)
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        descs = []
        for o in leaves:
            if o is None:       # an optional output not asked for (convolution_backward's output_mask)
                descs.append(None)
                continue
            if not isinstance(o, torch.Tensor):
                raise NotImplementedError("non-tensor output")
            descs.append((tuple(o.shape), o.stride(), o.storage_offset(), o.dtype,
                          o.untyped_storage().nbytes()))
        kind = type(out) if isinstance(out, (tuple, list)) else None
        return kind, descs

    def compute_fake(self, func, args, kwargs):
        """Output metadata of a symbolic step's op, from fake tensors on the step's ShapeEnv."""
        session = self.symbolic
        fargs = tuple(self.fake_of(a) for a in args)
        fkwargs = {k: self.fake_of(v) for k, v in kwargs.items()}
        with session.faking():
            out = func(*fargs, **fkwargs)
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        descs, fakes = [], []
        for o in leaves:
            if o is None:
                descs.append(None)
                fakes.append(None)
                continue
            if not isinstance(o, torch.Tensor):
                raise NotImplementedError("non-tensor output")
            descs.append((tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype,
                          o.untyped_storage().nbytes()))
            fakes.append(o)
        kind = type(out) if isinstance(out, (tuple, list)) else None
        return (kind, descs), fakes

    def record(self, func, args, kwargs, info: OpInfo):
        if self.carried_dims is not None:
            self.note_carried(args)
        if self.symbolic is not None and _symbolic_args(args, kwargs):
            try:
                (kind, descs), fakes = self.compute_fake(func, args, kwargs)
            except Exception:
                return self.run_eager(func, args, kwargs, info, fallback=True)
            recipe = Recipe(info, args, kwargs, kind, descs)   # symbolic sizes: not cached
            if recipe.reinterprets:
                return self.run_eager(func, args, kwargs, info, fallback=True)
            return self._record(func, args, kwargs, info, recipe, fakes)
        recipe = self.meta_cache.get(self.meta_key(func, args, kwargs))
        if recipe is None:
            try:
                recipe = self.recipe(func, args, kwargs, info)
            except Exception:
                # no meta kernel, or an output whose shape depends on data: run it eagerly
                return self.run_eager(func, args, kwargs, info, fallback=True)
        if recipe.reinterprets:
            return self.run_eager(func, args, kwargs, info, fallback=True)
        return self._record(func, args, kwargs, info, recipe, None)

    def recipe(self, func, args, kwargs, info: OpInfo, meta_args=None, meta_kwargs=None) -> Recipe:
        """How to record `func` on these arguments: from the meta cache, or worked out by its meta kernel
        (which raises where it cannot say). `meta_args`/`meta_kwargs`: what the meta kernel runs on,
        where the recorded arguments differ (a foreach op's lifted floats)."""
        key = self.meta_key(func, args, kwargs)
        recipe = self.meta_cache.get(key)
        if recipe is None:
            started = time.perf_counter()
            kind, descs = self.compute_meta(func, args if meta_args is None else meta_args,
                                            kwargs if meta_kwargs is None else meta_kwargs)
            recipe = self.meta_cache[key] = Recipe(info, args, kwargs, kind, descs)
            self.meta_seconds += time.perf_counter() - started
        return recipe

    def _record(self, func, args, kwargs, info: OpInfo, recipe: Recipe, fakes):
        trace = self.trace
        epoch = trace.epoch
        sig: list = [info.name]
        reads: list = []
        enc_args = []
        for a, constant in zip(args, recipe.constants):
            if type(a) is LazyTensor:
                vid = a._vid if a._epoch == epoch else self.ref(a).vid
                sig.append(VALUE_SIGS[vid])
                reads.append(a._storage)
                enc_args.append(VALUE_REFS[vid])
            elif constant is not None:
                enc_args.append(constant[0])
                sig += constant[1]
            else:
                enc_args.append(self.encode(a, sig, reads))
        enc_kwargs = {}
        for k, v in kwargs.items():
            sig.append(k)
            enc_kwargs[k] = self.encode(v, sig, reads)
        writes = []
        for i, name in info.written_args:
            a = _arg(args, kwargs, i, name)
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if type(x) is LazyTensor:
                    storage = x._storage
                    storage.written = True
                    writes.append(storage)
        entry_index = len(trace.entries)
        kind = OUT_KINDS[entry_index] if entry_index < len(OUT_KINDS) else out_kind(entry_index)
        outs = []
        out_vids = []
        device = recipe.device
        tensors = trace.tensors
        values, storages, metas = trace.values, trace.storages, trace.metas
        for j, out in enumerate(recipe.outputs):
            if out is None:
                outs.append(None)
                out_vids.append(None)
                continue
            source, size, stride, offset, dtype, nbytes, meta, layout_key = out
            if source is not None and source[0] == "write":
                src = _arg(args, kwargs, source[1], source[2])
                outs.append(src)
                out_vids.append(src._vid)
                continue
            if source is not None:
                storage = _arg(args, kwargs, source[1], source[2])._storage
            else:
                storage = LazyStorage(nbytes, None, epoch, self.step_id)
            if fakes is None and layout_key is not None:
                # LazyTensor.__new__ without its checks: the recipe holds the layout and its id
                t = _make_wrapper(LazyTensor, size, strides=stride, storage_offset=offset, dtype=dtype,
                                  device=device) if offset else \
                    _make_wrapper(LazyTensor, size, strides=stride, dtype=dtype, device=device)
                t._storage = storage
                t._mk = layout_key
                # Trace.new_value inline
                vid = len(values)
                if vid >= len(VALUE_REFS):
                    grow_values(vid)
                values.append(kind)
                storages[vid] = storage
                metas[vid] = meta
            else:
                t = LazyTensor(size, stride, offset, dtype, device, storage)
                if fakes is not None:
                    t._fake = fakes[j]
                    t._fake_sid = self.symbolic.id
                    vid = trace.new_value(kind, storage, t._concrete + (dtype,)
                                          if t._concrete is not None else meta)
                    trace.sym_metas[vid] = meta
                else:
                    vid = trace.new_value(kind, storage, meta)
            if source is None:
                storage.creator = vid
            t._vid = vid
            t._epoch = epoch
            tensors[vid] = weakref.ref(t)
            outs.append(t)
            out_vids.append(vid)
        trace.entries.append(Entry(func, enc_args, enc_kwargs, tuple(out_vids), recipe.kind,
                                   tuple(reads), tuple(writes), tuple(sig),
                                   user_source(3) if self.capture_sources or info.unruled else None))
        METRICS.recorded_ops += 1
        if len(trace.entries) >= self.prune_at and self.pruner is not None:
            self.pruner()
        if self.gc_paused and len(trace.entries) > 50_000:   # a step that is never marked: collect again
            self.gc_paused = False
            gc.enable()
        if recipe.kind is None:
            return outs[0]
        return recipe.kind(outs)


class Recipe:
    """How to record an op for one meta-cache key (op, input layouts, constants), worked out once:
    the output container, per output where its storage comes from and its layout, the device, and
    the encoding of each positional argument that is a constant (equal constants have equal keys)."""

    __slots__ = ("kind", "outputs", "device", "reinterprets", "constants")

    def __init__(self, info: OpInfo, args, kwargs, kind, descs) -> None:
        self.kind = kind
        self.constants = tuple(map(_constant, args))
        self.device = device = _device_of(args, kwargs)
        self.reinterprets = False
        plans = info.returns
        outputs = []
        for j, d in enumerate(descs):
            if d is None:
                outputs.append(None)
                continue
            plan = plans[j] if j < len(plans) else (plans[0] if plans else None)
            size, stride, offset, dtype, nbytes = d
            if plan is not None and plan[0] == "view":
                src = _arg(args, kwargs, plan[1], plan[2])
                if dtype != src.dtype:
                    # a view that reinterprets the bytes (view(dtype), view_as_real): storages here
                    # hold one dtype, so the view is taken of the device data, as an eager op
                    self.reinterprets = True
                nbytes = src._storage.nbytes
            meta = (size, stride, offset, dtype)
            layout_key = None
            if all(type(x) is int for x in size) and all(type(x) is int for x in stride) and \
                    type(offset) is int and type(nbytes) is int:
                layout_key = _layout_key(size, tuple(stride), offset, dtype, nbytes, device)
            outputs.append((plan, size, tuple(stride), offset, dtype, nbytes, meta, layout_key))
        self.outputs = tuple(outputs)


_KWARGS = object()              # separates positional and keyword arguments in a meta-cache key
_TRUE, _FALSE = ("bool", True), ("bool", False)     # True == 1: a bool constant is tagged


def _constant_part(a):
    """A constant's part of a key (meta cache, structural signature): floats that vary per step are
    lifted by a rewrite, the others are constants, and output sizes may depend on them."""
    t = type(a)
    if t is float:
        return ("f", a) if a == a and a != 0.0 else ("f", repr(a))   # -0.0 == 0.0, nan != nan
    if t is bool:
        return _TRUE if a else _FALSE       # True == 1
    return a


def _constant(a) -> tuple | None:
    """(encoded argument, its signature parts) of an argument with no tensor, lifted scalar or size
    symbol in it; None for the others. Entries share the encoded lists: nothing writes into them."""
    t = type(a)
    if t is list or t is tuple or t is torch.Size:
        parts: list = [("list", len(a))]
        items = []
        for x in a:
            c = _constant(x)
            if c is None:
                return None
            items.append(c[0])
            parts += c[1]
        return items, tuple(parts)
    if t is LazyTensor or t is LiftedScalar or t is torch.SymInt or t is torch.SymFloat or \
            t is torch.SymBool or isinstance(a, torch.Tensor):
        return None
    return a, (_constant_part(a),)


def _key_part(a):
    """The part of an op's meta-cache key for one argument: what its output metadata depends on."""
    t = type(a)
    if t is LazyTensor:
        return a._mk
    if t is list or t is tuple:
        if a and type(a[0]) is LazyTensor:
            try:
                return (t, *[x._mk for x in a])     # all lazy: a foreach op's list (else no `_mk`)
            except AttributeError:
                pass
        parts = [t]
        for x in a:
            tx = type(x)
            if tx is LazyTensor:
                parts.append(x._mk)
            elif tx is int:
                parts.append(x)
            else:
                parts.append(_key_part(x))
        return tuple(parts)
    if t is LiftedScalar:
        return float          # a 0-d float32 tensor whatever its value
    if t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
        return hint(a)        # a size kept from an earlier symbolic step, recorded as its value
    if isinstance(a, torch.Tensor):
        return ("r", tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device)
    return _constant_part(a)


def _device_of(args, kwargs) -> torch.device:
    for a in args:
        if isinstance(a, LazyTensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, LazyTensor):
                    return x.device
    for a in kwargs.values():
        if isinstance(a, LazyTensor):
            return a.device
    for a in args:      # rewrites record ops on eager operands of a lazy computation
        if isinstance(a, torch.Tensor):
            return a.device
    if "device" in kwargs:   # a factory op of a symbolic step
        return torch.device(kwargs["device"]) if kwargs["device"] is not None else torch.device("cpu")
    if RECORDER.symbolic is not None:
        return torch.device("cpu")
    raise RuntimeError("pydisc: an op reached the lazy dispatcher without a lazy tensor argument")


def _symbolic_args(args, kwargs) -> bool:
    """Does an op of a symbolic step involve a symbolic size (a tensor or an int argument)?"""
    for a in args:
        t = type(a)
        if t is LazyTensor:
            if a._concrete is not None:
                return True
        elif t is list or t is tuple or t is torch.Size:
            if _symbolic_args(a, {}):
                return True
        elif t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
            return True
    if kwargs:
        return _symbolic_args(tuple(kwargs.values()), {})
    return False


_READ_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
             aten.allclose.default}

RECORDER = Recorder()


def current_trace() -> Trace:
    return RECORDER.trace


def install_driver(run: Callable[[LazyTensor | None, str], None], prune: Callable[[], None],
                   dims_of: Callable[[int, torch.Tensor], tuple]) -> None:
    """The step driver's hooks, installed once by pydisc/driver: `run(None, reason)` runs the whole pending
    trace, `run(t, reason)` at least what `t` needs; `prune()` drops the entries of a trace that is never
    marked whose tensors have all died; `dims_of(ordinal, real)` says which dims of a step input are
    recorded symbolically. (The driver also sets `carried_dims` while a carried input has dynamic dims,
    and the step mode, `passthrough` and `released`, through its Engine.)"""
    RECORDER.executor, RECORDER.pruner, RECORDER.dims_of = run, prune, dims_of


def materialize(t: LazyTensor, *, reason: str = "read") -> torch.Tensor:
    """Device data of `t`, running the pending ops it needs first."""
    if t._fid is not None or t._redirect is not None:
        return RECORDER.fast_read(t)
    if not RECORDER.is_clean(t):
        if t._real is None and t._epoch != RECORDER.trace.epoch:
            raise RuntimeError(ABANDONED)
        if RECORDER.executor is None:
            raise RuntimeError("pydisc: no executor installed (import pydisc)")
        source = user_source(2)
        if CONFIG.strict:
            raise StrictModeError("pydisc strict mode: a value was read before mark_step (%s) at %s; read it "
                                  "after pydisc.mark_step() instead" % (reason, source))
        METRICS.materializations += 1
        METRICS.materialization_sources[source or "?"] += 1
        RECORDER.run(t, reason)
    return t._real
