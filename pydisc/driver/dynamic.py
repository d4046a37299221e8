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

import sympy
import torch

from ..config import CONFIG
from ..frontend.fast import set_gate as set_fast_gate
from ..frontend.lazy_tensor import RECORDER
from ..frontend.tensor import LazyTensor
from ..frontend.op_facts import opinfo
from ..frontend.replay import Program
from ..frontend.symbolic import SymExpr
from ..frontend.trace import RealRef, ScalarRef, Trace, ValueRef
from .engine import ENGINE

__all__ = ["mark_dynamic", "Template", "Binding", "match_template", "clear"]


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
    dims = {d for d in ENGINE.dynamic.flagged.get(key, ()) if (key, d) not in ENGINE.dynamic.blocked}
    pattern = _pattern(key, real, dims)
    if not pattern[2]:
        return ()       # sizes 0 and 1 are specialised: nothing to make symbolic in this input
    epoch = RECORDER.step_id
    mode = ENGINE.dynamic.step_mode.get(epoch)
    if mode is None:
        # the step's first dynamic input decides: symbolic unless a template covers its sizes
        mode = ENGINE.dynamic.force_symbolic or pattern not in ENGINE.dynamic.covered
        ENGINE.dynamic.step_mode.clear()
        ENGINE.dynamic.step_mode[epoch] = mode
        ENGINE.dynamic.force_symbolic = False
    return tuple(sorted(dims)) if mode else ()



def _fast_gate() -> bool:
    """Whether the fast recorder may record this step: a step recorded at __torch_function__ cannot be
    matched to a template, so none while dims are dynamic; nor a step whose inputs so far have other
    sizes than the step before's: the dispatcher records it and its changed dims are found (and the
    step choice's probe times the recording that the steps to come will have)."""
    if ENGINE.dynamic.flagged:
        return False
    shapes, last = RECORDER.input_shapes, RECORDER.last_input_shapes
    return not (CONFIG.dynamic and last and shapes != last[:len(shapes)])


set_fast_gate(_fast_gate)


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
    storage_order: list              # template storage index -> concrete one (None: not read)
    real_order: list                 # template real index -> concrete real index
    perm: list                       # concrete output k -> template output index
    sizes: dict                      # symbol -> value (for reports)

    def inputs(self, trace: Trace, scalars: torch.Tensor | None) -> list:
        storages = trace.storage_inputs
        out = [None if j is None else storages[j].view(self.view_sizes[i]) if i in self.view_sizes else storages[j]
               for i, j in enumerate(self.storage_order)]
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
        if isinstance(fn, torch._ops.OpOverload) and not _refs((args, kwargs), RealRef) and \
                not _refs((args, kwargs), ScalarRef):
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
        if isinstance(fn, torch._ops.OpOverload) and not _refs((args, kwargs), ScalarRef) and \
                all(r.vid in size_only for r in _refs((args, kwargs))) and \
                not any(v in outputs for v in out_vids if v is not None):
            size_only.update(v for v in out_vids if v is not None)
        else:
            kept.append(entry)
    if not size_only:
        return program, [("real", i) for i in range(program.n_reals)]
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
        if t is list:
            return [convert(x) for x in a]
        if t is tuple:
            return tuple(convert(x) for x in a)
        return a

    entries = tuple((fn, tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()},
                     out_vids, kind) for fn, args, kwargs, out_vids, kind in kept)
    used = {r.vid for entry in entries for r in _refs((entry[1], entry[2]))}
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
    cut = Program(inputs, entries, program.n_storages, len(real_sources), program.n_scalars, program.outputs,
                  frozenset(i for i in program.viewed if i in read), tuple(sources))
    return cut, real_sources


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


def _is_full_slice_backward(fn, args, kwargs, template: Template) -> bool:
    """The gradient of a whole slice: `slice_backward(g, sizes, dim, 0, end, 1)` with g of `sizes`."""
    if fn is not torch.ops.aten.slice_backward.default or kwargs or type(args[0]) is not ValueRef:
        return False
    _, sizes, dim, start, end, step = args
    grad_size = template.metas.get(args[0].vid, ((),))[0]
    if start != 0 or step != 1 or tuple(grad_size) != tuple(sizes) or not -len(sizes) <= dim < len(sizes):
        return False
    return end == _INT_MAX or (type(end) is SymExpr and sizes[dim] == end)


def _without_defaults(fn, kwargs: dict) -> dict:
    """`kwargs` less those that pass an optional argument's default None: autograd's C++ passes
    `attn_mask=None` where the Python dispatcher's call leaves it out."""
    if not isinstance(fn, torch._ops.OpOverload):
        return kwargs
    defaults = {a.name: a.default_value for a in fn._schema.arguments if a.has_default_value()}
    return {k: v for k, v in kwargs.items() if not (v is None and k in defaults and defaults[k] is None)}


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


def match_template(template: Template, trace: Trace, executed: list[int], outputs: tuple) -> Binding | None:
    """Bind the concrete step (`executed` entries of `trace`, `outputs`) to `template`, or None."""
    try:
        return _match(template, trace, executed, outputs)
    except _NoMatch as e:
        ENGINE.dynamic.last_mismatch = str(e)
        return None


def _match(template: Template, trace: Trace, executed: list[int], outputs: tuple) -> Binding:
    prog = template.program
    if prog.n_scalars != len(trace.scalars):
        raise _NoMatch("inputs")
    checks: list = []            # (SymExpr, concrete value)
    trail: list = []             # (dict, key) added while matching the current entry: undone on failure
    vmap: dict[int, int] = {}    # template vid -> concrete vid
    deferred: dict[int, int] = {}  # template vid -> index of the template entry that makes it
    rmap: dict[int, int] = {}    # template real index -> concrete real index
    # template storage index -> concrete one: the two recordings may first read the step's inputs in
    # another order (a view the concrete recording took of device data at once is an entry of the
    # symbolic one: HF GPT-2 reads its ids before the embedding weight there, after it here)
    smap: dict[int, int] = {}
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
            if kind[0] != "in" or not assign(smap, index, kind[1]):
                raise _NoMatch("input")
            _same_layout(tv, kind[2], layout)
            assign(vmap, tv, cv)
            return
        if tv in deferred:
            kind = c_values[cv]
            root = _root_storage(tv)
            if kind[0] != "in" or root is None or not assign(smap, root, kind[1]):
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
        data at once, or an identity only the symbolic recording has."""
        fn, args, kwargs, out_vids, kind = entries[i]
        how = template.deferrable[i]
        srcs = [r.vid for r in _refs((args, kwargs))]
        if srcs and srcs[0] in vmap and (_is_full_slice(fn, args, kwargs, template) or
                                         _is_full_slice_backward(fn, args, kwargs, template) or
                                         (fn is torch.ops.aten.clone.default and not kwargs)):
            # Identities that only the symbolic recording has: `x[:, :T]` with T = x.size(1) (it
            # cannot prove the slice is a no-op, C++ skips it when sizes are numbers) and its
            # gradient, and the copy that `reshape` makes when it cannot prove a symbolic layout
            # contiguous
            assign(vmap, out_vids[0], vmap[srcs[0]])
            return
        if how != "view" or not srcs or not all(v in template.in_layouts or v in deferred for v in srcs):
            raise _NoMatch("entry %d (%s) does not match %s" % (i, fn, e.fn if e is not None else "the end"))
        for tv in out_vids:
            if tv is not None:
                deferred[tv] = i

    def same_arg(t, c) -> None:
        tt = type(t)
        if tt is ValueRef:
            if type(c) is ValueRef:
                same_value(t.vid, c.vid)
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
                if e_fn is torch.ops.aten.alias.default and _is_full_slice(fn, args, kwargs, template):
                    # `x[:, 0:]`: C++ indexing takes an alias where the symbolic step cannot prove the
                    # slice whole
                    same_arg(args[0], e_args[0])
                    if not assign(vmap, out_vids[0], e.out_vids[0]):
                        raise _NoMatch("outputs")
                    i += 1
                    break
                e_kwargs = e.kwargs
                if kwargs.keys() != e_kwargs.keys():
                    kwargs, e_kwargs = _without_defaults(fn, kwargs), _without_defaults(fn, e_kwargs)
                if (fn is not e_fn and _SAME_OP.get(e_fn) is not fn) or len(args) != len(e_args) or \
                        kwargs.keys() != e_kwargs.keys():
                    raise _NoMatch("op")
                for a, b in zip(args, e_args):
                    same_arg(a, b)
                for k in kwargs:
                    same_arg(kwargs[k], e_kwargs[k])
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
    read_storages = {index for _, index, _ in prog.inputs} | {i for kind, i in prog.outputs if kind == "base"}
    if len(set(smap.values())) != len(smap):
        raise _NoMatch("input storages")
    if any(kind == "base" and index not in set(smap.values()) for kind, index in outputs):
        raise _NoMatch("a written input storage")
    if len(smap) != prog.n_storages:
        # storages the program neither reads nor writes (those a read mid-step used up): nothing is
        # passed for them
        for t_index in range(prog.n_storages):
            if t_index not in smap:
                if t_index in read_storages:
                    raise _NoMatch("input storage %d" % t_index)
                smap[t_index] = None
    for t_index, c_index in smap.items():
        if t_index not in read_storages:
            continue
        dtype, device = template.storage_types[t_index]
        s = trace.storage_inputs[c_index]
        if s.dtype != dtype or s.device != device:
            raise _NoMatch("input dtype or device")
    # size symbols of this step, read off the whole input tensors
    def full_shape(index: int) -> tuple:
        storage = trace.input_storages[index]
        if 0 <= storage.ordinal < len(RECORDER.input_shapes):
            return RECORDER.input_shapes[storage.ordinal]
        layout = next((v[2] for v in c_values if v[0] == "in" and v[1] == index), None)
        if layout is None:
            raise _NoMatch("source")
        return tuple(layout[0])

    view_sizes = {index: full_shape(smap[index]) for index in prog.viewed}
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
            value = view_sizes[index][d] if index in view_sizes else full_shape(smap[index])[d]
        else:
            if index not in rmap:
                raise _NoMatch("source")
            value = trace.real_inputs[rmap[index]].shape[d]
        if value < 2:
            raise _NoMatch("size 0 or 1 is specialised")
        sizes[sym] = int(value)
    if template.session is not None:
        # symbols of step inputs that the program no longer reads (a read mid-step used them up) still
        # appear in guards: read them off this step's inputs, by ordinal
        shapes = RECORDER.input_shapes
        for sym, (kind, index, d) in template.session.sources.items():
            if sym not in sizes and kind == "conv" and index < len(shapes) and d < len(shapes[index]):
                sizes[sym] = int(shapes[index][d])
    for expr, value in checks:
        got = expr.value(sizes)
        if got != value:
            raise _NoMatch("size argument")
    if not _guards_hold(template, sizes):
        raise _NoMatch("guard")
    used_reals = sorted(rmap)
    if used_reals != list(range(prog.n_reals)):
        raise _NoMatch("eager inputs")
    for t_index, c_index in rmap.items():
        t = trace.real_inputs[c_index]
        expected = template.real_types[t_index]
        if len(expected) == 3:      # a value on sizes alone: its layout is an expression of them
            (size, stride, offset), dtype, device = expected
            if t.dtype != dtype or t.device != device or t.dim() != len(size):
                raise _NoMatch("eager input %d changed" % c_index)
            for e, got in zip(size + stride + (offset,), tuple(t.shape) + t.stride() + (t.storage_offset(),)):
                try:
                    want = e.value(sizes) if type(e) is SymExpr else e
                except KeyError:
                    raise _NoMatch("eager input %d: a size this step does not give" % c_index) from None
                if want != got:
                    raise _NoMatch("eager input %d has another layout" % c_index)
        elif (tuple(t.shape), t.stride(), t.dtype, t.device) != expected:
            raise _NoMatch("eager input %d changed" % c_index)
    inverse = {cv: tv for tv, cv in vmap.items()}
    storage_inverse = {c: t for t, c in smap.items()}
    t_out = {o: k for k, o in enumerate(prog.outputs)}
    perm = []
    for kind, index in outputs:
        key = ("base", storage_inverse.get(index, -1)) if kind == "base" else ("value", inverse.get(index, -1))
        if key not in t_out:
            raise _NoMatch("outputs")
        perm.append(t_out[key])
    return Binding(template, view_sizes, [smap[t] for t in range(prog.n_storages)],
                   [rmap[t] for t in range(prog.n_reals)], perm, sizes)


def _guards_hold(template: Template, sizes: dict) -> bool:
    subs = {k: sympy.Integer(v) for k, v in sizes.items()}
    return all(g.xreplace(subs) is sympy.true for g in template.guards)


guards_hold = _guards_hold


# --------------------------------------------------------------------------------------------------
# Automatic dynamic dims: a graph seen before with other sizes.

MAX_TEMPLATES = 6


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
            if offset != 0 or _numel(b) != real.numel() or tuple(stride) != _contiguous(b):
                continue    # a view of part of a storage: not made dynamic
            dims = {d: (x, y) for d, (x, y) in enumerate(zip(a, b)) if x != y}
            out.setdefault(("carried", j), {}).update(dims)
    return out


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _contiguous(size) -> tuple:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


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
