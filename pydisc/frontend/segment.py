"""A fast recorder's segment: the calls of one forward recorded at `__torch_function__`.

`Segment.record` encodes a call's arguments, takes its outputs' metadata from a cached meta run (on
fake tensors of the step's device under autocast), and returns wrapper lazy tensors (*fast values*);
a call that matches the one its module's last segment made there takes that one's (follow.py).
`Segment.close` turns the segment into one `FusedStep` entry of the step's trace, `Segment.evaluate`
(segment_reads.py) computes values read before `mark_step`, `Segment.demote` re-runs the calls through the dispatcher.
The recorder's per-process state (the open segment, its thread, how steps are recorded) is
`fast_state.FAST`.
"""
from __future__ import annotations

import gc
import time
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from .. import metrics as _metrics
from ..config import CONFIG
from .call_meta import RECIPES, Recipe, call_recipe, on_device
from .fast_state import FAST
from .follow import Following, Script
from .fused import _FVS, FV, XV, Demote, FusedStep, NoMeta, _amp, _fv, _xv
from .layout import gradient_layout, layout_key
from .lazy_tensor import RECORDER, LazyTensor
from .meta_keys import constant_part
from .segment_reads import Reads, holds_tensor
from .tensor import _make_wrapper
from .source import user_source
from .trace import Entry, LazyStorage, generator_states, out_kind

__all__ = ["Segment"]

METRICS = _metrics.METRICS
_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch.is_grad_enabled
_is_alias_of = torch._C._is_alias_of
_Tensor = torch.Tensor
_GRAD = _Tensor.grad.__get__
_TO = _Tensor.to
_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_


# `Segment.leaves` of the segments recorded so far, by (calls, recipes, loss): a training loop's segments
# repeat; at most this many kept
_LEAVES: dict[tuple, tuple] = {}
_LEAVES_KEPT = 256

# Arguments that are constants as they are (no tensor inside, not a device): torch.Size holds ints (or the
# SymInts of a symbolic step, in which no segment starts).
_PLAIN_CONSTANTS = frozenset({int, float, bool, torch.dtype, torch.Size, torch.memory_format, torch.layout})


class Segment(Following, Reads):
    """The calls of one forward (and loss) recorded at `__torch_function__`."""

    def __init__(self, device: torch.device, armed_by: tuple | None = None) -> None:
        self.device = device
        self.device_type = device.type
        # (func, args, kwargs, out fids, grad enabled, result leaf of each out fid)
        self.entries: list[tuple] = []
        self.sig: list[tuple] = []
        # per entry: (its call's recipe: the argument slots its results' gradients reach, whether it draws;
        # its FV/XV arguments in slot order)
        self.links: list[tuple] = []
        self.metas: list[tuple] = []        # fid -> (size, stride, offset, dtype, nbytes)
        self.rg: list[bool] = []            # fid -> requires grad
        self.lays: list[tuple] = []         # fid -> metas + (requires grad,): its part of a call's key
        self.root: list[int] = []           # fid -> fid of the value whose storage it views (itself if fresh)
        self.ext_alias: dict[int, int] = {}  # fid -> input slot whose storage it views
        self.aliased: set[int] = set()      # fids with views or that are views
        self.objects: list[weakref.ref] = []
        self.externals: list[torch.Tensor] = []
        self.ext_index: dict[int, int] = {}
        self.ext_versions: list[int] = []
        self.ext_lays: list = []            # input index -> its part of a call's key (None: an eager tensor)
        # Lazy inputs the calls write in place (a BatchNorm's running statistics, its `num_batches_tracked`):
        # input index -> None, in the order of their first write; and how many inputs share each lazy
        # storage (a write into one input that another views is not followed).
        self.written: dict[int, None] = {}
        self.storage_users: dict[int, int] = {}
        self.started = time.perf_counter()
        self.meta_seconds = 0.0
        self.evaluated: dict = {}           # fid -> its value, computed for a read before the segment's end
        self.read_upto = 0                  # calls recorded at the last such read
        self.draws = 0                      # calls recorded that draw random numbers (random_state.py)
        self.rng_note = None                # torch's generators at the first of them (Trace.rng_note)
        self.armed_by = armed_by            # (module, its training mode) whose forward opened it (fast.arm)
        # the calls of that module's last segment that closed in this mode on this device (`follow`), from
        # `cursor` on; and this segment's calls, kept for the next one
        self.script = FAST.scripts.get(armed_by[0], {}).get((armed_by[1], device)) if armed_by else None
        self.cursor = 0
        self.log: list | None = [] if armed_by else None
        if CONFIG.gc_pause and gc.isenabled() and not RECORDER.gc_paused:
            # as for a step recorded by the dispatcher (Recorder.dispatch): no cyclic GC while it records,
            # which also makes the values alive at the segment's end the same every step (`close`)
            gc.disable()
            RECORDER.gc_paused = True       # turned on again with the next trace (Recorder.new_trace)

    # ---- arguments ------------------------------------------------------------------------------
    def external(self, t: torch.Tensor) -> XV:
        index = self.ext_index.get(id(t))
        if index is None:
            if type(t) is LazyTensor:
                if t._redirect is not None:
                    raise Demote("a value of a demoted step")
                if t.requires_grad and t.grad_fn is not None:
                    raise Demote("an input with autograd history")
                if t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None):
                    raise Demote("tensor hooks")
                if t._storage.fast_written:
                    # (a view of an input the calls wrote)
                    raise Demote("a write into an input whose storage another input shares")
                sid = id(t._storage)
                self.storage_users[sid] = self.storage_users.get(sid, 0) + 1
            elif t.requires_grad:
                raise Demote("an eager tensor that requires grad")
            elif t.device.type != self.device_type and t.device.type != "cpu":
                # (a CPU tensor beside CUDA ones: a 0-d scalar, an index, which torch takes there)
                raise Demote("an eager tensor on another device")
            index = self.ext_index[id(t)] = len(self.externals)
            self.externals.append(t)
            self.ext_versions.append(t._version)
            # (a lazy input's layout and requires_grad cannot change while the segment is open: what
            # would change them demotes it; an eager tensor's are read at each call)
            self.ext_lays.append((t._mk, t.requires_grad) if type(t) is LazyTensor else None)
        return _xv(index)

    def encode(self, a, sig: list, slots: list):
        t = type(a)
        if t in _PLAIN_CONSTANTS or a is None:
            sig.append(constant_part(a))     # (what the checks below would come to, without them)
            return a
        if t is LazyTensor:
            fid = a._fid
            if fid is not None:
                if a._fseg is not self:
                    raise Demote("a value of another segment")
                sig.append(("f", fid))
                v = _FVS[fid] if fid < len(_FVS) else _fv(fid)
            else:
                v = self.external(a)
                sig.append(("x", v.index))
            slots.append(v)
            return v
        if t is list or t is tuple:
            if not a:
                sig.append((t, 0))
                return a
            sig.append((t, len(a)))
            return t([self.encode(x, sig, slots) for x in a])
        if isinstance(a, _Tensor):
            v = self.external(a)
            sig.append(("x", v.index))
            slots.append(v)
            return v
        if t is slice:
            if any(isinstance(x, _Tensor) for x in (a.start, a.stop, a.step)):
                raise Demote("a tensor in a slice")
            sig.append(("slice", a.start, a.stop, a.step))
            return a
        if isinstance(a, (list, tuple)) and holds_tensor(a):
            raise Demote("tensors in a %s" % t.__name__)   # a namedtuple, a list subclass
        if t is torch.device or (t is str and _device_named(a) is not None):
            d = torch.device(a)
            if d != self.device and not (self.device.index is None and d.type == self.device.type):
                raise Demote("a move to another device")
            sig.append(("device", str(a)))
            return a
        if t is dict:
            raise Demote("a dict argument")
        if t is torch.SymInt or t is torch.SymFloat or t is torch.SymBool:
            raise Demote("a symbolic size")
        sig.append(constant_part(a))
        return a

    def layout_of(self, v) -> tuple:
        if type(v) is FV:
            return self.lays[v.fid]
        lay = self.ext_lays[v.index]
        if lay is not None:
            return lay
        t = self.externals[v.index]
        return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)

    def _requires_grad(self, fid: int) -> None:
        self.rg[fid] = True
        self.lays[fid] = self.metas[fid] + (True,)

    def meta_of(self, v):
        if type(v) is FV:
            size, stride, offset, dtype, nbytes = self.metas[v.fid]
            rg = self.rg[v.fid]
            device = self.device
        else:
            t = self.externals[v.index]
            size, stride, offset, dtype = tuple(t.shape), t.stride(), t.storage_offset(), t.dtype
            nbytes = t._storage.nbytes if type(t) is LazyTensor else t.untyped_storage().nbytes()
            rg = t.requires_grad
            device = t.device
        base = torch.empty((max(nbytes // max(dtype.itemsize, 1), 1),), dtype=dtype, device="meta")
        if rg and type(v) is FV:
            # a value computed in the step is not a leaf: in-place ops on it are allowed, as in eager
            base = base.requires_grad_(True).clone()
        m = base.as_strided(size, stride, offset)
        if rg and type(v) is XV:
            m = m.detach().requires_grad_(True)
        return m, device

    # ---- recording ------------------------------------------------------------------------------
    def record(self, func, args, kwargs):
        if func is _TO and len(args) > 1 and isinstance(args[1], _Tensor) and args[1].device != self.device:
            raise Demote("a move to another device")      # `x.to(other)`: to other's device
        amp = _amp(self.device_type)
        grad = _grad_enabled()
        slots: list = []
        call = self.follow(func, grad, amp, args, kwargs, slots) if self.script is not None else None
        if call is not None:
            enc_args, enc_kwargs, sig, recipe = call[3], call[4], call[5], call[6]
        else:
            sig, enc_args, enc_kwargs, slots, recipe = self.look_up(func, grad, amp, args, kwargs)
            if self.log is not None:
                call = (func, grad, amp, enc_args, enc_kwargs, sig, recipe,
                        tuple([(k, self.layout_of(v)) for k, v in enumerate(slots) if type(v) is XV]))
        if self.log is not None:
            self.log.append(call)
        if type(recipe) is str:
            # a read (`bool(mask.all())`): computed now, at every step, followed or not; its value decides
            # what the forward calls next, which the following compares call by call
            return self.read_call(func, enc_args, enc_kwargs, slots, recipe)
        for slot, rg in zip(recipe.mutated, recipe.mutated_rg):
            v = slots[slot]
            if type(v) is XV:
                self._check_write(v.index, rg)
                continue
            if v.fid in self.ext_alias:
                raise Demote("a write into a tensor the step did not make")     # through a view of it
            if v.fid in self.aliased:
                raise Demote("a write into a value that has views")
        out_fids = []
        out_leaves = []     # the result leaf of each out fid
        results = list(recipe.leaves)
        # `x.contiguous()` of a contiguous value, `x.to(x.dtype)`, `F.dropout(x, 0.0)`, dropout in eval mode:
        # eager returns the argument itself, unchanged; such a call is not an entry of the segment
        unchanged = not recipe.mutated
        for j, size, stride, offset, dtype, nbytes, rg, alias, same, plain in recipe.outputs:
            if same is not None:
                v = slots[same]
                obj = _find(args, kwargs, same)
                if type(v) is XV:
                    results[j] = obj
                    continue
                if rg and not self.rg[v.fid]:
                    self._requires_grad(v.fid)
                    unchanged = False
                out_fids.append(v.fid)
                out_leaves.append(j)
                results[j] = obj
                continue
            unchanged = False
            fid = len(self.metas)
            meta = (size, stride, offset, dtype, nbytes)
            self.metas.append(meta)
            self.rg.append(rg)
            self.lays.append(meta + (rg,))
            root = fid
            if alias is not None:
                src = slots[alias]
                if type(src) is FV:
                    root = self.root[src.fid]
                    self.aliased.add(fid)
                    self.aliased.add(src.fid)
                    self.aliased.add(root)
                    if src.fid in self.ext_alias:
                        self.ext_alias[fid] = self.ext_alias[src.fid]
                else:
                    self.ext_alias[fid] = src.index
            self.root.append(root)
            if plain:
                obj = _make_wrapper(LazyTensor, size, dtype=dtype, device=self.device)
            else:
                obj = _make_wrapper(LazyTensor, size, strides=stride, storage_offset=offset, dtype=dtype,
                                    device=self.device)
            obj._fid = fid
            obj._fseg = self
            self.objects.append(weakref.ref(obj))
            out_fids.append(fid)
            out_leaves.append(j)
            results[j] = obj
        for slot, rg in zip(recipe.mutated, recipe.mutated_rg):
            v = slots[slot]
            if type(v) is XV:
                if v.index not in self.written:
                    self.written[v.index] = None
                    self.externals[v.index]._storage.fast_written = True
                continue                    # (the entry writes it: `FusedStep.written`)
            if rg:
                self._requires_grad(v.fid)   # `buf[:, :3] = a(x)`: buf requires grad from now on
            if recipe.outputs and any(o[8] == slot for o in recipe.outputs):
                continue
            out_fids.append(v.fid)      # written in place and not returned: same value id, newer data
        if unchanged and recipe.outputs:
            return results[0] if recipe.spec is None else pytree.tree_unflatten(results, recipe.spec)
        self.entries.append((func, enc_args, enc_kwargs, tuple(out_fids), (grad, amp), tuple(out_leaves)))
        self.sig.append(sig)
        self.links.append((recipe, tuple(slots)))
        if recipe.draws:
            if not self.draws:
                self.rng_note = generator_states(self.device)
            self.draws += 1
        METRICS.fast_entries += 1
        if recipe.spec is None:
            return results[0]
        return pytree.tree_unflatten(results, recipe.spec)

    def look_up(self, func, grad: bool, amp, args, kwargs) -> tuple:
        """(signature, encoded args and kwargs, tensor slots, recipe) of a call: its arguments encoded, its
        recipe from the cache by signature and slot layouts, or worked out now on meta tensors; where no meta
        kernel describes the call, why, in the recipe's place (a read: `read_call`)."""
        sig: list = [func, grad, amp]
        slots: list = []
        encode = self.encode
        enc_args = tuple([encode(a, sig, slots) for a in args])
        enc_kwargs = {}
        if kwargs:
            for k, v in kwargs.items():
                sig.append(k)
                enc_kwargs[k] = encode(v, sig, slots)
        if not slots:
            raise Demote("a call without tensors")
        key = (*sig, *[self.layout_of(v) for v in slots])
        try:
            recipe = RECIPES.get(key)
        except TypeError:
            raise Demote("an argument that cannot be hashed") from None
        if recipe is None:
            started = time.perf_counter()
            try:
                recipe = self.recipe(func, enc_args, enc_kwargs, slots, amp)
            except NoMeta as exc:
                recipe = str(exc)   # (the same at every step: what the meta run saw is all in the key)
            RECIPES[key] = recipe
            self.meta_seconds += time.perf_counter() - started
        return tuple(sig), enc_args, enc_kwargs, slots, recipe

    def _check_write(self, index: int, rg: bool) -> None:
        """A call writes input `index` in place: followed for a lazy tensor that needs no gradient and whose
        storage no other input shares (the step's entry then writes it, as the dispatcher records an
        in-place op); otherwise the segment is demoted."""
        t = self.externals[index]
        if type(t) is not LazyTensor or t.requires_grad or rg:
            # an eager tensor, a parameter, or a write that would make the input require grad
            raise Demote("a write into a tensor the step did not make")
        if self.storage_users[id(t._storage)] > 1:
            raise Demote("a write into an input whose storage another input shares")

    def recipe(self, func, enc_args, enc_kwargs, slots, amp) -> Recipe:
        # Autocast casts only tensors of its device: under it the call runs on fake tensors of the
        # segment's device (as torch.compile traces autocast), else on meta tensors (cheaper).
        fake = FakeTensorMode() if amp is not None else None
        metas = {}
        for v in slots:
            if id(v) not in metas:
                m = self.meta_of(v)[0]
                if fake is not None:
                    m = on_device(fake, m, self.device)
                metas[id(v)] = m
        return call_recipe(func, enc_args, enc_kwargs, slots, metas, fake, self.device)

    # ---- the end of a segment ------------------------------------------------------------------
    def alive(self) -> list[LazyTensor]:
        out = []
        for ref in self.objects:
            o = ref()
            if o is not None and o._fseg is self:
                out.append(o)
        return out

    def demote(self, reason: str) -> None:
        """Run every call again through the ATen-level recorder, with autograd; the fast values the user
        holds forward to the results from now on."""
        FAST.segment = None
        FAST.demoted = FAST.redirected = True
        METRICS.fast_demotions[reason] += 1
        self._written_done()
        FAST.note(self.armed_by, demoted=True)
        if RECORDER.trace.rng_note is None:
            RECORDER.trace.rng_note = self.rng_note     # (its draws are recorded again below, later)
        env = FusedStep(tuple(self.entries), len(self.externals), (), None, (),
                        self.device.type).forward(list(self.externals))
        for o in self.alive():
            if o._fid in env:
                target = o._redirect = env[o._fid]
                FAST.redirects.append(weakref.ref(o))
                with _NO_SUBCLASS():
                    if target.requires_grad:
                        # Where torch meets the value without pydisc's handler (code run inside a backward,
                        # which runs with torch functions off: a non-reentrant checkpoint's recomputation
                        # of a forward it took the value into), autograd reads the value's own flag: as
                        # its target's, autograd saves what it saved for the target (the checkpoint
                        # compares the counts). The wrapper is a leaf of its own; nothing flows into it.
                        _REQUIRES_GRAD_(o, True)
            o._fid = None
            o._fseg = None

    def close(self, loss: LazyTensor | None) -> None:
        """Record the segment as one entry of the step's trace; `loss`: the value `backward()` was called on."""
        alive = self.alive()
        fids = tuple(o._fid for o in alive)
        if RECORDER.gc_paused and (FAST.cycles or fids != FAST.last_alive):
            # Values held only by reference cycles (frames of an exception caught in a forward, a model's
            # output objects) look alive and would become outputs, and the next step's key would differ:
            # collected first. The young generation holds everything this forward made, since the GC was
            # paused. Skipped while forwards leave no values to cycles (the last collection freed none) and
            # the same values are alive as at the last segment's end: a collection costs 0.1-0.4 ms. Garbage
            # that holds no value of the segment (a library's own cycles) does not count. (`alive` is let go
            # of first: its references would keep every value it lists.)
            alive = None
            gc.collect(0)
            alive = self.alive()
            FAST.cycles = len(alive) != len(fids)
            fids = tuple(o._fid for o in alive)
        FAST.last_alive = fids
        for o in alive:
            if o._fid in self.ext_alias:
                raise Demote("a view of a parameter or input kept past the backward")
        for t, version in zip(self.externals, self.ext_versions):
            if t._version != version:
                self.abandon(alive)
                raise RuntimeError(
                    "pydisc: an eager tensor of shape %s was modified in place after a lazy op used it in "
                    "this step. Pass a copy (`t.clone()`) to the lazy computation, or call "
                    "pydisc.mark_step() before modifying it." % (tuple(t.shape),))
        script = self.script
        loss_fid = loss._fid if loss is not None else None
        if script is not None and self.cursor == len(script) and script.loss == loss_fid:
            # every call followed the kept ones, to their end, and the loss is the same value: the same calls
            # (the kept tuple itself, which the plans' keys hold: compared by identity) and the same answer
            calls, (leaves, needed) = script.calls, script.leaves
        else:
            calls = tuple(self.sig)
            leaves, needed = self.leaves(loss_fid, calls) if loss is not None else ((), frozenset())
        for o in alive:
            if self.rg[o._fid] and o._fid not in needed:
                # eager could still differentiate it (a GAN's detached fake, a backward after mark_step)
                raise Demote("a value that requires grad kept past the backward, outside the loss's graph"
                             if loss is not None else "a value that requires grad kept past mark_step")
        roots = []
        for o in alive:
            r = self.root[o._fid]
            if r not in roots:
                roots.append(r)
        views = [o for o in alive if self.root[o._fid] != o._fid]
        value_fids = roots + [o._fid for o in views]
        FAST.segment = None
        METRICS.fast_segments += 1
        rec = RECORDER
        with rec.lock:
            trace = rec.trace
            if not trace.entries:
                rec.trace_started = self.started
                rec.meta_seconds = 0.0
            rec.meta_seconds += self.meta_seconds
            epoch = trace.epoch
            # (with the values computed for reads: a binding of a dynamic-shape step passes them, fast_match.py)
            sig: list = ["fused", calls, leaves, loss_fid,
                         tuple(value_fids), tuple(self.evaluated), self.read_upto]
            reads: list = []
            enc_args = [rec.encode(x, sig, reads) for x in self.externals]
            kind = out_kind(len(trace.entries))
            out_vids = []
            grads = []
            device, step, tensors = self.device, RECORDER.step_id, trace.tensors
            for i in leaves:
                p = self.externals[i]
                size, stride, nbytes, dtype, mk, meta = gradient_layout(p._mk)
                # (`_new_value` without LazyTensor's checks: the layout and its key come from the parameter's)
                storage = LazyStorage(nbytes, None, epoch, step)
                g = _make_wrapper(LazyTensor, size, strides=stride, dtype=dtype, device=device)
                g._storage = storage
                g._mk = mk
                g._vid = storage.creator = vid = trace.new_value(kind, storage, meta)
                g._epoch = epoch
                tensors[vid] = weakref.ref(g)
                out_vids.append(vid)
                grads.append((p, g))
            storages = {}
            by_fid = {o._fid: o for o in alive}
            for fid in value_fids:
                size, stride, offset, dtype, nbytes = self.metas[fid]
                o = by_fid.get(fid)
                r = self.root[fid]
                storage = storages.get(r) if r != fid else None
                t = self._new_value(trace, kind, size, stride, offset, dtype, nbytes, storage, epoch, o)
                if r == fid:
                    storages[fid] = t._storage
                out_vids.append(t._vid)
            fused = FusedStep(tuple(self.entries), len(self.externals), leaves,
                              loss_fid, tuple(value_fids), self.device.type,
                              tuple(self.written))
            fused.evaluated, fused.read_upto, fused.draws = self.evaluated, self.read_upto, self.draws
            if trace.rng_note is None:
                trace.rng_note = self.rng_note
            writes = []
            for i in self.written:
                storage = self.externals[i]._storage
                storage.written = True
                writes.append(storage)
            self._written_done()
            trace.entries.append(Entry(fused, enc_args, {}, tuple(out_vids), list, tuple(reads), tuple(writes),
                                       tuple(sig), user_source(4) if rec.capture_sources else None))
            trace.fused += 1
            METRICS.recorded_ops += 1
            for p, g in grads:
                with _NO_SUBCLASS():
                    if _GRAD(p) is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)
        for o in alive:
            o._fid = None
            o._fseg = None
        FAST.note(self.armed_by, demoted=False)
        if self.log is not None:
            module, training = self.armed_by
            FAST.scripts.setdefault(module, {})[(training, self.device)] = Script(
                self.log, calls, loss_fid, (leaves, needed))

    def _new_value(self, trace, kind, size, stride, offset, dtype, nbytes, storage, epoch, obj=None):
        fresh = storage is None
        if fresh:
            storage = LazyStorage(nbytes, None, epoch, RECORDER.step_id)
        if obj is None:
            obj = LazyTensor(size, stride, offset, dtype, self.device, storage)
        else:
            obj._storage = storage
            obj._mk = layout_key(size, tuple(stride), offset, dtype, storage.nbytes, self.device)
        vid = trace.new_value(kind, storage, (size, tuple(stride), offset, dtype))
        if fresh:
            storage.creator = vid
        obj._vid = vid
        obj._epoch = epoch
        trace.tensors[vid] = weakref.ref(obj)
        return obj

    def leaves(self, loss: int, calls: tuple) -> tuple[tuple, frozenset]:
        """Input slots that get a gradient: parameters (leaves that require grad) the loss depends on
        through values that require grad, connected as autograd's graph of each call connects them
        (`Recipe.connected`); and the values the loss's gradient flows through. `calls`: the calls'
        signatures. The same calls with the same recipes (which hold their arguments' layouts and
        `requires_grad`, so which values require grad and what each call connects) give the same answer:
        kept per (calls, recipes, loss) (a step of HF GPT-2 spent 90-110 us here, the MLP 10)."""
        recipes = tuple([recipe for recipe, _ in self.links])
        key = (calls, tuple(map(id, recipes)), loss)
        found = _LEAVES.get(key)
        if found is not None:
            return found[0]
        found = self._leaves(loss)
        if len(_LEAVES) >= _LEAVES_KEPT:
            _LEAVES.clear()
        _LEAVES[key] = (found, recipes)     # (the recipes kept alive: no other recipe gets their ids)
        return found

    def _leaves(self, loss: int) -> tuple[tuple, frozenset]:
        needed = {loss}
        reached = set()
        for i in range(len(self.entries) - 1, -1, -1):
            func, args, kwargs, out_fids, _, _ = self.entries[i]
            if not any(f in needed and self.rg[f] for f in out_fids):
                continue
            recipe, slots = self.links[i]
            connected = recipe.connected
            for k, v in enumerate(slots):
                if k not in connected:
                    continue
                if type(v) is FV:
                    if self.rg[v.fid]:
                        needed.add(v.fid)
                else:
                    reached.add(v.index)
        out = []
        for i in sorted(reached):
            t = self.externals[i]
            if type(t) is LazyTensor and t.requires_grad:
                out.append(i)
        return tuple(out), frozenset(needed)

    def abandon(self, alive: list) -> None:
        """The step raised (as eager's backward would): the segment is closed, its values hold nothing."""
        FAST.segment = None
        self._written_done()
        for o in alive:
            o._fid = None
            o._fseg = None

    def _written_done(self) -> None:
        """The segment ends: the inputs it wrote are the trace's to answer for (or were never written)."""
        for i in self.written:
            self.externals[i]._storage.fast_written = False


_DEVICE_NAMES: dict[str, torch.device | None] = {}


def _device_named(s: str) -> torch.device | None:
    """The device a string argument names ("cuda:0", "meta"), or None ("mean", "tanh", "ij,jk->ik"); cached."""
    if s in _DEVICE_NAMES:
        return _DEVICE_NAMES[s]
    try:
        d = torch.device(s)
    except (RuntimeError, ValueError):
        d = None
    if len(_DEVICE_NAMES) < 4096:
        _DEVICE_NAMES[s] = d
    return d


def _find(args, kwargs, slot: int):
    """The argument object at tensor slot `slot` (in encoding order). Written without a recursive closure:
    a nested function that calls itself is a reference cycle, and this one would hold the tensors it
    found until the next cyclic collection (which `Segment.close` would then have to run)."""
    stack = list(reversed(args))
    if kwargs:
        stack[:0] = reversed(list(kwargs.values()))
    seen = 0
    while stack:
        a = stack.pop()
        if isinstance(a, _Tensor):
            if seen == slot:
                return a
            seen += 1
        elif type(a) is list or type(a) is tuple:
            stack.extend(reversed(a))
    raise IndexError(slot)
