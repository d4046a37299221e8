"""torch.distributed on lazy tensors: every collective is a cut in the recorded step.

`dist.all_reduce`, `broadcast`, `all_gather`, ... (the `c10d` ops that ProcessGroup methods dispatch),
the functional collectives (`_c10d_functional`) and DDP's parameter broadcast reach the lazy dispatcher
as ops of their own namespaces. They cannot be compiled: they talk to other processes, in an order
that every rank must keep. So each one is a cut:

1. everything recorded so far runs (planned, compiled and cached like any step), so the collective
   reads finished device data and every rank has run the same clusters when it starts;
2. the op runs on that device data through torch.distributed (gloo on the CPU, NCCL on the GPU),
   writing in place where it writes in place;
3. its tensor results are lazy tensors again (the caller's own lazy tensors for in-place ops), and
   recording goes on; the clusters after the cut compile as the next piece of the step.

Cuts are counted in `metrics()['collectives']` (op -> runs) and `collective_seconds`, not as fallbacks.

DDP's reducer copies every gradient into a flat bucket (a plain tensor) as soon as autograd produces
it, which would cut the step once per gradient. `defer_next_copy(grad)` (called by
`pydisc.distributed.register_comm_hook` for each gradient of its module, right before the reducer
sees it) records that copy instead, into a lazy alias of the bucket's memory; whoever reads the bucket
calls `flush_deferred_writes()` first (pydisc's DDP comm hook, right before the bucket's all-reduce),
and the end of the backward pass flushes in any case.
"""
from __future__ import annotations

import time

import torch

from ..metrics import METRICS
from .lazy_tensor import RECORDER, LazyStorage, LazyTensor, map_nested, to_lazy
from .op_facts import REWRITES, opinfo

__all__ = ["COLLECTIVE_NAMESPACES", "install_collectives", "run_collective", "defer_next_copy",
           "flush_deferred_writes", "note_collective"]

aten = torch.ops.aten

# Operator namespaces whose ops communicate between processes; the functional ones return new tensors
# whose collective may still be in flight.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor")
_FUNCTIONAL = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _wait(out):
    if isinstance(out, torch.Tensor):
        return torch.ops._c10d_functional.wait_tensor(out)
    if isinstance(out, (list, tuple)):
        return type(out)(_wait(o) for o in out)
    return out


def note_collective(name: str, seconds: float) -> None:
    METRICS.collectives[name] += 1
    METRICS.collective_seconds += seconds


def run_collective(func, args, kwargs):
    """Run `func` as a cut: the pending step first, then the op on device data."""
    if RECORDER.trace.entries:
        RECORDER.run(None, "collective %s" % func)
    if RECORDER.in_flight is not None:
        RECORDER.in_flight("collective %s" % func)
    lazy_of: dict[int, LazyTensor] = {}

    def unwrap(a):
        if isinstance(a, LazyTensor):
            real = a._real
            if real is None:   # cannot happen after the cut, unless that step was abandoned
                raise RuntimeError("pydisc: %s got a lazy tensor without data (its step failed)" % func)
            lazy_of[id(real)] = a
            return real
        return a

    real_args = map_nested(unwrap, tuple(args))
    real_kwargs = {k: map_nested(unwrap, v) for k, v in kwargs.items()}
    start = time.perf_counter()
    out = func(*real_args, **real_kwargs)
    if func.namespace in _FUNCTIONAL:
        out = _wait(out)
    note_collective(str(func), time.perf_counter() - start)

    def wrap(o):
        if isinstance(o, LazyTensor) or not isinstance(o, torch.Tensor):
            return o
        # c10d's in-place ops return the very tensors they were given: hand back the caller's own
        own = lazy_of.get(id(o))
        return own if own is not None else to_lazy(o)

    if isinstance(out, (list, tuple)):
        return type(out)(type(o)(map(wrap, o)) if isinstance(o, (list, tuple)) else wrap(o) for o in out)
    return wrap(out)


def _waited(func, args, kwargs):
    """`wait_tensor`: functional collectives are waited for when they run (a cut is synchronous)."""
    return args[0]


def _wrap_async(func, args, kwargs):
    """`_wrap_tensor_autograd` would wrap the result as an AsyncCollectiveTensor; already waited for,
    it is the result itself (an alias, as the op's identity backward expects)."""
    return aten.alias.default(args[0])


# --------------------------------------------------------------------------------------------------
# Deferred writes into plain tensors (DDP's gradient buckets).

class _Deferral:
    def __init__(self) -> None:
        self.sources: dict[int, LazyTensor] = {}    # id -> lazy tensor whose next copy_ to be recorded
        self.epoch = -1                             # trace epoch of `aliases`
        # data_ptr of a plain allocation -> (first byte, end byte, lazy alias) of each region written
        self.aliases: dict[int, list[tuple[int, int, LazyTensor]]] = {}
        self.callback_task = None                   # graph task that has an end-of-backward flush queued


_DEFERRAL = _Deferral()


def defer_next_copy(source: LazyTensor) -> None:
    """Record the next `copy_` of `source` into a plain tensor, if it comes during this backward pass,
    instead of running it (pydisc's DDP hook marks each gradient of its module as autograd makes it)."""
    task = torch._C._current_graph_task_id()
    if task == -1 or not isinstance(source, LazyTensor):
        return
    d = _DEFERRAL
    d.sources[id(source)] = source
    if d.callback_task != task:
        d.callback_task = task
        torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)


def _end_of_backward() -> None:
    flush_deferred_writes()
    _DEFERRAL.sources.clear()
    _DEFERRAL.callback_task = None


def _alias(target: torch.Tensor) -> LazyTensor | None:
    """A lazy tensor over the memory of the plain, contiguous tensor `target`, or None.

    Each region written gets a lazy storage of its own, over exactly its bytes (a gradient's slot in a
    DDP bucket): the compiled step then hands back the gradient itself, which is copied into the slot,
    instead of rebuilding the whole bucket with one scatter per gradient. Regions of one allocation
    that overlap without being the same would not stay ordered, so the pending step runs first."""
    if not target.is_contiguous():
        return None
    d = _DEFERRAL
    if d.epoch != RECORDER.epoch:
        d.epoch, d.aliases = RECORDER.epoch, {}
    size = target.element_size()
    start, end = target.storage_offset() * size, (target.storage_offset() + target.numel()) * size
    regions = d.aliases.setdefault(target.untyped_storage().data_ptr(), [])
    for first, last, alias in regions:
        if (first, last) == (start, end) and alias.dtype == target.dtype:
            storage = alias._storage
            break
        if first < end and start < last:
            RECORDER.run(None, "overlapping deferred writes")
            return _alias(target)
    else:
        storage = LazyStorage(end - start, target.detach().reshape(-1))
    alias = LazyTensor(tuple(target.shape), target.stride(), 0, target.dtype, target.device, storage,
                       real=target.detach())
    regions.append((start, end, alias))
    return alias


def _copy_rewrite(previous):
    def rewrite(func, args, kwargs):
        sources = _DEFERRAL.sources
        if sources and len(args) == 2 and id(args[1]) in sources and type(args[0]) is torch.Tensor and \
                args[0].dtype == args[1].dtype and args[0].device == args[1].device:
            alias = _alias(args[0]) if torch._C._current_graph_task_id() != -1 else None
            if alias is not None:
                del sources[id(args[1])]
                RECORDER.record(func, (alias, args[1]), kwargs, opinfo(func))
                return args[0]
        return previous(func, args, kwargs) if previous is not None else NotImplemented
    return rewrite


def flush_deferred_writes() -> None:
    """Run the pending step if it writes plain tensors through deferred copies (pydisc's DDP hook, right
    before a bucket's all-reduce; and the end of every backward pass that deferred a copy)."""
    d = _DEFERRAL
    if d.epoch == RECORDER.epoch and d.aliases and RECORDER.trace.entries:
        RECORDER.run(None, "deferred writes")
    d.aliases = {}


# --------------------------------------------------------------------------------------------------

_SPECIAL = {"wait_tensor": _waited, "_wrap_tensor_autograd": _wrap_async}


def _namespace_rewrite(func, args, kwargs):
    return _SPECIAL.get(func._opname, run_collective)(func, args, kwargs)


def install_collectives() -> None:
    """Route every op of the collective namespaces to `run_collective` (by namespace: some of them are
    registered only when their Python module is imported), and install the deferred copy."""
    for namespace in COLLECTIVE_NAMESPACES:
        REWRITES[namespace] = _namespace_rewrite
    REWRITES[aten.copy_.default] = _copy_rewrite(REWRITES.get(aten.copy_.default))
