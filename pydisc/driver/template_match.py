"""Matching a concretely recorded step against a dynamic-shape template (dynamic.py): the same ops in
the same order, every int argument equal to the template's expression evaluated at this step's sizes,
every guard torch added while tracing true. `match_template` gives the `Binding` that runs the step on
the template's plan, or None (the reason in `ENGINE.dynamic.last_mismatch`).
"""
from __future__ import annotations

import sympy
import torch

from ..frontend.lazy_tensor import RECORDER
from ..frontend.symbolic import SymExpr
from ..frontend.trace import RealRef, ScalarRef, Trace, ValueRef
from .dynamic import Binding, Template, value_refs
from .engine import ENGINE

__all__ = ["guards_hold", "match_template"]


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


NOT_A_MULTIPLE = "is not a multiple of"


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
        refs = value_refs((entry[1], entry[2]))
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
        srcs = [r.vid for r in value_refs((args, kwargs))]
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
    if template.session is not None:
        for sym, multiple in (template.session.multiples or {}).items():
            if sym in sizes and sizes[sym] % multiple:
                # its compiled code assumes the multiple (dynamic.SIZE_MULTIPLE): a template of its own
                ENGINE.dynamic.unaligned = True
                raise _NoMatch("%s %d %s %d" % (sym, sizes[sym], NOT_A_MULTIPLE, multiple))
    if not guards_hold(template, sizes):
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


def guards_hold(template: Template, sizes: dict) -> bool:
    subs = {k: sympy.Integer(v) for k, v in sizes.items()}
    return all(g.xreplace(subs) is sympy.true for g in template.guards)

