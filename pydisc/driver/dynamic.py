"""Dynamic shapes: one plan serves every size of a dynamic dim.

The policy, as in `torch.compile`'s automatic dynamic shapes:

* a dim is dynamic from the start if the user said so (`pydisc.mark_dynamic(t, dim)`), or once a
  graph recurs with the same ops and a different size in that dim of a step input (that step runs
  eagerly, so no compile is spent on one shape);
* the next step with dynamic dims is recorded symbolically (`frontend/symbolic.py`) and planned once
  as a *template*: its inputs have `?` dims and every size argument is an expression of them;
* later steps are recorded concretely, at full speed, and matched against the templates: the same
  ops in the same order, every int argument equal to the template's expression evaluated with this
  step's sizes, every guard torch added while tracing true. The match is cached by the step's
  structural key, so a size seen before costs one dict lookup.

Sizes 0 and 1 are specialised (torch does the same): a step where a dynamic dim is 1 gets a template
of its own. `PYDISC_DYNAMIC=0` turns all of this off: one static plan per shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from ..config import CONFIG, applies
from ..frontend.fast import set_gate as set_fast_gate
from ..frontend.layout import contiguous_strides, flat_base, numel
from ..frontend.lazy_tensor import RECORDER
from ..frontend.tensor import LazyTensor
from ..frontend.op_facts import opinfo
from ..frontend.replay import Program
from ..frontend.symbolic import SymExpr
from ..frontend.trace import RealRef, ScalarRef, Trace, ValueRef
from .engine import ENGINE

__all__ = ["mark_dynamic", "Template", "Binding", "MadeBy", "Recomputed", "StepReal", "clear"]


def mark_dynamic(t: torch.Tensor, dim: int | list[int] | tuple[int, ...]) -> torch.Tensor:
    """Declare dim(s) `dim` of the step input `t` dynamic: the first compile already serves every
    size of it. Call it on the eager tensor before it enters the model (or `pydisc.to_lazy`)."""
    if isinstance(t, LazyTensor):
        raise TypeError("pydisc.mark_dynamic: call it on the eager input tensor before it is passed to the "
                        "lazy model or to pydisc.to_lazy (this tensor is already lazy)")
    if not isinstance(t, torch.Tensor):
        raise TypeError("pydisc.mark_dynamic expects a torch.Tensor, got %s" % type(t).__name__)
    dims = [dim] if isinstance(dim, int) else list(dim)
    for d in dims:
        if not -t.dim() <= d < max(t.dim(), 1):
            raise IndexError("pydisc.mark_dynamic: dim %d is out of range for a tensor of shape %s"
                             % (d, tuple(t.shape)))
    t._pydisc_dynamic = frozenset(getattr(t, "_pydisc_dynamic", frozenset()) | {d % t.dim() for d in dims})
    return t


def clear() -> None:
    """Forget the templates and the dims flagged dynamic."""
    ENGINE.reset_dynamic()


def _pattern(key, real: torch.Tensor, dims) -> tuple:
    return (key, real.dim(), tuple(sorted(d for d in dims if d < real.dim() and real.shape[d] >= 2)))


def dims_of(ordinal: int, real: torch.Tensor) -> tuple:
    """Which dims of this step input are recorded symbolically (the recorder asks, per input)."""
    if not CONFIG.dynamic:
        return ()
    marked = getattr(real, "_pydisc_dynamic", ())
    if marked:      # remembered: a later step's changed sizes in these dims are nothing new
        ENGINE.dynamic.flagged.setdefault(ordinal, set()).update(marked)
    return _dynamic_dims(ordinal, real)


def carried_dims(index: int, real: torch.Tensor) -> tuple:
    """Which dims of the step's index-th input storage, made by an earlier step, are recorded
    symbolically (the recorder asks, per input storage, while some are flagged)."""
    return _dynamic_dims(("carried", index), real) if CONFIG.dynamic else ()


def _dynamic_dims(key, real: torch.Tensor) -> tuple:
    state = ENGINE.dynamic
    flagged = state.flagged.get(key)
    if not flagged:
        return ()       # (every step input of a model with no dynamic dims)
    dims = {d for d in flagged if (key, d) not in state.blocked}
    pattern = _pattern(key, real, dims)
    if not pattern[2]:
        return ()       # sizes 0 and 1 are specialised: nothing to make symbolic in this input
    epoch = RECORDER.step_id
    mode = state.step_mode.get(epoch)
    if mode is None:
        # the step's first dynamic input decides: symbolic unless a template covers its sizes
        mode = state.force_symbolic or pattern not in state.covered
        state.step_mode.clear()
        state.step_mode[epoch] = mode
        state.force_symbolic = False
    return tuple(sorted(dims)) if mode else ()


def _fast_gate() -> bool:
    """Whether the fast recorder may record this step. Where the model has dynamic dims: once it has a
    template (which only the dispatcher records, symbolically: a step it does not cover is recorded so),
    for inputs of sizes a step of it had before (`note_shapes`), unless its fast steps failed to match
    (`fast_match.py`) or a carried tensor (a KV cache) has dynamic dims. A fast step of new sizes records
    twice, itself and its ATen-level form, both working out the metadata of every op anew: sizes seen
    once are likely to come again, and from then on their steps are a plan-cache hit. Otherwise not a
    step whose inputs so far have other sizes than the step before's: the dispatcher records it and its
    changed dims are found (and the step choice's probe times the recording that the steps to come will
    have)."""
    state = ENGINE.dynamic
    if state.flagged:
        if state.fast_refused or RECORDER.carried_dims is not None:
            return False
        seen = tuple(RECORDER.input_shapes) in state.shapes_seen
        state.new_sizes = state.new_sizes or not seen       # (`took_new_sizes`)
        return seen and bool(state.templates)
    shapes, last = RECORDER.input_shapes, RECORDER.last_input_shapes
    new = bool(CONFIG.dynamic and last and shapes != last[:len(shapes)])
    state.new_sizes = state.new_sizes or new
    return not new


set_fast_gate(_fast_gate)


def took_new_sizes() -> bool:
    """At mark_step: whether the step was recorded op by op only because its input sizes were new
    (`_fast_gate` said so, where nothing else kept the fast recorder off): the steps of sizes seen before
    record fast, and that is the recording the step choice's probe must time (step_choice.py)."""
    state = ENGINE.dynamic
    new, state.new_sizes = state.new_sizes, False
    return new


# Sizes of step inputs remembered per model, for `_fast_gate`: beyond this many, the oldest half goes.
SHAPES_KEPT = 4096


def note_shapes() -> None:
    """At mark_step: the shapes of the step's inputs, and those of its first inputs (what a forward has
    seen when its first call asks `_fast_gate`), for the model's dims that become dynamic later."""
    if not CONFIG.dynamic:
        return
    state = ENGINE.dynamic
    shapes = RECORDER.input_shapes
    seen = state.shapes_seen
    if len(seen) > SHAPES_KEPT:
        for key in list(seen)[:len(seen) // 2]:
            del seen[key]
    for k in range(1, len(shapes) + 1):
        seen[tuple(shapes[:k])] = None


# --------------------------------------------------------------------------------------------------

@dataclass
class Template:
    program: Program
    plan: object                     # StepPlan of the symbolic graph
    guards: list                     # sympy booleans over the size symbols
    in_layouts: dict                 # template input vid -> (storage index, layout or None)
    metas: dict                      # template vid -> (size, stride, offset) as SymExpr/int
    deferrable: list                 # per entry: "view" (a view op) | "pure" (writes nothing) | None
    patterns: list                   # (ordinal, rank, dims) covered
    session: object = None           # the SymbolicStep (its ShapeEnv holds the guards)
    storage_types: tuple = ()        # (dtype, device) of each input storage
    real_types: tuple = ()           # (shape, stride, dtype, device) of each eager input; for a value
                                     # on sizes alone ((size, stride, offset) expressions, dtype, device)
    real_sources: tuple = ()         # per eager input: ("real", index in the recorded step) | ("value", vid)
    fakes: list | None = None        # fake inputs to plan with, until the plan is built
    sources: list | None = None
    steps: int = 0
    building: bool = False           # its plan is being built in the background (pydisc/driver/background.py)


@dataclass
class Binding:
    """A concrete step structure bound to a template: how to call the template's plan."""

    template: Template
    view_sizes: dict                 # template storage index -> concrete size of the viewed input
    storage_order: list              # template storage index -> concrete one (None: not read; fast_match.py:
                                     # or a source)
    real_order: list                 # template real index -> concrete real index (fast_match.py: or a source,
                                     # `_derived`)
    perm: list                       # concrete output k -> template output index
    sizes: dict                      # symbol -> value (for reports)
    # a fast-recorded step's (fast_match.py): per template scalar, (the step's scalar index, or None for
    # a constant of its structure, and the value it had)
    scalar_map: list | None = None
    graph: object = None             # the step at these sizes captured as a CUDA graph (exec/graphs.StepGraph)

    def scalar_values(self, trace: Trace) -> list[float]:
        return [value if i is None else trace.scalars[i] for i, value in self.scalar_map]

    def inputs(self, trace: Trace, scalars: torch.Tensor | None) -> list:
        out = [None if j is None else _storage(j, trace).view(self.view_sizes[i]) if i in self.view_sizes
               else _storage(j, trace) for i, j in enumerate(self.storage_order)]
        out += [trace.real_inputs[j] if type(j) is int else _derived(j, trace) for j in self.real_order]
        if scalars is not None:
            out.append(scalars)
        return out


def _storage(source, trace: Trace) -> torch.Tensor:
    """An input storage's data: the step's own, or for a fast-recorded step's binding (fast_match.py), the
    memory of a value its forward computed for a read."""
    if type(source) is int:
        return trace.storage_inputs[source]
    _, entry, fid = source
    return flat_base(trace.entries[entry].fn.evaluated[fid])


@dataclass(frozen=True)
class StepReal:
    """In a `Recomputed` op's arguments: the step's eager input `index`."""
    index: int


@dataclass(frozen=True)
class MadeBy:
    """In a `Recomputed` op's arguments: output `output` (in pytree order) of its op `op`."""
    op: int
    output: int


@dataclass(frozen=True)
class Recomputed:
    """An eager input of a fast-recorded step's binding (fast_match.py) that torch made inside a call from
    the step's own eager inputs (`F.scaled_dot_product_attention` turns an eager boolean mask into an
    additive float one): the ATen ops that made it, run again on each step's inputs."""
    ops: tuple      # (op, args, kwargs), the tensors in them `StepReal` or `MadeBy` an earlier op
    result: MadeBy

    def __call__(self, trace: Trace) -> torch.Tensor:
        made: list[list] = []

        def arg(a):
            if type(a) is StepReal:
                return trace.real_inputs[a.index]
            if type(a) is MadeBy:
                return made[a.op][a.output]
            return a

        with torch.no_grad():
            for op, args, kwargs in self.ops:
                args, kwargs = pytree.tree_map(arg, (args, kwargs))
                made.append(pytree.tree_leaves(op(*args, **kwargs)))
        return arg(self.result)


def _derived(source, trace: Trace) -> torch.Tensor:
    """An eager input of a fast-recorded step's binding (fast_match.py) that is not one of its own."""
    if type(source) is Recomputed:
        return source(trace)
    if source[0] == "const":
        return source[1]
    _, index, size, stride, offset = source
    base = trace.real_inputs[index]
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _as_meta(x):
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        e = x.node.expr
        return int(e) if e.is_number else SymExpr(e)
    return x


def make_template(trace: Trace, program: Program, plan) -> Template:
    """The template of a symbolically recorded step: its program without the entries on sizes alone
    (`_without_size_only`), and what matching later concrete steps against it needs."""
    session = trace.symbolic
    metas = {}
    for vid in range(len(trace.values)):
        m = trace.sym_metas.get(vid) or trace.metas.get(vid)
        if m is not None:
            size, stride, offset = m[0], m[1], m[2]
            metas[vid] = (tuple(map(_as_meta, size)), tuple(map(_as_meta, stride)), _as_meta(offset))
    program, real_sources = _without_size_only(program, trace, metas)
    in_layouts = {vid: (index, layout) for vid, index, layout in program.inputs}
    deferrable = []
    for fn, args, kwargs, out_vids, kind in program.entries:
        if isinstance(fn, torch._ops.OpOverload) and not value_refs((args, kwargs), RealRef) and \
                not value_refs((args, kwargs), ScalarRef):
            info = opinfo(fn)
            deferrable.append(None if info.written_args else "view" if info.is_view else "pure")
        else:
            deferrable.append(None)
    real_types = []
    for kind, index in real_sources:
        if kind == "real":
            t = trace.real_inputs[index]
            real_types.append((tuple(t.shape), t.stride(), t.dtype, t.device))
        else:       # a value on sizes alone: its layout is checked as an expression of the sizes
            real_types.append((metas[index], trace.metas[index][3], _device_of_value(trace, index)))
    patterns = [(ordinal, rank, made) for ordinal, (storage, made, rank) in session.conversions.items()]
    return Template(program, plan, session.guards(), in_layouts, metas, deferrable, patterns, session,
                    tuple((s.dtype, s.device) for s in trace.storage_inputs), tuple(real_types),
                    real_sources=tuple(real_sources))


def _device_of_value(trace: Trace, vid: int) -> torch.device:
    ref = trace.tensors.get(vid)
    t = ref() if ref is not None else None
    if t is not None:
        return t.device
    return trace.storage_inputs[0].device if trace.storage_inputs else torch.device("cpu")


def _without_size_only(program: Program, trace: Trace, metas: dict) -> tuple[Program, list]:
    """`program` without the entries that compute on sizes and eager tensors alone (`torch.ones(T, T)
    .tril()`, the causal mask of torch's math attention, `torch.arange(T)`): a concrete step runs those
    in torch before anything lazy reads them, so its trace holds their results as eager inputs. Each
    such value that a remaining entry reads becomes an eager input of the template too, and a concrete
    step passes its own: nothing of it is recomputed or compared, whatever it holds (random numbers
    too). Returns the program and, per eager input of it, ("real", index in the recorded step) or
    ("value", the value's id)."""
    # inputs a read mid-step computed from sizes alone (`Trace.size_only_inputs`) count as such values
    size_only: set[int] = {vid for vid, index, _ in program.inputs if index in trace.size_only_inputs}
    kept = []
    outputs = {i for kind, i in program.outputs if kind == "value"}
    for entry in program.entries:
        fn, args, kwargs, out_vids, kind = entry
        refs = value_refs((args, kwargs))
        # (a Python float in such an op, lifted to a scalar input here, is one the concrete step does
        # not lift: it computes the op in torch, T5's relative position buckets divided by a log)
        if isinstance(fn, torch._ops.OpOverload) and all(r.vid in size_only for r in refs) and \
                (refs or not value_refs((args, kwargs), ScalarRef)) and \
                not any(v in outputs for v in out_vids if v is not None):
            size_only.update(v for v in out_vids if v is not None)
        else:
            kept.append(entry)
    if not size_only:
        return program, [("real", i) for i in range(program.n_reals)]
    scalars = sorted({r.index for fn, args, kwargs, _, _ in kept for r in value_refs((args, kwargs), ScalarRef)})
    new_scalar = {old: ScalarRef(k) for k, old in enumerate(scalars)}
    real_sources: list = []
    new_real: dict = {}

    def real(source: tuple) -> RealRef:
        if source not in new_real:
            new_real[source] = len(real_sources)
            real_sources.append(source)
        return RealRef(new_real[source])

    def convert(a):
        t = type(a)
        if t is ValueRef and a.vid in size_only:
            return real(("value", a.vid))
        if t is RealRef:
            return real(("real", a.index))
        if t is ScalarRef:
            return new_scalar[a.index]
        if t is list:
            return [convert(x) for x in a]
        if t is tuple:
            return tuple(convert(x) for x in a)
        return a

    entries = tuple((fn, tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()},
                     out_vids, kind) for fn, args, kwargs, out_vids, kind in kept)
    used = {r.vid for entry in entries for r in value_refs((entry[1], entry[2]))}
    inputs = tuple(x for x in program.inputs if x[0] in used)
    read = {index for _, index, _ in inputs}
    sources = []
    for sym, kind, index, d in program.sym_sources:
        if kind == "s" and index in read:
            sources.append((sym, kind, index, d))
        elif kind == "r" and ("real", index) in new_real:
            sources.append((sym, kind, new_real[("real", index)], d))
    known = {src[0] for src in sources}
    for k, (kind, index) in enumerate(real_sources):
        if kind == "value":
            for d, e in enumerate(metas[index][0]):
                if type(e) is SymExpr and e.expr.is_Symbol and e.expr not in known:
                    known.add(e.expr)
                    sources.append((e.expr, "r", k, d))
    cut = Program(inputs, entries, program.n_storages, len(real_sources), len(scalars), program.outputs,
                  frozenset(i for i in program.viewed if i in read), tuple(sources))
    return cut, real_sources


def value_refs(x, kind=ValueRef) -> list:
    """The `kind` references (ValueRef, RealRef, ScalarRef) in an entry's arguments, nested or not."""
    if type(x) is kind:
        return [x]
    if isinstance(x, (list, tuple)):
        return [r for a in x for r in value_refs(a, kind)]
    if isinstance(x, dict):
        return value_refs(tuple(x.values()), kind)
    return []


# --------------------------------------------------------------------------------------------------
# Automatic dynamic dims: a graph seen before with other sizes.

MAX_TEMPLATES = 6
# Steps that no template took, planned for their own sizes because they came back (planning.py), per
# model; beyond, such a step counts as a miss, which calls for a new template
MAX_REPLANNED = 4

# A template recorded where a dynamic size was a multiple of this in every step so far assumes it always
# is one (where `PYDISC_SIZE_MULTIPLES` applies, off by default): its compiled code is told so
# (`util.assume.int`, emit), and matching keeps other sizes off it (template_match). IREE's CUDA code for
# an elementwise pass over a [32, 12, s, s] tensor went from one element and 32 per workgroup to 8 and
# 256 with it (12 x 99 us -> under 12 x 15 us in a BERT-base step), but the step as a whole was not shown
# faster (bench/README.md). 8 is what tokenizers pad to (`pad_to_multiple_of=8`, for tensor cores); a
# larger multiple would split such batches over more templates.
SIZE_MULTIPLE = 8


def size_multiples(session, device: torch.device) -> dict | None:
    """{symbol: SIZE_MULTIPLE} for the size symbols of a template about to be made whose sizes were
    multiples of it in this step and in every step of the model before (`shapes_seen`): batches padded to
    a multiple of 8. None where `PYDISC_SIZE_MULTIPLES` does not apply (the template's code is told
    nothing of its sizes); none once a size of this model broke a template's multiple
    (`DynamicState.unaligned`: its sizes vary freely). Step inputs only: a tensor that earlier steps made
    and that grows a token a step (a KV cache) takes every size."""
    state = ENGINE.dynamic
    if not applies(CONFIG.size_multiples, device):
        return None
    if state.unaligned:
        return {}
    out = {}
    for sym, (kind, index, d) in session.sources.items():
        value = session.value_of(sym)
        if kind != "conv" or value is None or value % SIZE_MULTIPLE:
            continue
        sizes = [key[index][d] for key in state.shapes_seen if len(key) > index and len(key[index]) > d]
        if all(size % SIZE_MULTIPLE == 0 for size in sizes):
            out[sym] = SIZE_MULTIPLE
    return out


def wants_unaligned_template() -> bool:
    """A size broke a template's multiple and every template assumes one: the next step records a
    template that assumes none, at once (rather than after `misses` steps run eagerly)."""
    state = ENGINE.dynamic
    return state.unaligned and all(t.session is not None and t.session.multiples for t in state.templates)


def changed_dims(old_inputs: tuple, new_inputs: tuple, trace: Trace, old_key: tuple, new_key: tuple) -> dict:
    """{input: {dim: (old size, new size)}} for two steps with the same ops, or {} when no input changed
    size: step inputs (module inputs, `pydisc.to_lazy`) by ordinal, and ("carried", k) for the k-th
    input storage where the two steps follow each other and it is a whole tensor the step before made,
    in both (a KV cache, made anew by each step; not optimizer state, made once and updated in place,
    nor the state of another model with the same ops). `old_inputs` and `new_inputs`: (step input
    shapes, per input storage whether the step before made it, the step's number)."""
    (old_shapes, old_made, old_step), (new_shapes, new_made, new_step) = old_inputs, new_inputs
    out: dict = {}
    if len(old_shapes) == len(new_shapes):
        used = {s.ordinal for s in trace.input_storages if s.ordinal >= 0}
        for ordinal, (a, b) in enumerate(zip(old_shapes, new_shapes)):
            if ordinal not in used or len(a) != len(b):
                continue
            dims = {d: (x, y) for d, (x, y) in enumerate(zip(a, b)) if x != y}
            if dims:
                out[ordinal] = dims
    old_in, new_in = old_key[2], new_key[2]      # ("in", storage index, (size, stride, offset)) per value
    if len(old_in) == len(new_in) and old_step == new_step - 1:
        for (_, i, (a, _, _)), (_, j, (b, stride, offset)) in zip(old_in, new_in):
            if i != j or len(a) != len(b) or a == b or j >= len(old_made) or not (old_made[j] and new_made[j]):
                continue
            real = trace.storage_inputs[j]
            if offset != 0 or numel(b) != real.numel() or tuple(stride) != contiguous_strides(b):
                continue    # a view of part of a storage: not made dynamic
            dims = {d: (x, y) for d, (x, y) in enumerate(zip(a, b)) if x != y}
            out.setdefault(("carried", j), {}).update(dims)
    return out


def flag(changed: dict) -> bool:
    """Mark the changed dims dynamic; True if any was not dynamic yet (and not pinned by a guard)."""
    new = False
    for key, dims in changed.items():
        dims = {d for d in dims if (key, d) not in ENGINE.dynamic.blocked}
        have = ENGINE.dynamic.flagged.setdefault(key, set())
        if not dims <= have:
            have.update(dims)
            new = True
        if dims and isinstance(key, tuple):
            RECORDER.carried_dims = carried_dims
    return new


def describe_input(key) -> str:
    return "step input #%d" % key if isinstance(key, int) else \
        "input storage #%d (a tensor an earlier step made)" % key[1]


def describe(changed: dict) -> str:
    parts = []
    for key, dims in sorted(changed.items(), key=lambda kv: str(kv[0])):
        for d, (a, b) in sorted(dims.items()):
            parts.append("%s dim %d changed %d -> %d" % (describe_input(key), d, a, b))
    return "; ".join(parts)
