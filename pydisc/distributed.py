"""pydisc under torch.distributed: DDP and collectives on lazy tensors (docs/distributed.md).

Collectives need nothing from the user: a torch.distributed op on lazy tensors is a cut in the step
(`frontend/collectives.py`), run on device data by gloo or NCCL. DDP works unchanged around a
`pydisc.lazy` module. `register_comm_hook(ddp)` makes it cheaper: DDP's reducer then copies gradients
into its buckets inside the recorded step, and each bucket runs as one compiled piece right before its
all-reduce, instead of the step being cut once per gradient.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .frontend.collectives import defer_next_copy, flush_deferred_writes, note_collective
from .frontend.lazy_tensor import LazyTensor

__all__ = ["register_comm_hook", "allreduce_mean_hook"]

CommHook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]


def allreduce_mean_hook(process_group: dist.ProcessGroup | None,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's built-in reduction: the bucket times 1/world size, then summed by all_reduce. The same
    arithmetic as DDP without a hook (which multiplies while copying), so the results are equal."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_comm_hook(ddp: torch.nn.parallel.DistributedDataParallel, state: Any = None,
                       hook: CommHook | None = None) -> torch.nn.parallel.DistributedDataParallel:
    """Register pydisc's communication hook on `ddp`, a DistributedDataParallel around a `pydisc.lazy`
    module, and return `ddp`.

    From then on, the reducer's copy of each gradient of the module into its bucket is recorded into
    the step (each gradient is marked by a post-accumulate-grad hook on its parameter, which autograd
    runs right before the reducer's). When a bucket is full, everything recorded up to it runs,
    compiled, and `hook(state, bucket)` reduces the bucket's device data: by default
    `allreduce_mean_hook` over DDP's process group, equal to DDP without a hook. Any DDP comm hook
    works as `hook`; it sees the filled bucket. Register hooks of a lazy DDP through this function, not
    with `ddp.register_comm_hook`.
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("pydisc.distributed.register_comm_hook expects a DistributedDataParallel, got %s"
                        % type(ddp).__name__)
    if not any(isinstance(p, LazyTensor) for p in ddp.module.parameters()):
        raise TypeError("pydisc.distributed.register_comm_hook: the module inside DDP has no lazy parameters; "
                        "wrap it as DDP(pydisc.lazy(model)) first")
    if hook is None:
        hook, state = allreduce_mean_hook, ddp.process_group if state is None else state
    inner = hook

    def pydisc_hook(hook_state, bucket):   # unannotated: DDP checks annotations, and these are strings here
        flush_deferred_writes()        # forward and backward up to this bucket, compiled
        start = time.perf_counter()
        future = inner(hook_state, bucket)
        note_collective("DDP bucket (%s)" % getattr(inner, "__name__", "hook"), time.perf_counter() - start)
        return future

    ddp.register_comm_hook(state, pydisc_hook)
    # Autograd runs a parameter's post-accumulate-grad hooks before DDP's reducer sees its gradient:
    # marking the gradient there makes the reducer's copy of it into the bucket a recorded op.
    for p in ddp.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_mark_gradient)
    return ddp


def _mark_gradient(param: torch.Tensor) -> None:
    defer_next_copy(param.grad)
