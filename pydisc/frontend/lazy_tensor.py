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
from .in_flight import InFlightReads
from .layout import flat_base
from .meta_keys import KWARGS, Recipe, constant_part, key_part, symbolic_args
from .op_facts import OPINFOS, OpInfo, arg, draws, opinfo
from .policy import READ_OPS
from .source import user_source
from .symbolic import SymArg, SymbolicStep, hint
from .symbolic_inputs import SymbolicInputs
from .tensor import LazyTensor, LiftedScalar, StrictModeError, _make_wrapper, bind, concrete_layout, is_lazy, liftable
from .trace import OUT_KINDS, VALUE_REFS, VALUE_SIGS, Entry, LazyStorage, Trace, ValueRef, grow_values, out_kind

__all__ = ["StrictModeError", "LazyTensor", "is_lazy", "to_lazy", "materialize", "current_trace", "install_driver", "Recorder",
           "LiftedScalar", "liftable", "RECORDER", "map_nested"]

aten = torch.ops.aten
METRICS = _metrics.METRICS
ABANDONED = ("pydisc: this lazy tensor has no data: the step that computes it was abandoned after an error. "
             "Recompute it (run the forward pass again) before using it.")
PRUNE_FIRST_AT = 10_000   # entries of a never-marked trace before the dead ones are first dropped


_SET_DATA = torch._C.TensorBase.data.__set__


def to_lazy(real: torch.Tensor, *, step_input: bool = False, storage: LazyStorage | None = None) -> LazyTensor:
    """Wrap device data as a (materialized) lazy tensor, without a copy.

    `step_input`: `real` is an input of the step (a module input, `pydisc.to_lazy`): its dims may be
    dynamic (`pydisc.mark_dynamic`, or seen to change between steps), in which case the step is
    recorded with symbolic sizes. `storage`: the storage of a lazy tensor made of the same memory
    (`real` views it), whose view the new one is, so that the steps see the two alias as eager does."""
    if isinstance(real, LazyTensor):
        return real
    if storage is None:
        storage = LazyStorage(real.untyped_storage().nbytes(), flat_base(real))
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


# --------------------------------------------------------------------------------------------------


def map_nested(fn, a):
    """`fn` applied to `a`, or to each item of the lists and tuples nested in it. (The recursion lives here,
    not in a closure that calls itself: such a closure is a reference cycle, which keeps what it captured,
    the tensors of an op, until the next cyclic collection; and collections pause while a step records.)"""
    if isinstance(a, (list, tuple)):
        return type(a)(map_nested(fn, x) for x in a)
    return fn(a)


def _to_meta(a):
    """An op's argument as meta tensors of the same layouts (a lazy tensor's storage size kept)."""
    if isinstance(a, torch.Tensor):
        if isinstance(a, LazyTensor):
            base = torch.empty((hint(a._storage.nbytes) // a.element_size(),), dtype=a.dtype, device="meta")
            return base.as_strided(*concrete_layout(a))
        return torch.empty_strided(tuple(a.shape), a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, LiftedScalar):   # a 0-d float32 tensor at run time
        return torch.empty((), dtype=torch.float32, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta(x) for x in a)
    if isinstance(a, torch.device):
        return torch.device("meta")
    return a


class Recorder(SymbolicInputs, InFlightReads):
    """Owns the pending trace and records ops into it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.epoch = 0
        self.trace = Trace(epoch=0)
        self.meta_cache: dict[Any, Any] = {}
        self.executor: Callable[[LazyTensor | None, str], None] | None = None
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
        # ... and for `t.data = value`: the tensors to assign with, a segment open being demoted first
        self.fast_set_data: Callable[[LazyTensor, torch.Tensor], tuple] | None = None
        # Threads building a plan (pydisc/driver/plan.py), which trace on fake tensors: a read of a lazy
        # tensor's data from one would wait for the step being planned, for ever; it raises instead
        self.planning: set[int] = set()
        # ... and for an op whose arguments may hold fast values that bypassed their handler: (args,
        # kwargs) with the ATen-level tensors they stand for, or None
        self.fast_dispatched: Callable[[tuple, dict], tuple | None] | None = None
        InFlightReads.__init__(self)

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
            self.end_symbolic()
        self.inputs_seen = 0
        self.last_input_shapes, self.input_shapes = self.input_shapes, []
        self.step_id += 1

    def record_factory(self, func, args, kwargs):
        with self.lock:
            return self.record(func, args, kwargs, opinfo(func))

    # ---- value references ------------------------------------------------------------------------
    def ref(self, t: LazyTensor) -> ValueRef:
        trace = self.trace
        if t._epoch == trace.epoch:
            return VALUE_REFS[t._vid]       # (the shared one: a frozen dataclass costs ~1 µs to make)
        if t._real is None and self.in_flight is not None:
            self.in_flight("a result of the step before")
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
        return VALUE_REFS[vid]

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

    def set_data(self, t: LazyTensor, value: torch.Tensor) -> None:
        """`t.data = value`: `t` holds `value`'s data from now on, in its layout and dtype, sharing its
        storage (as eager's tensors share it), and keeps its own autograd state (`requires_grad`, `.grad`,
        hooks), as in eager. `value` may be an eager tensor, wrapped without a copy (`to_lazy`)."""
        if not isinstance(value, torch.Tensor):
            _SET_DATA(t, value)     # torch's TypeError
        if self.fast_set_data is not None:
            # a forward recorded at __torch_function__ is open, or these are its values (frontend/fast.py)
            t, value = self.fast_set_data(t, value)
        if not isinstance(value, LazyTensor):
            value = to_lazy(value)
        with torch.no_grad():
            alias = value.detach()      # recorded (or taken of the device data): a value of its own, on value's storage
        with torch._C.DisableTorchFunctionSubclass():
            _SET_DATA(t, alias)         # the wrapper's sizes, strides, dtype, device; torch's checks and errors
        t._storage = alias._storage
        self.adopt(t, alias)

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
            if self.fast_dispatched is not None:
                resolved = self.fast_dispatched(args, kwargs)
                if resolved is not None:
                    args, kwargs = resolved
            info = OPINFOS.get(id(func))
            if info is None:
                info = opinfo(func)
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
                return self.run_eager(func, args, kwargs, info, fallback=func not in READ_OPS)
            if kwargs and kwargs.get("device") is not None and _moves(args, kwargs["device"]):
                # `x.to("cpu")` of a CUDA value, `x.new_zeros(n, device="meta")`: a result on another device
                # than the op's lazy inputs, which a recorded op cannot make; the data is moved at once
                return self.run_eager(func, args, kwargs, info, fallback=False)
            if info.written_args and self.writes_eager_tensor(args, kwargs, info):
                return self.run_eager(func, args, kwargs, info, fallback=False)
            if self.carried_dims is not None and info.is_view:
                self.note_carried(args)     # a view of a dynamic input is recorded, with its sizes
            if info.is_view and not info.written_args and self.all_clean(args) and \
                    (self.symbolic is None or not symbolic_args(args, kwargs)):
                return self.run_eager(func, args, kwargs, info, fallback=False, count=False)
            return self.record(func, args, kwargs, info)

    def all_clean(self, args) -> bool:
        for a in args:
            if isinstance(a, LazyTensor) and not self.is_clean(a):
                return False
        return True

    def writes_eager_tensor(self, args, kwargs, info: OpInfo) -> bool:
        for i, name in info.written_args:
            a = arg(args, kwargs, i, name)
            items = a if isinstance(a, (list, tuple)) else (a,)
            for x in items:
                if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
                    return True
        return False

    # ---- eager execution -------------------------------------------------------------------------
    def run_eager(self, func, args, kwargs, info: OpInfo, *, fallback: bool, count: bool = True):
        wait = self.in_flight
        if wait is not None and not (info.is_view and not info.written_args) and (
                info.written_args or self.waits_for(args) or self.waits_for(kwargs.values())):
            wait(str(func))     # device data is read or written (a view only points into it)

        def unwrap(a):
            if isinstance(a, LazyTensor):
                return a._real if self.is_clean(a) else materialize(a, reason=str(func))
            if isinstance(a, LiftedScalar):
                return torch.tensor(a.value, dtype=torch.float32)
            return a

        if count and fallback:
            source = user_source(3)
            if CONFIG.strict:
                raise StrictModeError("pydisc strict mode: %s has no compiled form and would run eagerly, "
                                      "at %s" % (func, source))
            METRICS.note_fallback(str(func), 1, {a.dtype for a in args if isinstance(a, torch.Tensor)}, source)
        for i, name in info.written_args:
            a = arg(args, kwargs, i, name)
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if self.trace.entries and isinstance(x, torch.Tensor) and (
                        x._storage.epoch == self.trace.epoch if isinstance(x, LazyTensor) else
                        self.trace.reads_memory_of(x)):
                    # pending ops may read this memory: run them before an eager op writes into it (an
                    # eager buffer a lazy op read, then written with a lazy value)
                    self.run(None, "eager write")
                    break
        real_args = tuple(map_nested(unwrap, a) for a in args)
        real_kwargs = {k: map_nested(unwrap, v) for k, v in kwargs.items()}
        out = func(*real_args, **real_kwargs)
        return self.wrap_eager_outputs(out, args, kwargs, info)

    def wrap_eager_outputs(self, out, args, kwargs, info: OpInfo):
        def wrap(o, plan):
            if not isinstance(o, torch.Tensor) or isinstance(o, LazyTensor):
                return o
            if plan is not None:
                src = arg(args, kwargs, plan[1], plan[2])
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
        sig.append(constant_part(a))
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
                key.append(key_part(a))
        if kwargs:
            key.append(KWARGS)
            for k, v in kwargs.items():
                key.append(k)
                key.append(key_part(v))
        return tuple(key)

    def compute_meta(self, func, args, kwargs):
        margs = tuple(_to_meta(a) for a in args)
        mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
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
        if self.symbolic is not None and symbolic_args(args, kwargs):
            try:
                (kind, descs), fakes = self.compute_fake(func, args, kwargs)
            except Exception:
                return self.run_eager(func, args, kwargs, info, fallback=True)
            recipe = Recipe(info, args, kwargs, kind, descs, True)   # symbolic sizes: not cached
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
            recipe = self.meta_cache[key] = Recipe(info, args, kwargs, kind, descs, self.symbolic is not None)
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
            a = arg(args, kwargs, i, name)
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
                src = arg(args, kwargs, source[1], source[2])
                outs.append(src)
                out_vids.append(src._vid)
                continue
            if source is not None:
                storage = arg(args, kwargs, source[1], source[2])._storage
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
        if info.seeded and trace.rng_note is None and draws(func, args, kwargs):
            trace.note_draw(device)
        if len(trace.entries) >= self.prune_at and self.pruner is not None:
            self.pruner()
        if self.gc_paused and len(trace.entries) > 50_000:   # a step that is never marked: collect again
            self.gc_paused = False
            gc.enable()
        if recipe.kind is None:
            return outs[0]
        return recipe.kind(outs)


RECORDER = Recorder()


def _moves(args, device) -> bool:
    """Whether `device` (an op's `device=` argument) is not the device of its first lazy tensor argument."""
    for a in args:
        if type(a) is LazyTensor:
            target = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
            here = a.device
            return target.type != here.type or (target.index is not None and target.index != here.index)
    return False


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
    if RECORDER.planning and threading.get_ident() in RECORDER.planning:
        raise RuntimeError("pydisc: planning a step read the data of one of its lazy tensors (%s)" % reason)
    wait = RECORDER.in_flight
    if wait is not None and RECORDER.waits_for((t,)):
        wait(reason)
    if t._fid is not None or t._redirect is not None or t._storage.fast_written:
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


bind(RECORDER, materialize, to_lazy)
