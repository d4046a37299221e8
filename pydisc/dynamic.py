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

from dataclasses import dataclass, field

import sympy
import torch

from .config import CONFIG
from .frontend.lazy_tensor import RECORDER, _opinfo
from .frontend.replay import Program
from .frontend.symbolic import SymExpr
from .frontend.trace import RealRef, ScalarRef, Trace, ValueRef

__all__ = ["mark_dynamic", "DYNAMIC", "Template", "Binding", "match_template", "clear"]


def mark_dynamic(t: torch.Tensor, dim: int | list[int] | tuple[int, ...]) -> torch.Tensor:
    """Declare dim(s) `dim` of the step input `t` dynamic: the first compile already serves every
    size of it. Call it on the eager tensor before it enters the model (or `pydisc.to_lazy`)."""
    from .frontend.lazy_tensor import LazyTensor

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


@dataclass
class _State:
    flagged: dict = field(default_factory=dict)      # step input ordinal -> dims
    covered: set = field(default_factory=set)        # (ordinal, rank, dims >= 2) with a template
    templates: list = field(default_factory=list)
    step_mode: dict = field(default_factory=dict)    # step id -> True (symbolic) / False (concrete)
    force_symbolic: bool = False                     # no template matched: record the next step
    misses: int = 0                                  # steps in a row that matched no template
    blocked: set = field(default_factory=set)        # (ordinal, dim) that guards pinned: static


DYNAMIC = _State()


def clear() -> None:
    DYNAMIC.flagged.clear()
    DYNAMIC.covered.clear()
    DYNAMIC.templates.clear()
    DYNAMIC.step_mode.clear()
    DYNAMIC.blocked.clear()
    DYNAMIC.force_symbolic = False
    DYNAMIC.misses = 0


def _pattern(ordinal: int, real: torch.Tensor, dims) -> tuple:
    return (ordinal, real.dim(), tuple(sorted(d for d in dims if d < real.dim() and real.shape[d] >= 2)))


def dims_of(ordinal: int, real: torch.Tensor) -> tuple:
    """Which dims of this step input are recorded symbolically (the recorder asks, per input)."""
    if not CONFIG.dynamic:
        return ()
    marked = getattr(real, "_pydisc_dynamic", ())
    if marked:      # remembered: a later step's changed sizes in these dims are nothing new
        DYNAMIC.flagged.setdefault(ordinal, set()).update(marked)
    dims = set(DYNAMIC.flagged.get(ordinal, ()))
    dims = {d for d in dims if (ordinal, d) not in DYNAMIC.blocked}
    if not dims:
        return ()
    epoch = RECORDER.step_id
    mode = DYNAMIC.step_mode.get(epoch)
    if mode is None:
        # the step's first dynamic input decides: symbolic unless a template covers its sizes
        mode = DYNAMIC.force_symbolic or _pattern(ordinal, real, dims) not in DYNAMIC.covered
        DYNAMIC.step_mode.clear()
        DYNAMIC.step_mode[epoch] = mode
        DYNAMIC.force_symbolic = False
    return tuple(sorted(dims)) if mode else ()


RECORDER.dims_of = dims_of


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
    real_types: tuple = ()           # (shape, stride, dtype, device) of each eager input
    fakes: list | None = None        # fake inputs to plan with, until the plan is built
    sources: list | None = None
    steps: int = 0
    building: bool = False           # its plan is being built in the background (pydisc/background.py)


@dataclass
class Binding:
    """A concrete step structure bound to a template: how to call the template's plan."""

    template: Template
    view_sizes: dict                 # storage index -> concrete size of the viewed input
    real_order: list                 # template real index -> concrete real index
    perm: list                       # concrete output k -> template output index
    sizes: dict                      # symbol -> value (for reports)

    def inputs(self, trace: Trace, scalars: torch.Tensor | None) -> list:
        out = [s.view(self.view_sizes[i]) if i in self.view_sizes else s
               for i, s in enumerate(trace.storage_inputs)]
        out += [trace.real_inputs[j] for j in self.real_order]
        if scalars is not None:
            out.append(scalars)
        return out


def _as_meta(x):
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        e = x.node.expr
        return int(e) if e.is_number else SymExpr(e)
    return x


def make_template(trace: Trace, program: Program, plan) -> Template:
    session = trace.symbolic
    in_layouts = {vid: (index, layout) for vid, index, layout in program.inputs}
    metas = {}
    for vid in range(len(trace.values)):
        m = trace.sym_metas.get(vid) or trace.metas.get(vid)
        if m is not None:
            size, stride, offset = m[0], m[1], m[2]
            metas[vid] = (tuple(map(_as_meta, size)), tuple(map(_as_meta, stride)), _as_meta(offset))
    deferrable = []
    for fn, args, kwargs, out_vids, kind in program.entries:
        if isinstance(fn, torch._ops.OpOverload) and not _refs((args, kwargs), RealRef) and \
                not _refs((args, kwargs), ScalarRef):
            info = _opinfo(fn)
            deferrable.append(None if info.written_args else "view" if info.is_view else "pure")
        else:
            deferrable.append(None)
    patterns = [(ordinal, rank, made) for ordinal, (storage, made, rank) in session.conversions.items()]
    return Template(program, plan, session.guards(), in_layouts, metas, deferrable, patterns, session,
                    tuple((s.dtype, s.device) for s in trace.storage_inputs),
                    tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in trace.real_inputs))


def _refs(x, kind=ValueRef) -> list:
    """The `kind` references (ValueRef, RealRef, ScalarRef) in an entry's arguments, nested or not."""
    if type(x) is kind:
        return [x]
    if isinstance(x, (list, tuple)):
        return [r for a in x for r in _refs(a, kind)]
    if isinstance(x, dict):
        return _refs(tuple(x.values()), kind)
    return []


_INT_MAX = (1 << 63) - 1


def _is_full_slice(fn, args, kwargs, template: Template) -> bool:
    if fn is not torch.ops.aten.slice.Tensor or kwargs or type(args[0]) is not ValueRef:
        return False
    dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
    if start not in (0, None) or step != 1:
        return False
    if end is None or end == _INT_MAX:
        return True
    size = template.metas.get(args[0].vid, ((),))[0]
    return type(end) is SymExpr and -len(size) <= dim < len(size) and size[dim] == end


# ops that the concrete and the symbolic recordings spell differently (C++ matmul folds its result
# with _unsafe_view, the Python decomposition that symbolic recording runs uses view)
_SAME_OP = {torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default}


def _normalized(fn, args):
    """A concrete entry spelled the way symbolic recording (with the Python dispatcher) spells it:
    C++ batch_norm reaches the recorder as native_batch_norm, the Python one as its `_legit` forms."""
    if fn is torch.ops.aten.native_batch_norm.default and len(args) == 8:
        if args[5] is False:
            return torch.ops.aten._native_batch_norm_legit_no_training.default, list(args[:5]) + list(args[6:])
        return torch.ops.aten._native_batch_norm_legit.default, args
    return fn, args


class _NoMatch(Exception):
    pass


# Why the last template tried did not fit (shown in the recompile reason of a step that ran eagerly).
LAST_MISMATCH = [""]


def match_template(template: Template, trace: Trace, executed: list[int], outputs: tuple) -> Binding | None:
    """Bind the concrete step (`executed` entries of `trace`, `outputs`) to `template`, or None."""
    try:
        return _match(template, trace, executed, outputs)
    except _NoMatch as e:
        LAST_MISMATCH[0] = str(e)
        return None


def _match(template: Template, trace: Trace, executed: list[int], outputs: tuple) -> Binding:
    prog = template.program
    if prog.n_storages != len(trace.storage_inputs) or prog.n_scalars != len(trace.scalars):
        raise _NoMatch("inputs")
    for (dtype, device), s in zip(template.storage_types, trace.storage_inputs):
        if s.dtype != dtype or s.device != device:
            raise _NoMatch("input dtype or device")
    checks: list = []            # (SymExpr, concrete value)
    trail: list = []             # (dict, key) added while matching the current entry: undone on failure
    vmap: dict[int, int] = {}    # template vid -> concrete vid
    deferred: dict[int, int] = {}  # template vid -> index of the template entry that makes it
    const: set[int] = set()        # deferred vids computed from sizes alone (eager data in the step)
    rmap: dict[int, int] = {}    # template real index -> concrete real index
    factory_reals: dict[int, int] = {}  # concrete real index -> template vid of a factory op
    c_values = trace.values

    def assign(d: dict, k, v) -> bool:
        if k in d:
            return d[k] == v
        d[k] = v
        trail.append((d, k))
        return True

    def same_value(tv: int, cv: int) -> None:
        if tv in vmap:
            if vmap[tv] != cv:
                raise _NoMatch("value")
            return
        if tv in template.in_layouts:
            kind = c_values[cv]
            index, layout = template.in_layouts[tv]
            if kind[0] != "in" or kind[1] != index:
                raise _NoMatch("input")
            _same_layout(tv, kind[2], layout)
            assign(vmap, tv, cv)
            return
        if tv in deferred:
            kind = c_values[cv]
            root = _root_storage(tv)
            if kind[0] != "in" or root is None or kind[1] != root:
                raise _NoMatch("deferred view")
            _same_layout(tv, kind[2], None)
            assign(vmap, tv, cv)
            return
        raise _NoMatch("unbound value")

    def _same_layout(tv, clayout, tlayout) -> None:
        if tlayout is not None:
            if tuple(tlayout[0]) != tuple(clayout[0]) or tuple(tlayout[1]) != tuple(clayout[1]) \
                    or tlayout[2] != clayout[2]:
                raise _NoMatch("layout")
            return
        size, stride, offset = template.metas[tv]
        if len(size) != len(clayout[0]):
            raise _NoMatch("rank")
        for t, c in zip(size + stride + (offset,), tuple(clayout[0]) + tuple(clayout[1]) + (clayout[2],)):
            if type(t) is SymExpr:
                checks.append((t, c))
            elif t != c:
                raise _NoMatch("layout")

    def _root_storage(tv: int):
        entry = prog.entries[deferred[tv]]
        refs = _refs((entry[1], entry[2]))
        if not refs:
            return None
        src = refs[0].vid
        if src in template.in_layouts:
            return template.in_layouts[src][0]
        if src in deferred:
            return _root_storage(src)
        return None

    def _defer(i: int, e) -> None:
        """Template entry i has no counterpart in the concrete recording: a view it took of device
        data at once, or an op on sizes alone (`torch.ones(T, T).tril()`) that it ran eagerly."""
        fn, args, kwargs, out_vids, kind = entries[i]
        how = template.deferrable[i]
        srcs = [r.vid for r in _refs((args, kwargs))]
        if srcs and srcs[0] in vmap and (_is_full_slice(fn, args, kwargs, template) or
                                         (fn is torch.ops.aten.clone.default and not kwargs)):
            # Identities that only the symbolic recording has: `x[:, :T]` with T = x.size(1) (it
            # cannot prove the slice is a no-op, C++ skips it when sizes are numbers), and the copy
            # that `reshape` makes when it cannot prove a symbolic layout contiguous
            assign(vmap, out_vids[0], vmap[srcs[0]])
            return
        if how is not None and all(v in const for v in srcs):
            const.update(v for v in out_vids if v is not None)
        elif how != "view" or not srcs or not all(v in template.in_layouts or v in deferred for v in srcs):
            raise _NoMatch("entry %d (%s) does not match %s" % (i, fn, e.fn if e is not None else "the end"))
        for tv in out_vids:
            if tv is not None:
                deferred[tv] = i

    def same_arg(t, c) -> None:
        tt = type(t)
        if tt is ValueRef:
            if type(c) is ValueRef:
                same_value(t.vid, c.vid)
            elif type(c) is RealRef and t.vid in const:
                if not assign(factory_reals, c.index, t.vid):
                    raise _NoMatch("factory")
            else:
                raise _NoMatch("tensor")
        elif tt is RealRef:
            if type(c) is not RealRef or not assign(rmap, t.index, c.index):
                raise _NoMatch("eager input")
        elif tt is ScalarRef:
            if type(c) is not ScalarRef or c.index != t.index:
                raise _NoMatch("scalar")
        elif tt is SymExpr:
            if type(c) not in (int, float):
                raise _NoMatch("size")
            checks.append((t, c))
        elif tt is list or tt is tuple:
            if type(c) not in (list, tuple) or len(c) != len(t):
                raise _NoMatch("list")
            for a, b in zip(t, c):
                same_arg(a, b)
        elif type(c) is not tt or c != t:
            raise _NoMatch("constant")

    entries = prog.entries
    i = 0
    for j in executed:
        e = trace.entries[j]
        while True:
            if i >= len(entries):
                raise _NoMatch("longer")
            fn, args, kwargs, out_vids, kind = entries[i]
            n_checks = len(checks)
            trail.clear()
            try:
                e_fn, e_args = _normalized(e.fn, e.args)
                if (fn is not e_fn and _SAME_OP.get(e_fn) is not fn) or len(args) != len(e_args) or \
                        kwargs.keys() != e.kwargs.keys():
                    raise _NoMatch("op")
                for a, b in zip(args, e_args):
                    same_arg(a, b)
                for k in kwargs:
                    same_arg(kwargs[k], e.kwargs[k])
                if len(out_vids) != len(e.out_vids):
                    raise _NoMatch("outputs")
                for tv, cv in zip(out_vids, e.out_vids):
                    if (tv is None) != (cv is None):
                        raise _NoMatch("outputs")
                    if tv is not None and not assign(vmap, tv, cv):
                        raise _NoMatch("outputs")
                i += 1
                break
            except _NoMatch as why:
                first_reason = why
                del checks[n_checks:]
                for d, k in trail:
                    del d[k]
                trail.clear()
                try:
                    _defer(i, e)
                except _NoMatch:
                    raise _NoMatch("entry %d (%s): %s" % (i, fn, first_reason)) from None
                i += 1
    while i < len(entries):
        _defer(i, None)
        i += 1
    # size symbols of this step, read off the whole input tensors
    def full_shape(index: int) -> tuple:
        storage = trace.input_storages[index]
        if 0 <= storage.ordinal < len(RECORDER.input_shapes):
            return RECORDER.input_shapes[storage.ordinal]
        layout = next((v[2] for v in c_values if v[0] == "in" and v[1] == index), None)
        if layout is None:
            raise _NoMatch("source")
        return tuple(layout[0])

    view_sizes = {index: full_shape(index) for index in prog.viewed}
    for tv, (index, layout) in template.in_layouts.items():
        if layout is None:
            size = template.metas[tv][0]
            if len(size) != len(view_sizes[index]):
                raise _NoMatch("rank")
            for t, c in zip(size, view_sizes[index]):
                if type(t) is SymExpr:
                    checks.append((t, c))
                elif t != c:
                    raise _NoMatch("input size")
    sizes: dict = {}
    for sym, kind, index, d in prog.sym_sources:
        if kind == "s":
            value = view_sizes[index][d] if index in view_sizes else full_shape(index)[d]
        else:
            if index not in rmap:
                raise _NoMatch("source")
            value = trace.real_inputs[rmap[index]].shape[d]
        if value < 2:
            raise _NoMatch("size 0 or 1 is specialised")
        sizes[sym] = int(value)
    for expr, value in checks:
        got = expr.value(sizes)
        if got != value:
            raise _NoMatch("size argument")
    if not _guards_hold(template, sizes):
        raise _NoMatch("guard")
    # ops on sizes alone whose results this step recorded as eager data: the template computes them
    # itself, so check once (per step structure) that they are the same data
    memo: dict = {}

    def compute(tv: int):
        if tv not in memo:
            fn, args, kwargs, out_vids, kind = entries[deferred[tv]]

            def conc(a):
                if type(a) is ValueRef:
                    return compute(a.vid)
                if type(a) is SymExpr:
                    return a.value(sizes)
                if isinstance(a, (list, tuple)):
                    return type(a)(conc(x) for x in a)
                return a

            out = fn(*[conc(a) for a in args], **{k: conc(v) for k, v in kwargs.items()})
            for k, v in enumerate(out_vids):
                if v is not None:
                    memo[v] = out if kind is None else out[k]
        return memo[tv]

    for c_index, tv in factory_reals.items():
        value = compute(tv)
        got = trace.real_inputs[c_index]
        if not isinstance(value, torch.Tensor) or value.shape != got.shape or value.dtype != got.dtype \
                or not torch.equal(value.to(got.device), got):
            raise _NoMatch("factory data")
    used_reals = sorted(rmap)
    if used_reals != list(range(prog.n_reals)):
        raise _NoMatch("eager inputs")
    for t_index, c_index in rmap.items():
        t = trace.real_inputs[c_index]
        if (tuple(t.shape), t.stride(), t.dtype, t.device) != template.real_types[t_index]:
            raise _NoMatch("eager input %d changed" % c_index)
    inverse = {cv: tv for tv, cv in vmap.items()}
    t_out = {o: k for k, o in enumerate(prog.outputs)}
    perm = []
    for kind, index in outputs:
        key = (kind, index) if kind == "base" else ("value", inverse.get(index, -1))
        if key not in t_out:
            raise _NoMatch("outputs")
        perm.append(t_out[key])
    return Binding(template, view_sizes, [rmap[t] for t in range(prog.n_reals)], perm, sizes)


def _guards_hold(template: Template, sizes: dict) -> bool:
    subs = {k: sympy.Integer(v) for k, v in sizes.items()}
    return all(g.xreplace(subs) is sympy.true for g in template.guards)


guards_hold = _guards_hold


# --------------------------------------------------------------------------------------------------
# Automatic dynamic dims: a graph seen before with other sizes.

MAX_TEMPLATES = 6


def changed_dims(old_shapes: list, new_shapes: list, trace: Trace) -> dict:
    """{input ordinal: {dim: (old size, new size)}} for the step inputs (module inputs,
    `pydisc.to_lazy`) of two steps with the same ops, or {} when none changed size."""
    if len(old_shapes) != len(new_shapes):
        return {}
    used = {s.ordinal for s in trace.input_storages if s.ordinal >= 0}
    out: dict = {}
    for ordinal, (a, b) in enumerate(zip(old_shapes, new_shapes)):
        if ordinal not in used or len(a) != len(b):
            continue
        dims = {d: (x, y) for d, (x, y) in enumerate(zip(a, b)) if x != y}
        if dims:
            out[ordinal] = dims
    return out


def flag(changed: dict) -> bool:
    """Mark the changed dims dynamic; True if any was not dynamic yet (and not pinned by a guard)."""
    new = False
    for ordinal, dims in changed.items():
        dims = {d for d in dims if (ordinal, d) not in DYNAMIC.blocked}
        have = DYNAMIC.flagged.setdefault(ordinal, set())
        if not dims <= have:
            have.update(dims)
            new = True
    return new


def describe(changed: dict) -> str:
    parts = []
    for ordinal, dims in sorted(changed.items()):
        for d, (a, b) in sorted(dims.items()):
            parts.append("step input #%d dim %d changed %d -> %d" % (ordinal, d, a, b))
    return "; ".join(parts)
