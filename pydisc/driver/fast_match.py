"""Steps recorded at `__torch_function__` served by dynamic-shape templates.

A template is recorded once by the dispatcher, with symbolic sizes, and later steps are matched to it
entry by entry (dynamic.py, template_match.py). A step the fast recorder made (frontend/fast.py) holds
its forward and backward as one `FusedStep` entry, which no entry of a template matches. So when such a
step's structure is new (its plan-cache key missed), its ATen-level form is recorded once (`_expand`):
the fused entry's calls run again through the dispatcher on lazy tensors over the same storages, with
autograd, and its backward with `torch.autograd.backward`, as the dispatcher records a user's
`loss.backward()`; the entries around it (the optimizer's) are dispatched again. That is recording
only: reading device data raises (the step is then not served), as does drawing random numbers (torch's
generators are put back), and the recorder's state and counters are put back afterwards. The binding
the ATen-level trace gets from a template is then restated in the fast step's terms (its input storages,
eager tensors, lifted scalars, values computed for reads, outputs) and cached under the fast step's key,
so later steps of that structure cost one lookup, as any other.

Where the ATen-level form cannot be recorded, or no template takes it, the step goes on as a
dispatcher-recorded step that matched none (step.py); after `GIVE_UP_AFTER` such steps in a row the
model's steps are recorded by the dispatcher from then on (`DynamicState.fast_refused`).
"""
from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..frontend.foreach import SplitForeach
from ..frontend.fused import XV, FusedStep, autograd_dispatched
from ..frontend.layout import contiguous_strides, flat_base, numel, view_of_base
from ..frontend.lazy_tensor import RECORDER, LazyTensor
from ..frontend.random_state import get_rng_state, set_rng_state
from ..frontend.trace import LazyStorage, RealRef, ScalarRef, Trace, ValueRef
from ..metrics import METRICS
from .dynamic import Binding, MadeBy, Recomputed, StepReal
from .engine import ENGINE
from .slices import observable_entries
from .template_match import match_template

__all__ = ["match_fast", "GIVE_UP_AFTER"]

# Fast steps in a row that no template took, after which the model's steps are recorded by the dispatcher.
GIVE_UP_AFTER = 2

# The epoch of an expansion's trace: no real trace has it (theirs count up from 0; -1 is a storage's "none")
_EPOCH = -2


class _Unexpandable(Exception):
    pass


@dataclass
class _Expansion:
    trace: Trace            # the ATen-level trace
    outputs: tuple          # the fast step's outputs in its terms, in the fast step's order
    storage_of: dict        # its input storage index -> the fast step's
    real_of: dict           # its eager input index -> the fast step's
    scalar_of: list         # per lifted scalar: the fast step's index, or None (a constant of the fast step's key)
    needed: list            # its entries that make or write what the outputs or the inputs hold


def match_fast(trace: Trace, executed: list[int], outputs: tuple) -> Binding | None:
    """A binding of the fast-recorded step to one of the model's templates, in the fast step's terms;
    None where there is none (the reason in `ENGINE.dynamic.last_mismatch`). A step that a read ran in
    part is not tried (nor would the dispatcher's steps of it match)."""
    state = ENGINE.dynamic
    if len(executed) != len(trace.entries) or trace.partly_run:
        return None
    try:
        x = _expand(trace, outputs)
    except Exception as exc:     # noqa: BLE001 - any failure only means this path does not apply
        state.last_mismatch = "the fast step's ATen-level form could not be recorded (%s: %s)" % (
            type(exc).__name__, exc)
        _missed()
        return None
    # all of it, as the dispatcher records; then without what nothing reads (`mask.all()`, computed for a
    # read: the dispatcher's read ran it and took it out of the trace)
    for steps in (list(range(len(x.trace.entries))), x.needed):
        for template in state.templates:
            binding = match_template(template, x.trace, steps, x.outputs)
            if binding is not None:
                state.fast_misses = 0
                return _restated(binding, x)
    _missed()
    return None


def _missed() -> None:
    """A fast step that a model with templates could not match: after `GIVE_UP_AFTER` in a row, its steps
    are recorded by the dispatcher, which matches them as before."""
    state = ENGINE.dynamic
    state.fast_misses += 1
    if state.fast_misses >= GIVE_UP_AFTER:
        _refuse("dynamic shapes: no template takes the fast step")


def _refuse(reason: str) -> None:
    state = ENGINE.dynamic
    if not state.fast_refused:
        state.fast_refused = True
        METRICS.fast_demotions[reason] += 1


def _restated(binding: Binding, x: _Expansion) -> Binding:
    return Binding(binding.template, binding.view_sizes,
                   [None if j is None else x.storage_of[j] for j in binding.storage_order],
                   [x.real_of[j] for j in binding.real_order], binding.perm, binding.sizes,
                   scalar_map=[(i, value) for i, value in zip(x.scalar_of, x.trace.scalars)])


def _no_reads(t, reason: str) -> None:
    raise _Unexpandable("it reads device data (%s)" % reason)


def _expand(trace: Trace, outputs: tuple) -> _Expansion:
    rec = RECORDER
    x = Trace(epoch=_EPOCH)
    storages = list(trace.input_storages)
    saved_fields = [(s.epoch, s.creator, s.written, s.input_index) for s in storages]
    saved = (rec.trace, rec.trace_started, rec.meta_seconds, rec.prune_at, rec.carried_dims, rec.capture_sources,
             rec.executor, rec.gc_paused, gc.isenabled())
    counters = _counters()
    rng = _rng_states(trace)
    rec.trace, rec.prune_at, rec.carried_dims, rec.capture_sources, rec.executor = x, 1 << 62, None, False, _no_reads
    try:
        with torch._C.DisableTorchFunctionSubclass():
            env, scalar_of, made, read, log = _replay(trace, x)
        if not _same_rng(rng, _rng_states(trace)):
            # a call's Python code drew random numbers into an eager tensor (`F.fractional_max_pool2d`'s
            # samples): drawn again here, which eager did not, and kept for later steps, which it must not
            raise _Unexpandable("random numbers drawn while recording")
        x_index = {id(s): j for j, s in enumerate(x.input_storages)}
        fast_index = {id(s): i for i, s in enumerate(storages)}
        storage_of = {}
        for j, s in enumerate(x.input_storages):
            source = fast_index.get(id(s))
            if source is None and id(s) in read:
                source = read[id(s)][0]
            if source is None:
                raise _Unexpandable("an input storage the fast step does not read")
            storage_of[j] = source
        budget = [CONSTANT_BYTES]
        real_of = {j: _real_source(trace, t, x.real_versions[j], made, budget, log)
                   for j, t in enumerate(x.real_inputs)}
        x_outputs = _outputs(trace, outputs, x, env, x_index)
        needed = observable_entries(x, {id(x.storages[v]) for kind, v in x_outputs if kind == "value"})
    finally:
        for s, (epoch, creator, written, index) in zip(storages, saved_fields):
            s.epoch, s.creator, s.written, s.input_index = epoch, creator, written, index
        (rec.trace, rec.trace_started, rec.meta_seconds, rec.prune_at, rec.carried_dims, rec.capture_sources,
         rec.executor, rec.gc_paused, enabled) = saved
        if enabled != gc.isenabled():
            (gc.enable if enabled else gc.disable)()
        _restore_counters(counters)
        _restore_rng(rng)
    return _Expansion(x, x_outputs, storage_of, real_of, scalar_of, needed)


def _counters() -> tuple:
    """What recording can count (`_restore_counters` puts it back): the expansion is not a step's."""
    m = METRICS
    return (m.recorded_ops, m.materializations, Counter(m.materialization_sources), Counter(m.fallback_ops),
            dict(m.fallback_sources), {op: set(d) for op, d in m.fallback_dtypes.items()})


def _restore_counters(saved: tuple) -> None:
    m = METRICS
    (m.recorded_ops, m.materializations, m.materialization_sources, m.fallback_ops, m.fallback_sources,
     m.fallback_dtypes) = saved


def _rng_states(trace: Trace) -> list:
    """torch's generators the step's device draws from: the CPU's, and its GPU's."""
    states = [(None, get_rng_state())]
    for s in trace.input_storages:
        device = s.real.device if s.real is not None else None
        if device is not None and device.type == "cuda":
            states.append((device, get_rng_state(device)))
            break
    return states


def _same_rng(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def _restore_rng(states: list) -> None:
    for device, state in states:
        if device is None:
            if not torch.equal(get_rng_state(), state):
                set_rng_state(state)
        elif not torch.equal(get_rng_state(device), state):
            set_rng_state(state, device)


def _real_source(trace: Trace, t: torch.Tensor, version: int, made: dict, budget: list, log: _EagerOps):
    """What the fast step passes for an eager tensor `t` of the ATen-level trace (`version`: its version
    when the trace took it): its own eager input (the same tensor); a view torch took of one inside a
    call (per step, of that step's tensor); `t` itself, a constant of the fast step's structure, where
    torch made it inside a call from what the step's key holds: from lazy tensors' sizes and Python
    values alone (a call without eager tensor arguments: a causal mask), or a Python number wrapped as a
    tensor (`torch.where(mask, x, -inf)`: a single number equal to a float argument); or, where torch made
    it inside a call by ATen ops that `log` saw, from the step's eager inputs (the additive float mask that
    `F.scaled_dot_product_attention` makes of an eager boolean one), those ops, run again on each step's
    inputs (`Recomputed`; also a constant too large to keep). A single number made in the backward is a
    constant too where the step has no single-number eager input (of whose value it could be made:
    `x ** t`'s gradient takes `t - 1`). `budget`: bytes left for constants."""
    i = trace.real_index.get(id(t))
    if i is not None:
        return i
    call = made.get(id(t))
    eager_args = call[2] if call is not None else trace.real_inputs
    bases = [r for r in eager_args if _within(t, r)]
    if len(bases) == 1:
        base = bases[0]
        i = trace.real_index.get(id(base))
        if i is None:
            raise _Unexpandable("a view of an eager tensor the fast step does not read")
        return ("view", i, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
    if bases or t._version != version:
        raise _Unexpandable("an eager tensor torch made and then changed, or a view of several")
    if call is not None:
        _, numbers, eager_args = call
        constant = not eager_args or (t.numel() == 1 and _is_number_of(t, numbers))
    else:       # made in the backward: from a backward formula's numbers, or from an eager scalar's value
        constant = t.numel() == 1 and not any(r.numel() == 1 for r in trace.real_inputs)
    nbytes = t.numel() * t.element_size()
    if (not constant or nbytes > budget[0]) and call is not None:
        recomputed = _recomputed(t, trace, log)
        if recomputed is not None:
            return recomputed
    if not constant or nbytes > budget[0]:
        raise _Unexpandable("an eager tensor of shape %s that torch made inside a call from the step's "
                            "eager inputs" % (tuple(t.shape),))
    budget[0] -= nbytes
    return ("const", t)


class _EagerOps(TorchDispatchMode):
    """While a fast step's forward is dispatched again (`_fused`): the ATen ops torch runs on eager tensors
    alone inside the calls, and which of them made each eager tensor (`made`: its id -> (op index, output
    position, the tensor's version then)), for `_recomputed`. The ops on lazy tensors pass through."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []         # (op, args, kwargs, outputs); holding them keeps the ids in `made` unique
        self.made: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not any(type(a) is LazyTensor for a in pytree.tree_leaves((args, kwargs))):
            k = len(self.ops)
            self.ops.append((func, args, kwargs, out))
            for j, o in enumerate(pytree.tree_leaves(out)):
                if isinstance(o, torch.Tensor):
                    self.made[id(o)] = (k, j, o._version)
        return out


# At most this many ATen ops make an eager tensor again at each step (`_recomputed`)
MAX_RECOMPUTED_OPS = 16
_UNINITIALIZED = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                  torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided}


class _NotRecomputable(Exception):
    pass


def _recomputed(t: torch.Tensor, trace: Trace, log: _EagerOps) -> Recomputed | None:
    """The ATen ops `log` saw make `t` from the fast step's own eager inputs, to run again at each step
    (`dynamic.Recomputed`); None where some tensor they read is not one of those inputs or made by such
    an op, or an op writes, draws random numbers, has a shape of the data or leaves memory unset."""
    ops: list = []
    index: dict[int, int] = {}      # the log's op -> its place in `ops`

    def ref(a):
        if not isinstance(a, torch.Tensor):
            return a
        i = trace.real_index.get(id(a))
        if i is not None:
            return StepReal(i)
        where = log.made.get(id(a))
        if where is None or where[2] != a._version:
            raise _NotRecomputable
        k, j, _ = where
        if k not in index:
            func, args, kwargs, _ = log.ops[k]
            if not _recomputable(func) or len(ops) >= MAX_RECOMPUTED_OPS:
                raise _NotRecomputable
            args, kwargs = pytree.tree_map(ref, (args, kwargs))
            index[k] = len(ops)
            ops.append((func, args, kwargs))
        return MadeBy(index[k], j)

    try:
        result = ref(t)
    except _NotRecomputable:
        return None
    return Recomputed(tuple(ops), result) if type(result) is MadeBy else None


def _recomputable(func) -> bool:
    return isinstance(func, torch._ops.OpOverload) and not func._schema.is_mutable and \
        torch.Tag.nondeterministic_seeded not in func.tags and torch.Tag.dynamic_output_shape not in func.tags and \
        func.overloadpacket not in _UNINITIALIZED


def _within(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `t` views memory inside `base`'s (same storage, dtype, and extent)."""
    if t.dtype != base.dtype or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or \
            not t.untyped_storage().data_ptr() or t.numel() == 0:
        return False
    lo, hi = _extent(t)
    base_lo, base_hi = _extent(base)
    return base_lo <= lo and hi <= base_hi


def _extent(t: torch.Tensor) -> tuple[int, int]:
    lo = hi = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return lo, hi


def _is_number_of(t: torch.Tensor, numbers: set) -> bool:
    """Whether the single number `t` holds is one of a call's float arguments (ints and bools are not
    taken: `dim=1` equals too many numbers made from data)."""
    value = t.item()
    return t.is_floating_point() and any(type(n) is float and (n == value or n != n and value != value)
                                         for n in numbers)


# Bytes of eager tensors a fast step's binding may keep as constants of its structure (`_real_source`)
CONSTANT_BYTES = 1 << 20


def _outputs(trace: Trace, outputs: tuple, x: Trace, env: dict, x_index: dict) -> tuple:
    """The fast step's outputs as values and written storages of the ATen-level trace `x`."""
    written = set()
    for e in x.entries:
        for s in e.writes:
            if s.epoch == x.epoch and s.input_index >= 0:
                written.add(s.input_index)
    out = []
    for kind, index in outputs:
        if kind == "base":
            j = x_index.get(id(trace.input_storages[index]))
            if j is None or j not in written:
                raise _Unexpandable("a written input")
            out.append(("base", j))
            continue
        t = env.get(index)
        storage = t._storage if type(t) is LazyTensor else None
        if storage is None or storage.epoch != x.epoch or storage.creator is None:
            raise _Unexpandable("an output")
        creator = storage.creator
        if t._vid != creator or t._epoch != x.epoch:
            # the value is a view of what a call made (`einsum`'s permuted product): binding copies the
            # template's result into the value's layout as a reshape, which is that view only where both
            # are contiguous and whole
            size, stride, offset, _ = x.metas[creator]
            if offset or t.storage_offset() or not t.is_contiguous() or t.numel() != numel(size) or \
                    tuple(stride) != contiguous_strides(size):
                raise _Unexpandable("an output that is a view of another value")
        out.append(("value", creator))
    if len(set(out)) != len(out) or written != {j for kind, j in out if kind == "base"}:
        raise _Unexpandable("the outputs")
    return tuple(out)


def _replay(trace: Trace, x: Trace) -> tuple[dict, list, dict, dict, _EagerOps]:
    """Dispatch `trace`'s entries again, into `x` (the recorder's trace now): {fast value id: the lazy
    tensor of `x` that stands for it}; per scalar of `x` the fast step's index (None: a constant); for
    the eager tensors `x` reads that torch made inside a fused call, {id: (whether the call had eager
    tensor arguments, the Python numbers among them)}; and for the storages of the values a fused
    forward computed for a read, {id: (("read", its entry, a value of it), the storage)}; and the ATen
    ops torch ran on eager tensors alone inside the fused forwards' calls (`_EagerOps`)."""
    env: dict[int, LazyTensor] = {}
    leaves = set()      # values the fused forward differentiates: leaves that require grad, as parameters are
    for e in trace.entries:
        if type(e.fn) is FusedStep:
            leaves.update(e.args[i].vid for i in e.fn.leaves if type(e.args[i]) is ValueRef)

    def value(vid: int) -> LazyTensor:
        t = env.get(vid)
        if t is None:
            kind = trace.values[vid]
            if kind[0] != "in":
                raise _Unexpandable("a value no entry made")
            real = trace.storage_inputs[kind[1]]
            size, stride, offset = kind[2]
            t = env[vid] = LazyTensor(size, stride, offset, trace.metas[vid][3], real.device,
                                      trace.input_storages[kind[1]], real=view_of_base(real, size, stride, offset),
                                      requires_grad=vid in leaves)
        return t

    scalar_of: list = []
    made: dict = {}
    read: dict = {}
    log = _EagerOps()

    def decode(a, refs: list):
        kind = type(a)
        if kind is ValueRef:
            return value(a.vid)
        if kind is RealRef:
            return trace.real_inputs[a.index]
        if kind is ScalarRef:
            refs.append(a.index)
            return trace.scalars[a.index]
        if kind is list or kind is tuple:
            return kind(decode(v, refs) for v in a)
        return a

    for index, e in enumerate(trace.entries):
        before = len(x.scalars)
        refs: list = []
        args = [decode(a, refs) for a in e.args]
        kwargs = {k: decode(v, refs) for k, v in e.kwargs.items()}
        if type(e.fn) is FusedStep:
            out = _fused(e.fn, args, x, made, _read_values(e.fn.evaluated, index, read), log)
            scalar_of += [None] * (len(x.scalars) - before)    # Python floats of its calls: in its key
            if refs:
                raise _Unexpandable("a lifted scalar read by a fused forward")
        else:
            fn = e.fn.func if type(e.fn) is SplitForeach else e.fn
            if not isinstance(fn, torch._ops.OpOverload):
                raise _Unexpandable("an entry of %s" % e.fn)
            with torch.no_grad():     # recorded below autograd (the optimizer's step, in place on parameters)
                out = fn(*args, **kwargs)
            # the floats it lifts again, in its arguments' order
            if len(x.scalars) - before != len(refs) or \
                    any(x.scalars[before + k] != trace.scalars[i] for k, i in enumerate(refs)):
                raise _Unexpandable("the lifted scalars of %s" % fn)
            scalar_of += refs
        if e.out_kind is None:
            if e.out_vids and e.out_vids[0] is not None:
                env[e.out_vids[0]] = out
        else:
            for vid, o in zip(e.out_vids, out):
                if vid is not None:
                    env[vid] = o
    return env, scalar_of, made, read, log


def _read_values(evaluated: dict, index: int, read: dict) -> dict:
    """The values a fused forward computed for a read, as lazy tensors holding that data: the dispatcher's
    read ran the ops that make them, and the rest of its step reads them as inputs. One storage per
    block of memory, as their views share one there; noted in `read`."""
    storages: dict[int, LazyStorage] = {}
    out = {}
    for fid, t in evaluated.items():
        ptr = t.untyped_storage().data_ptr()
        storage = storages.get(ptr)
        if storage is None:
            storage = storages[ptr] = LazyStorage(t.untyped_storage().nbytes(), flat_base(t))
            read[id(storage)] = (("read", index, fid), storage)     # (kept: ids of storages alive only)
        out[fid] = LazyTensor(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, storage, real=t)
    return out


def _fused(fused: FusedStep, inputs: list, x: Trace, made: dict, given: dict, log: _EagerOps) -> list:
    """A fused forward and its backward, dispatched: the gradients of its leaves (in their `.grad`, by
    `torch.autograd.backward`, as eager's backward leaves them), then the values alive at its end. Notes
    in `made` the eager tensors torch made inside each call, and in `log` the ops that made them
    (`_real_source`). `given`: values computed for a read, taken as they are."""
    last = [len(x.real_inputs), None]

    def note(k: int) -> None:
        for t in x.real_inputs[last[0]:]:
            made.setdefault(id(t), last[1])
        last[0] = len(x.real_inputs)
        if k < len(fused.entries):
            _, args, kwargs, *_ = fused.entries[k]
            leaves = pytree.tree_leaves((args, kwargs))
            eager = [inputs[v.index] for v in leaves if type(v) is XV and type(inputs[v.index]) is not LazyTensor]
            last[1] = (bool(eager), {v for v in leaves if type(v) is float}, eager)

    with autograd_dispatched():
        with log:
            env = fused.forward(inputs, note, given, fused.read_upto)
        note(len(fused.entries))
        if fused.loss is None:
            return [env[f] for f in fused.outputs]
        values = [env[f] for f in fused.outputs]
        loss = env[fused.loss]
        env = None      # the forward's other values die with the graph, as in eager
        if loss.device.type == "cpu":
            torch.autograd.backward(loss)
        else:
            # autograd runs the backward of a GPU tensor on a thread of its own, which records through the
            # recorder's lock, held here (by mark_step or a read): let go of meanwhile. (A thread other than
            # autograd's that recorded in that window would record into the expansion's trace: one step
            # recorded from several threads on a GPU is not matched this way, docs/dynamic.md.)
            lock = RECORDER.lock
            state = lock._release_save()
            try:
                torch.autograd.backward(loss)
            finally:
                lock._acquire_restore(state)
    grads = [inputs[i].grad for i in fused.leaves]
    if any(type(g) is not LazyTensor for g in grads):
        raise _Unexpandable("a parameter without a gradient")
    return grads + values
