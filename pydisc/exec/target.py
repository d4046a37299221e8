"""Compile targets: which IREE compiler flags and runtime driver serve a torch device.

All target knowledge lives here, so a change of flags or driver is made in one place.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

import torch

from ..config import CONFIG

__all__ = ["Target", "target_for", "CPU_DRIVER", "CPU_TARGET", "CUDA_TARGET", "CUDA_DIRECT_TARGET"]

# local-sync runs dispatches on the calling thread, local-task on a worker pool. Per CompiledModule.run
# (tests/exec/bench_call_overhead.py):
#   tiny add:                        local-sync 7.9 us / local-task 29 us (32 cores); 10 / 50 us (2 cores)
#   256^2 matmul+bias+relu+tanh:     local-sync 537 us / local-task 114 us (32 cores); 564 / 1191 us (2 cores)
# local-sync keeps the per-call cost lowest (what small clusters pay); local-task wins on big work with
# many cores. This is the one place to change it.
CPU_DRIVER = "local-sync"

# IREE demotes f64 to f32 by default and then rejects f64 buffers at run time; keep f64 as f64.
_COMMON_FLAGS = ("--iree-input-demote-f64-to-f32=false",)


@dataclass(frozen=True, slots=True)
class Target:
    name: str                  # "llvm-cpu" | "cuda"
    flags: tuple[str, ...]     # iree-compile flags; part of the compile cache key
    driver: str                # iree.runtime driver name


CPU_TARGET = Target(
    name="llvm-cpu",
    flags=(
        "--iree-hal-target-device=local",
        "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=host",
        *_COMMON_FLAGS,
    ),
    driver=CPU_DRIVER,
)

# sm_80 PTX, JIT-compiled by the driver on newer GPUs: IREE 3.13 has no Hopper (sm_90) target.
CUDA_TARGET = Target(
    name="cuda",
    flags=("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80", *_COMMON_FLAGS),
    driver="cuda",
)


# The same code, with the kernels launched by pydisc on torch's stream (pydisc/exec/direct): the module is
# compiled through IREE's host code, which the launcher reads. Constant expressions stay inside the
# kernels instead of becoming buffers that IREE's runtime initialises (an `as_strided` index table, say):
# the launcher has no such buffers. (Cheaper too: a kernel recomputes iota arithmetic faster than it
# reads a table.)
CUDA_DIRECT_TARGET = Target(
    name="cuda-direct",
    flags=(*CUDA_TARGET.flags, "--iree-opt-const-eval=false", "--iree-opt-const-expr-hoisting=false"),
    driver="cuda",
)


def target_for(device: torch.device | str) -> Target:
    """The target that compiles code for tensors living on `device`, with PYDISC_IREE_FLAGS appended."""
    target = _base_target(torch.device(device))
    if CONFIG.iree_flags:
        try:
            extra = tuple(shlex.split(CONFIG.iree_flags))
        except ValueError as e:
            raise ValueError("PYDISC_IREE_FLAGS=%r: %s; give iree-compile flags separated by spaces, e.g. "
                             "'--iree-opt-level=O3'" % (CONFIG.iree_flags, e)) from None
        bad = [f for f in extra if not f.startswith("--")]
        if bad:
            raise ValueError("PYDISC_IREE_FLAGS: %s is not an iree-compile flag (each starts with --), e.g. "
                             "'--iree-opt-level=O3'" % " ".join(bad))
        target = replace(target, flags=target.flags + extra)
    return target


def _base_target(device: torch.device) -> Target:
    if device.type == "cpu":
        return CPU_TARGET
    if device.type == "cuda":
        if CONFIG.gpu_executor == "iree":
            return CUDA_TARGET
        if CONFIG.gpu_executor != "direct":
            raise ValueError("PYDISC_GPU_EXECUTOR=%s: use direct (the default) or iree" % CONFIG.gpu_executor)
        return CUDA_DIRECT_TARGET
    raise ValueError(
        f"pydisc cannot compile for device {device}: only cpu and cuda tensors are supported; "
        "keep tensors on other devices in eager mode"
    )
