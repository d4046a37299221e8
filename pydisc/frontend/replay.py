"""Replaying a trace: eagerly on device data, or under torch's functionalization to get a pure graph.

The same replay function serves both. Run on real tensors it reproduces eager semantics (views alias,
in-place ops write), which makes it the universal fallback. Traced by `make_fx` under
`torch.func.functionalize` with pydisc's decomposition table, it yields a functional FX graph of core
ATen ops: no views, no mutation, writes to inputs turned into returned values. That graph is what the
partitioner and the emitter work on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

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

    def __call__(self, *inputs: torch.Tensor, on_entry: Callable[[int], None] | None = None) -> list[torch.Tensor]:
        bases = inputs[: self.n_storages]
        reals = inputs[self.n_storages: self.n_storages + self.n_reals]
        scalars = inputs[-1] if self.n_scalars else None
        env: dict[int, torch.Tensor] = {}
        for vid, index, (size, stride, offset) in self.inputs:
            env[vid] = _view(bases[index], size, stride, offset)

        def decode(a):
            if type(a) is ValueRef:
                return env[a.vid]
            if type(a) is RealRef:
                return reals[a.index]
            if type(a) is ScalarRef:
                return scalars[a.index]
            if type(a) is list:
                return [decode(x) for x in a]
            return a

        for index, (fn, args, kwargs, out_vids, out_kind) in enumerate(self.entries):
            if on_entry is not None:
                on_entry(index)
            out = fn(*[decode(a) for a in args], **{k: decode(v) for k, v in kwargs.items()})
            if out_kind is None:
                env[out_vids[0]] = out
            else:
                for vid, o in zip(out_vids, out):
                    if vid is not None:
                        env[vid] = o
        return [bases[i] if kind == "base" else env[i] for kind, i in self.outputs]


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

    # remove="mutations": views stay views (eager ops in the graph then copy nothing), matching the
    # probe's finding that reapplied views are exact.
    gm = make_fx(torch.func.functionalize(traced, remove="mutations"),
                 decomposition_table=decompositions, tracing_mode="fake")(*example_inputs)
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
