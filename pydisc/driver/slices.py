"""Which part of the pending trace a run takes: the entries a value needs (`needed_entries`), the
entries whose effects are observable (`observable_entries`), the outputs a run binds
(`select_outputs`: written inputs and values still alive), the structural key a plan is cached under
(`concrete_key`).
"""
from __future__ import annotations

import torch

from ..frontend.lazy_tensor import RECORDER
from ..frontend.trace import LazyStorage, Trace

__all__ = ["concrete_key", "inputs_seen", "needed_entries", "observable_entries", "select_outputs",
           "size_only_storages", "step_device"]


def step_device(trace: Trace) -> torch.device:
    for t in trace.storage_inputs:
        return t.device
    for t in trace.real_inputs:
        if t.dim() > 0:
            return t.device
    return torch.device("cpu")


def needed_entries(trace: Trace, storage: LazyStorage) -> list[int]:
    """Entries that the current data of `storage` depends on, in program order.

    One backward pass tracks which storages' state is still needed at each point. An entry left out
    that touches a storage which a kept entry later writes (it would read the new value, or overwrite
    it, when run afterwards) is forced in, and the pass repeats until nothing changes.
    """
    entries = trace.entries
    n = len(entries)
    produced = [{id(trace.storages[v]) for v in e.out_vids if v is not None} | {id(s) for s in e.writes}
                for e in entries]
    reads = [{id(s) for s in e.reads} for e in entries]
    writes = [{id(s) for s in e.writes} for e in entries]
    forced: set[int] = set()
    while True:
        needed = {id(storage)}
        include = [False] * n
        for i in range(n - 1, -1, -1):
            if i in forced or produced[i] & needed:
                include[i] = True
                needed |= reads[i]
        later_writes: set[int] = set()
        new_forced = set()
        for i in range(n - 1, -1, -1):
            if include[i]:
                later_writes |= writes[i]
            elif (reads[i] | writes[i]) & later_writes:
                new_forced.add(i)
        if not new_forced:
            return [i for i in range(n) if include[i]]
        forced |= new_forced


def observable_entries(trace: Trace, held: set[int] | None = None) -> list[int]:
    """Entries whose effect can still be seen, in program order: they make or write (directly or through
    later entries) a storage that a live lazy tensor (or, given `held`, one of those storage ids) or an
    input of the step holds. The others made only tensors that have died since, and running them would
    compute values nobody can read."""
    roots = {id(s) for s in trace.input_storages}
    if held is not None:
        roots |= held
    else:
        for ref in trace.tensors.values():
            t = ref()
            if t is not None:
                roots.add(id(t._storage))
    needed = roots
    keep = []
    storages = trace.storages
    for i in range(len(trace.entries) - 1, -1, -1):
        e = trace.entries[i]
        if any(id(s) in needed for s in e.writes) or \
                any(v is not None and id(storages[v]) in needed for v in e.out_vids):
            keep.append(i)
            needed.update(id(s) for s in e.reads)
    keep.reverse()
    return keep


def select_outputs(trace: Trace, executed: list[int], remaining: list[int]) -> tuple:
    """Storages whose data must exist after running `executed`: inputs they write (written back), and
    storages they create that a live tensor or a remaining entry still uses."""
    needed = set()          # ids of the storages a live tensor or a remaining entry uses
    for i in remaining:
        needed.update([id(s) for s in trace.entries[i].reads])
    for ref in trace.tensors.values():
        t = ref()
        if t is not None:
            needed.add(id(t._storage))
    outputs = []
    written_inputs = set()
    epoch = trace.epoch
    storages = trace.storages
    entries = trace.entries
    for i in executed:
        e = entries[i]
        for s in e.writes:
            if s.input_index >= 0 and s.epoch == epoch:
                written_inputs.add(s.input_index)
        for vid in e.out_vids:
            if vid is None:
                continue
            s = storages[vid]
            if s.creator == vid and id(s) in needed:
                outputs.append(("value", vid))
    return tuple([("base", i) for i in sorted(written_inputs)] + outputs)


def concrete_key(trace: Trace, executed: list[int], outputs: tuple) -> tuple:
    """What a plan for the executed entries depends on: inputs' metadata, ops, constants, outputs."""
    entries = trace.entries
    return (
        tuple([(t.numel(), t.dtype, t.device) for t in trace.storage_inputs]),
        tuple([(tuple(t.shape), t.stride(), t.dtype, t.device) for t in trace.real_inputs]),
        tuple([v for v in trace.values if v[0] == "in"]),
        tuple([entries[i].sig for i in executed]),
        len(trace.scalars),
        outputs,
    )


def inputs_seen(trace: Trace) -> tuple:
    """What `dynamic.changed_dims` compares between two steps with the same ops: the step inputs'
    shapes, which input storages the previous step made (a KV cache made anew each step), the step."""
    previous = RECORDER.step_id - 1
    return (list(RECORDER.input_shapes), tuple(s.produced == previous for s in trace.input_storages),
            RECORDER.step_id)


def size_only_storages(trace: Trace, executed: list[int]) -> set[int]:
    """ids of the storages that `executed` entries computed from sizes and eager tensors alone: entries
    that read no storage but those such entries made, and no lifted scalar."""
    made: set[int] = set()
    for i in executed:
        e = trace.entries[i]
        if "scalar" in e.sig or any(id(s) not in made for s in e.reads):
            continue
        made.update(id(trace.storages[v]) for v in e.out_vids if v is not None)
    return made
