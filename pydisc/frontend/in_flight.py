"""The recorder's part for a step running on a worker thread while the next one records: which reads
wait for it.

`InFlightReads` is a base of `lazy_tensor.Recorder`. The driver (pydisc/driver/inflight.py) tells it of
each run it starts and binds (`note_in_flight`); a read of device data asks `waits_for` whether it must
wait for that run: only where it reads what the run has not made yet or memory the run writes.
"""
from __future__ import annotations

from typing import Callable

import torch

from .tensor import LazyTensor

__all__ = ["InFlightReads"]


def _no_writes() -> tuple:
    """What a run writes where none is in flight (`InFlightReads.in_flight_writes`)."""
    return ()


class InFlightReads:
    def __init__(self) -> None:
        # While the step before runs on a worker thread: the driver's wait for it, `in_flight(reason)`,
        # which binds its results. Called before device data is read and before a result of that step is
        # used; the next step's recording does not otherwise wait.
        self.in_flight: Callable[[str], None] | None = None
        # ... and, for that run, a function that says which memory it writes (its parameters' and optimizer
        # state's: (start, end) addresses), called at the first read that asks (`waits_for`), which keeps
        # its answer with it
        self.in_flight_writes: Callable[[], tuple] = _no_writes
        self.in_flight_written: tuple = (_no_writes, ())

    def note_in_flight(self, wait: Callable[[str], None] | None, writes: Callable[[], tuple] | None) -> None:
        """The driver's run in flight: its wait and what it writes (`in_flight`, `in_flight_writes`); None,
        None once it is bound."""
        self.in_flight = wait
        self.in_flight_writes = writes if writes is not None else _no_writes

    def waits_for(self, tensors) -> bool:
        """Whether reading the device data of the tensors among `tensors` (lists of them too) waits for the
        run in flight: a lazy one holds no data yet (a result of that run, a value being recorded), or one
        holds memory that overlaps what that run writes (a plain alias of a parameter, a NumPy round trip of
        a parameter's row, too). Another's data stays as it is while the run goes on (the loss of the step
        before, logged while this one runs)."""
        writes = self.in_flight_writes
        cached = self.in_flight_written
        if cached[0] is not writes:         # (a new run's: worked out once, at the first read that asks)
            cached = self.in_flight_written = (writes, writes())
        spans = cached[1]
        for a in tensors:
            for t in (a if type(a) is list or type(a) is tuple else (a,)):
                if not isinstance(t, torch.Tensor):
                    continue
                if type(t) is LazyTensor:
                    if t._real is None or t._fid is not None or t._redirect is not None or t._storage.fast_written:
                        return True
                    memory = t._real.untyped_storage()
                else:
                    try:
                        memory = t.untyped_storage()
                    except (RuntimeError, NotImplementedError, TypeError):
                        return True     # (a tensor subclass without memory of its own: it waits, as any did)
                start = memory.data_ptr()
                end = start + memory.nbytes()
                for first, last in spans:
                    if start < last and first < end:
                        return True
        return False
