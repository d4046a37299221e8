"""The pending trace: ATen ops recorded in program order between two `mark_step` calls.

A trace is a straight-line program over *values*. A value is either an input (a lazy tensor whose data
was already on the device when the trace first saw it, a real eager tensor, or a lifted Python scalar)
or a tensor produced by a recorded op. In-place ops keep the value id of the tensor they mutate, views
get a value id of their own and share the storage of their source: replaying the trace on real tensors
in order therefore reproduces eager semantics exactly, aliasing included, and torch's functionalization
turns the same replay into a pure graph for the compiler (`frontend/replay.py`).

Every entry contributes a hashable signature to the trace's structural key, computed while recording, so
finding the compiled plan for a step costs one dict lookup.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "LazyStorage", "ValueRef", "RealRef", "ScalarRef", "Entry", "Trace", "grow_values", "out_kind", "storage_serial",
    "generator_states",
]


class LazyStorage:
    """Shared by a lazy tensor and all its views, like a torch storage.

    `real` is a tensor covering the whole storage once it holds device data. `creator` is the value id
    of the trace value that allocated the storage (for storages created in the pending trace), and
    `written` says that the pending trace writes into it; `fast_written`, that the forward being
    recorded at `__torch_function__` does (a BatchNorm's running statistics), which the trace does not
    hold yet (frontend/segment.py). `exported`: its memory's address was handed out (NumPy, DLPack,
    `data_ptr`), so a step's new value is copied into that memory, never handed over by exchanging
    memory (driver/bind.py).
    """

    __slots__ = ("real", "nbytes", "creator", "written", "epoch", "input_index", "ordinal", "produced",
                 "fast_written", "exported", "serial", "__weakref__")

    def __init__(self, nbytes: int, real: torch.Tensor | None = None, epoch: int = -1,
                 produced: int | None = None) -> None:
        self.real = real
        self.nbytes = nbytes
        self.creator: int | None = None
        self.written = False
        self.fast_written = False
        self.exported = False
        self.epoch = epoch          # trace epoch in which creator/written/input_index are valid
        self.input_index = -1       # index into Trace.storage_inputs for this epoch
        self.ordinal = -1           # a step input: made lazy as the ordinal-th input of its step
        # the step whose recorded op allocated it (None: a parameter, buffer, input or eager result)
        self.produced = produced


_SERIALS = itertools.count()


def storage_serial(s: LazyStorage) -> int:
    """A number no other storage of the process gets, for identities kept across steps (`id(s)` is
    another storage's once `s` dies: a second model's parameters looked like the first one's)."""
    try:
        return s.serial
    except AttributeError:
        n = s.serial = next(_SERIALS)
        return n


@dataclass(frozen=True, slots=True)
class ValueRef:
    vid: int


@dataclass(frozen=True, slots=True)
class RealRef:
    index: int


@dataclass(frozen=True, slots=True)
class ScalarRef:
    index: int


# Value ids count from 0 in every trace, so the objects that stand for value `vid` in entries (its
# `ValueRef`, its structural-signature part, the ("out", entry) kind of an op's output) are made once
# per process and shared by all traces. Recording then allocates none of them, and the structural keys
# of two steps share these parts, which makes comparing the keys mostly identity checks.
VALUE_REFS: list[ValueRef] = []
VALUE_SIGS: list[tuple] = []       # ("v", vid)
OUT_KINDS: list[tuple] = []        # ("out", entry index)


def _grow(table: list, n: int, make: Callable[[int], Any]) -> None:
    while len(table) <= n:
        table.append(make(len(table)))


def grow_values(vid: int) -> None:
    """Make the shared objects that stand for value ids up to `vid`."""
    _grow(VALUE_REFS, vid, ValueRef)
    _grow(VALUE_SIGS, vid, lambda i: ("v", i))


def out_kind(entry_index: int) -> tuple:
    if entry_index >= len(OUT_KINDS):
        _grow(OUT_KINDS, entry_index, lambda i: ("out", i))
    return OUT_KINDS[entry_index]


@dataclass(slots=True)
class Entry:
    """One recorded op. `fn` is an OpOverload or a small Python function built from ATen ops (used by
    rewrites that turn Python scalars into lifted scalar inputs)."""

    fn: Callable[..., Any]
    args: list[Any]                 # ValueRef/RealRef/ScalarRef in place of tensors and lifted scalars
    kwargs: dict[str, Any]
    out_vids: tuple[int, ...]       # value id per output tensor
    out_kind: type | None           # tuple/list for multi-output ops, None for a single tensor
    reads: tuple[LazyStorage, ...]
    writes: tuple[LazyStorage, ...]
    sig: tuple                      # structural signature: op, constants, value ids, input metadata
    source: str | None = None       # user code line that issued the op (while sources are captured)


@dataclass
class Trace:
    epoch: int
    entries: list[Entry] = field(default_factory=list)
    # value id -> ("in", storage input index, layout) | ("out", entry index)
    values: list[tuple] = field(default_factory=list)
    storage_inputs: list[torch.Tensor] = field(default_factory=list)  # device data of each input storage
    input_storages: list[LazyStorage] = field(default_factory=list)   # the storages themselves
    storage_versions: list[int] = field(default_factory=list)         # their version counters at capture
    real_inputs: list[torch.Tensor] = field(default_factory=list)
    real_versions: list[int] = field(default_factory=list)
    real_index: dict[int, int] = field(default_factory=dict)      # id(tensor) -> index
    snapshots: dict[int, tuple] = field(default_factory=dict)     # id(tensor) -> (it, its version, index)
    scalars: list[float] = field(default_factory=list)
    metas: dict[int, tuple] = field(default_factory=dict)          # value id -> (size, stride, offset, dtype)
    tensors: dict[int, weakref.ref] = field(default_factory=dict)  # value id -> lazy tensor
    storages: dict[int, LazyStorage] = field(default_factory=dict)  # value id -> its storage
    # symbolic steps only: value id -> (size, stride, offset, dtype) with SymInts (`metas` keeps
    # this step's concrete numbers)
    sym_metas: dict[int, tuple] = field(default_factory=dict)
    symbolic: Any = None            # the SymbolicStep of a symbolic step
    # a read ran part of this trace and removed those entries: some inputs may no longer be read by any
    partly_run: bool = False
    # symbolic steps: input storages whose data such a read computed from sizes and eager tensors alone
    # (`torch.arange(T)`, made lazy only because T is symbolic): eager tensors in a concrete step
    size_only_inputs: set = field(default_factory=set)
    fused: int = 0                  # forwards the fast recorder recorded into it (FusedStep entries)
    # torch's generators as they were when its first random op was recorded (`note_draw`): its random ops
    # draw when it runs, so nothing else may draw in between (frontend/random_state.py checks it)
    rng_note: list | None = None

    def note_draw(self, device: torch.device) -> None:
        if self.rng_note is None:
            self.rng_note = generator_states(device)

    def __len__(self) -> int:
        return len(self.entries)

    def new_value(self, kind: tuple, storage: LazyStorage, meta: tuple) -> int:
        vid = len(self.values)
        if vid >= len(VALUE_REFS):
            grow_values(vid)
        self.values.append(kind)
        self.storages[vid] = storage
        self.metas[vid] = meta
        return vid

    def structure_key(self, outputs: tuple) -> tuple:
        """Everything the compiled plan depends on: inputs' metadata, ops, constants, outputs."""
        return (
            tuple((s.numel(), s.dtype, s.device) for s in self.storage_inputs),
            tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in self.real_inputs),
            tuple(v for v in self.values if v[0] == "in"),
            tuple(e.sig for e in self.entries),
            len(self.scalars),
            outputs,
        )

    def release(self) -> None:
        """Drop everything a trace that has run completely holds. Its objects (thousands per step) are
        freed now, before the recorder turns the cyclic GC back on, rather than scanned by the
        collection that turning it on starts."""
        self.entries = []
        self.values = []
        self.metas = {}
        self.tensors = {}
        self.storages = {}
        self.sym_metas = {}
        self.snapshots = {}

    def compacted(self, kept: list[int]) -> "Trace":
        """A trace of only the entries `kept` (indices, in order), renumbered as if only they had been
        recorded: values, storage inputs, eager inputs and lifted scalars that nothing kept refers to
        are gone, so that whatever they held is released. Live lazy tensors of this trace get their
        new value ids. For concrete traces (not symbolic ones)."""
        new = Trace(epoch=self.epoch)
        vids: dict[int, int] = {}
        storage_index: dict[int, int] = {}
        real_index: dict[int, int] = {}
        scalar_index: dict[int, int] = {}

        def value(vid: int) -> int:
            if vid not in vids:
                kind = self.values[vid]
                if kind[0] == "in":
                    old = kind[1]
                    if old not in storage_index:
                        storage_index[old] = len(new.storage_inputs)
                        storage = self.input_storages[old]
                        storage.input_index = storage_index[old]
                        new.storage_inputs.append(self.storage_inputs[old])
                        new.input_storages.append(storage)
                        new.storage_versions.append(self.storage_versions[old])
                    kind = ("in", storage_index[old], kind[2])
                vids[vid] = new.new_value(kind, self.storages[vid], self.metas[vid])
            return vids[vid]

        def real(index: int) -> int:
            if index not in real_index:
                real_index[index] = len(new.real_inputs)
                t = self.real_inputs[index]
                new.real_index[id(t)] = real_index[index]
                new.real_inputs.append(t)
                new.real_versions.append(self.real_versions[index])
            return real_index[index]

        def arg(a):
            t = type(a)
            if t is ValueRef:
                return VALUE_REFS[value(a.vid)]
            if t is RealRef:
                return RealRef(real(a.index))
            if t is ScalarRef:
                if a.index not in scalar_index:
                    scalar_index[a.index] = len(new.scalars)
                    new.scalars.append(self.scalars[a.index])
                return ScalarRef(scalar_index[a.index])
            if t is list:
                return [arg(x) for x in a]
            return a

        def sig_part(part):
            if type(part) is tuple and len(part) == 2 and part[0] == "v":
                return VALUE_SIGS[value(part[1])]
            if type(part) is tuple and len(part) == 2 and part[0] == "r":
                return ("r", real(part[1]))
            return part

        for i in kept:
            e = self.entries[i]
            args = [arg(a) for a in e.args]
            kwargs = {k: arg(v) for k, v in e.kwargs.items()}
            sig = tuple(sig_part(p) for p in e.sig)
            out_vids = []
            for vid in e.out_vids:
                if vid is not None and vid not in vids:
                    storage = self.storages[vid]
                    vids[vid] = new.new_value(out_kind(len(new.entries)), storage, self.metas[vid])
                    if storage.creator == vid:
                        storage.creator = vids[vid]
                out_vids.append(None if vid is None else vids[vid])
            new.entries.append(Entry(e.fn, args, kwargs, tuple(out_vids), e.out_kind, e.reads, e.writes,
                                     sig, e.source))
        for vid, ref in self.tensors.items():
            t = ref()
            if t is not None:
                t._vid = value(vid)
                new.tensors[t._vid] = ref
        new.rng_note = self.rng_note
        kept_storages = {id(s) for s in new.input_storages}
        for storage in self.input_storages:
            if id(storage) not in kept_storages:
                storage.input_index = -1     # an input again if a live view of it is used later
        return new

    def add_real_input(self, t: torch.Tensor) -> RealRef:
        if t.requires_grad or t.numel() == 1:
            return self._snapshot(t)
        index = self.real_index.get(id(t))
        if index is None:
            index = len(self.real_inputs)
            self.real_index[id(t)] = index
            self.real_inputs.append(t)
            self.real_versions.append(t._version)
        return RealRef(index)

    def _snapshot(self, t: torch.Tensor) -> RealRef:
        """An eager tensor that requires grad (a parameter outside the lazy model: a loss weight, a
        temperature) is read as a copy of its value now, as eager's op and the backward it saves it for
        read it: its optimizer writes it in place before the step runs, with no op of pydisc's (Adam's
        update of it is eager code alone). So is an eager tensor of one element, which code updates in
        place after a lazy op read it, within the step, more often than not: `torch.optim.ASGD`'s
        per-parameter `eta` and `mu` (its step reads them, then writes their next values), a tensor
        learning rate that an LR scheduler fills after `optimizer.step()`. A copy per value it has in the
        step (its version); larger eager tensors are read by reference (`check_real_inputs`)."""
        found = self.snapshots.get(id(t))
        if found is not None and found[0] is t and found[1] == t._version:
            return RealRef(found[2])
        index = len(self.real_inputs)
        copy = t.detach().clone()
        self.snapshots[id(t)] = (t, t._version, index)
        self.real_inputs.append(copy)
        self.real_versions.append(copy._version)
        return RealRef(index)

    def add_scalar(self, value: float) -> ScalarRef:
        self.scalars.append(float(value))
        return ScalarRef(len(self.scalars) - 1)

    def reads_memory_of(self, t: torch.Tensor) -> bool:
        """Whether the trace reads eager tensor `t`'s memory by reference: an eager input, or a step input
        wrapped without a copy (a module input, `to_lazy`)."""
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0:
            return False        # (an empty tensor)
        return any(r.untyped_storage().data_ptr() == ptr for r in self.real_inputs) or \
            any(r.untyped_storage().data_ptr() == ptr
                for r, s in zip(self.storage_inputs, self.input_storages) if s.ordinal >= 0)

    def check_real_inputs(self, entry_indices: list[int]) -> None:
        """Eager tensors are captured by reference: writing into one after a lazy op read it would make the
        lazy result silently wrong, so refuse loudly. Only the tensors the entries about to run read:
        when they are all the entries of a trace none of which ran yet, every input (each was added by
        an entry that reads it)."""
        if len(entry_indices) == len(self.entries) and not self.partly_run:
            stale = [t for t, version in zip(self.storage_inputs, self.storage_versions) if t._version != version]
            used = range(len(self.real_inputs))
        else:
            used = set()
            stale = []
            for i in entry_indices:
                for part in self.entries[i].sig:
                    if type(part) is tuple and len(part) == 2 and part[0] == "r":
                        used.add(part[1])
                for storage in self.entries[i].reads:
                    index = storage.input_index
                    if storage.epoch == self.epoch and index >= 0 and \
                            self.storage_inputs[index]._version != self.storage_versions[index]:
                        stale.append(storage)
        if stale:
            raise RuntimeError(
                "pydisc: a tensor handed to pydisc without a copy (a module input, or "
                "pydisc.to_lazy) was modified in place by eager code after a lazy op used it in "
                "this step. Pass a copy (`t.clone()`), or call pydisc.mark_step() before modifying it.")
        for index in used:
            t, version = self.real_inputs[index], self.real_versions[index]
            if t._version != version:
                raise RuntimeError(
                    "pydisc: an eager tensor of shape %s was modified in place after a lazy op used it in "
                    "this step. Pass a copy (`t.clone()`) to the lazy computation, or call "
                    "pydisc.mark_step() before modifying it." % (tuple(t.shape),))


def generator_states(device: torch.device) -> list:
    """The states of the generators a step on `device` draws from: the CPU's and, on a GPU, its own (read
    from the generators themselves: torch's module functions are guarded, random_state.py)."""
    states = [(None, torch.default_generator.get_state())]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        states.append((index, torch.cuda.default_generators[index].get_state()))
    return states
