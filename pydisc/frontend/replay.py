"""Replaying a trace: eagerly on device data, or under torch's functionalization to get a pure graph.

The same replay function serves both. Run on real tensors it reproduces eager semantics (views alias,
in-place ops write), which makes it the universal fallback. Traced by `make_fx` under
`torch.func.functionalize` with pydisc's decomposition table, it yields a functional FX graph of core
ATen ops: no views, no mutation, writes to inputs turned into returned values. That graph is what the
partitioner and the emitter work on.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from .symbolic import SymArg, SymExpr, hint
from .trace import RealRef, ScalarRef, Trace, ValueRef

__all__ = ["Program", "program_from_trace", "functional_graph"]


@dataclass(frozen=True)
class Program:
    """A trace stripped of device data: what a cached plan keeps to replay later steps."""

    inputs: tuple[tuple[int, int, tuple], ...]    # (value id, storage input index, layout)
    entries: tuple[tuple[Callable, tuple, dict, tuple[int, ...], Any], ...]
    n_storages: int
    n_reals: int
    n_scalars: int
    outputs: tuple[tuple[str, int], ...]          # ("base", storage input index) | ("value", value id)
    # Dynamic programs: storage inputs passed already viewed in their (symbolic) shape, with layout
    # None in `inputs`, and where each size symbol is read: (symbol, "s"|"r", input index, dim).
    viewed: frozenset = frozenset()
    sym_sources: tuple = ()

    def __call__(self, *inputs: torch.Tensor, on_entry: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        bases = inputs[: self.n_storages]
        reals = inputs[self.n_storages: self.n_storages + self.n_reals]
        scalars = inputs[-1] if self.n_scalars else None
        env: dict[int, torch.Tensor] = {}
        for vid, index, layout in self.inputs:
            env[vid] = bases[index] if layout is None else _view(bases[index], *layout)
        syms = {sym: (bases if kind == "s" else reals)[i].size(d) for sym, kind, i, d in self.sym_sources}
        frees = self.__dict__.get("_frees")
        if frees is None:
            frees = self._last_uses()
        for index, (fn, args, kwargs, out_vids, out_kind) in enumerate(self.entries):
            if on_entry is not None:
                on_entry(index)
            out = fn(*[_decode(a, env, reals, scalars, syms) for a in args],
                     **{k: _decode(v, env, reals, scalars, syms) for k, v in kwargs.items()})
            if out_kind is None:
                env[out_vids[0]] = out
            else:
                for vid, o in zip(out_vids, out):
                    if vid is not None:
                        env[vid] = o
            for vid in frees[index]:
                del env[vid]
        return [bases[i] if kind == "base" else env[i] for kind, i in self.outputs]

    def _last_uses(self) -> list[list[int]]:
        """Per entry, the values that no later entry reads and that are not outputs: dropped right after
        it, so that a replay holds what eager would (a step's forward activations until its backward),
        not every value of the step (BERT-base at batch 64: 129 GB against eager's 40 at its peak)."""
        last: dict[int, int] = {}

        def scan(a, index: int) -> None:
            if type(a) is ValueRef:
                last[a.vid] = index
            elif type(a) is list:
                for x in a:
                    scan(x, index)

        for index, (_, args, kwargs, out_vids, _) in enumerate(self.entries):
            for vid in out_vids:
                if vid is not None:
                    last.setdefault(vid, index)     # made and never read: dropped at once
            for a in args:
                scan(a, index)
            for a in kwargs.values():
                scan(a, index)
        for vid, _, _ in self.inputs:
            last.pop(vid, None)    # the step's inputs: views of its arguments, held by the caller anyway
        kept = {i for kind, i in self.outputs if kind == "value"}
        frees: list[list[int]] = [[] for _ in self.entries]
        for vid, index in last.items():
            if vid not in kept:
                frees[index].append(vid)
        object.__setattr__(self, "_frees", frees)
        return frees


def _decode(a, env: dict, reals, scalars, syms: dict):
    """A recorded argument's value in a replay. A module-level function on purpose: a nested one that
    calls itself (for lists) sits in a reference cycle with its closure, and so would the replay's
    `env`, every value of the step, until the cyclic GC ran (which pydisc pauses while recording): a
    BERT-base step at batch 64 kept 127 GB of its eager replay's intermediates alive."""
    t = type(a)
    if t is ValueRef:
        return env[a.vid]
    if t is RealRef:
        return reals[a.index]
    if t is ScalarRef:
        return scalars[a.index]
    if t is list:
        return [_decode(x, env, reals, scalars, syms) for x in a]
    if t is SymExpr:
        return a.value(syms)
    return a


def _view(base: torch.Tensor, size, stride, offset) -> torch.Tensor:
    n = 1
    for s in size:
        n *= s
    if offset == 0 and n == base.numel():
        contiguous, acc = True, 1
        for s, st in zip(reversed(size), reversed(stride)):
            if s != 1 and st != acc:
                contiguous = False
                break
            acc *= s
        if contiguous:
            return base.view(size)
    return base.as_strided(size, stride, offset)


def program_from_trace(trace: Trace, entry_indices: list[int], outputs: tuple) -> Program:
    used = set()
    entries = []
    for i in entry_indices:
        e = trace.entries[i]
        entries.append((e.fn, tuple(e.args), dict(e.kwargs), e.out_vids, e.out_kind))
        for part in e.sig:
            if type(part) is tuple and len(part) == 2 and part[0] == "v":
                used.add(part[1])
    inputs = tuple((vid, kind[1], kind[2]) for vid, kind in enumerate(trace.values)
                   if kind[0] == "in" and vid in used)
    return Program(inputs, tuple(entries), len(trace.storage_inputs), len(trace.real_inputs),
                   len(trace.scalars), outputs)


def concrete_program(trace: Trace, entry_indices: list[int], outputs: tuple) -> Program:
    """A symbolically recorded step as a program for this step's sizes only."""
    def convert(a):
        if type(a) is SymArg:
            return hint(a.sym)
        if type(a) is list:
            return [convert(x) for x in a]
        if type(a) is tuple:
            return tuple(convert(x) for x in a)
        return a

    static = program_from_trace(trace, entry_indices, outputs)
    entries = tuple((fn, tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()},
                     out_vids, kind) for fn, args, kwargs, out_vids, kind in static.entries)
    inputs = tuple((vid, index, tuple(trace.metas[vid][:3])) for vid, index, _ in static.inputs)
    return Program(inputs, entries, static.n_storages, static.n_reals, static.n_scalars, outputs)


class NotDynamic(Exception):
    """A symbolic step that cannot become a dynamic program (it is planned per shape instead)."""


def symbolic_program(trace: Trace, entry_indices: list[int], outputs: tuple) -> Program:
    """The program of a symbolically recorded step: size arguments become `SymExpr`s and inputs
    with symbolic sizes are passed viewed in their shape, so that every size symbol can be read off
    an input at each call."""
    static = program_from_trace(trace, entry_indices, outputs)

    def expr_of(x):
        return x.node.expr if isinstance(x, (torch.SymInt, torch.SymFloat)) else x

    def convert(a):
        if type(a) is SymArg:
            e = a.expr
            if e is sympy.true or e is sympy.false:
                return e is sympy.true
            if e.is_number:
                return float(e) if isinstance(a.sym, torch.SymFloat) else int(e)
            return SymExpr(e, isinstance(a.sym, torch.SymFloat))
        if type(a) is list:
            return [convert(x) for x in a]
        if type(a) is tuple:
            return tuple(convert(x) for x in a)
        return a

    entries = tuple((fn, tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()},
                     out_vids, kind) for fn, args, kwargs, out_vids, kind in static.entries)
    inputs = []
    viewed: dict[int, tuple] = {}     # storage index -> symbolic size
    for vid, index, layout in static.inputs:
        sym = trace.sym_metas.get(vid)
        if sym is None:
            if index in viewed:
                raise NotDynamic("an input storage is read both with symbolic and static layouts")
            inputs.append((vid, index, layout))
            continue
        size, stride, offset, _ = sym
        size = tuple(expr_of(s) for s in size)
        if expr_of(offset) != 0 or tuple(expr_of(s) for s in stride) != _contiguous(size) or \
                (index in viewed and viewed[index] != size):
            raise NotDynamic("an input with symbolic sizes is not a whole contiguous tensor")
        viewed[index] = size
        inputs.append((vid, index, None))
    if any(layout is not None and i in viewed for _, i, layout in inputs):
        raise NotDynamic("an input storage is read both with symbolic and static layouts")
    sources: dict = {}
    for index, size in viewed.items():
        for d, e in enumerate(size):
            if getattr(e, "is_Symbol", False):
                sources.setdefault(e, ("s", index, d))
    session = trace.symbolic
    for index, t in enumerate(trace.real_inputs):
        fake = session.real_fakes.get(id(t)) if session is not None else None
        if fake is not None:
            for d, s in enumerate(fake.shape):
                e = expr_of(s)
                if getattr(e, "is_Symbol", False):
                    sources.setdefault(e, ("r", index, d))
    if session is not None:
        # every symbol created for an input, also those that guards made equal to another one
        for sym, (kind, index, d) in session.sources.items():
            if kind == "conv":
                storage = session.conversions[index][0]
                if storage.epoch == trace.epoch and storage.input_index in viewed:
                    sources.setdefault(sym, ("s", storage.input_index, d))
            elif kind == "carried":     # the index-th input storage, made by an earlier step
                if index in viewed:
                    sources.setdefault(sym, ("s", index, d))
            elif index < len(trace.real_inputs):
                sources.setdefault(sym, ("r", index, d))
    needed = set()
    for size in viewed.values():
        for e in size:
            needed |= getattr(e, "free_symbols", set())

    def collect(a):
        if type(a) is SymExpr:
            needed.update(a.expr.free_symbols)
        elif type(a) in (list, tuple):
            for x in a:
                collect(x)

    for _, args, kwargs, _, _ in entries:
        collect(args)
        collect(tuple(kwargs.values()))
    missing = needed - set(sources)
    if missing:
        raise NotDynamic("size symbols %s cannot be read off the step's inputs" % sorted(map(str, missing)))
    return Program(tuple(inputs), entries, static.n_storages, static.n_reals, static.n_scalars, outputs,
                   frozenset(viewed), tuple((sym, *src) for sym, src in sources.items()))


def _contiguous(size) -> tuple:
    strides = []
    acc = 1
    for s in reversed(size):
        strides.append(acc)
        acc = acc * s
    return tuple(reversed(strides))


def functional_graph(program: Program, example_inputs: list[torch.Tensor],
                     decompositions: dict) -> torch.fx.GraphModule:
    """A pure graph of core ATen ops computing `program`'s outputs from its inputs.

    Each node's `meta["pydisc_entry"]` is the index of the program entry it came from, so reports can
    point at the user's source line."""
    starts: list[tuple[int, int]] = []   # (graph length when entry began, entry index)

    def on_entry(index: int) -> None:
        mode = get_proxy_mode()
        if mode is not None:
            starts.append((len(mode.tracer.graph.nodes), index))

    def traced(*inputs):
        return program(*inputs, on_entry=on_entry)

    # Traced on fake copies of what the step reads, its data alone: fake tensors made of the inputs
    # themselves would describe their `.grad` too (an eager tensor's gradient is a lazy tensor once a
    # step gave it one), whose data is not there yet.
    example_inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs]

    # remove="mutations": views stay views (eager ops in the graph then copy nothing), matching the
    # probe's finding that reapplied views are exact. Inputs with symbolic sizes are traced with
    # torch's Python dispatcher on, as make_fx's own symbolic mode does: C++ meta kernels (that of
    # constant_pad_nd) would otherwise pin a symbolic size to its value in the recorded step.
    symbolic = any(isinstance(t, torch.Tensor) and any(not isinstance(s, int) for s in t.shape)
                   for t in example_inputs)
    try:
        with enable_python_dispatcher() if symbolic else contextlib.nullcontext():
            gm = make_fx(torch.func.functionalize(traced, remove="mutations"),
                         decomposition_table=decompositions, tracing_mode="fake")(*example_inputs)
    except Exception as exc:
        exc.pydisc_entry = starts[-1][1] if starts else None   # the entry being traced: named in reports
        raise
    if starts:
        bounds = iter(starts[1:] + [(1 << 62, -1)])
        next_start, next_index = next(bounds)
        current = starts[0][1]
        for position, node in enumerate(gm.graph.nodes):
            while position >= next_start:
                current = next_index
                next_start, next_index = next(bounds)
            node.meta["pydisc_entry"] = current
    # Writes into inputs come back as returned values (Program returns the mutated bases); drop the
    # copy_ into the placeholders that functionalize appends, the executor writes back itself.
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0].op == "placeholder":
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm
