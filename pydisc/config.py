"""All user-facing settings in one place, read from environment variables."""
from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Config", "CONFIG", "SCOPES", "applies"]


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


SCOPES = ("all", "cuda", "cpu", "off")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """The setting `name` if it is one of `allowed` (case and spaces ignored); a clear error otherwise,
    since a typo would silently mean something else."""
    value = _env(name, default).strip().lower() or default
    if value not in allowed:
        hint = " (the GPU is `cuda`)" if value in ("gpu", "gpus", "nvidia") and "cuda" in allowed else ""
        raise ValueError("%s=%s is not a setting pydisc knows%s: use one of %s (see the README's settings)"
                         % (name, _env(name), hint, ", ".join(allowed)))
    return value


def _scope(name: str, default: str) -> str:
    return _choice(name, default, SCOPES)


def _fast_scope() -> str:
    value = _choice("PYDISC_FAST_RECORD", "all", SCOPES + ("0", "1"))
    return {"1": "all", "0": "off"}.get(value, value)


def applies(scope: str, device) -> bool:
    """Whether a scope setting ("all", "cuda", "cpu", "off") covers `device` (a torch.device)."""
    return scope == "all" or scope == device.type


@dataclass
class Config:
    dump_dir: str = _env("PYDISC_DUMP_DIR")              # write each cluster's MLIR + partition summary
    disable: bool = _env("PYDISC_DISABLE") == "1"        # never compile: every op runs eagerly at mark_step
    min_cluster_ops: int = int(_env("PYDISC_MIN_CLUSTER_OPS", "1"))
    strict: bool = _env("PYDISC_STRICT") == "1"          # raise on the first fallback or forced read in a step
    log: frozenset = frozenset(x for x in _env("PYDISC_LOG").split(",") if x)   # compiles, recompiles, plans
    check_every: int = int(_env("PYDISC_CHECK", "0"))    # rerun every Nth execution of a cluster eagerly and compare
    gc_pause: bool = _env("PYDISC_GC_PAUSE", "1") != "0"  # no cyclic GC while a step is being recorded
    progress: bool = _env("PYDISC_PROGRESS", "1") != "0"  # a line per cluster while a long compile runs
    # iree-compile processes run at once when a new step graph has several clusters to compile
    compile_jobs: int = int(_env("PYDISC_COMPILE_JOBS", "0")) or min(8, os.cpu_count() or 1)
    # compiled executables shared across processes (docs/cache.md): "" = $XDG_CACHE_HOME/pydisc or
    # ~/.cache/pydisc, "off" = no disk cache; evicted least-recently-used beyond cache_max_mb
    cache_dir: str = _env("PYDISC_CACHE_DIR")
    shape_log: str = _env("PYDISC_SHAPE_LOG")             # append each compiled cluster (python -m pydisc.precompile)
    cache_max_mb: float = float(_env("PYDISC_CACHE_MAX_MB", "2048"))
    dynamic: bool = _env("PYDISC_DYNAMIC", "1") != "0"     # dynamic dims (0: one static plan per shape)
    # a dynamic-shape template recorded at sizes that were all multiples of 8 serves only such sizes (a
    # guard), and its compiled code knows it, as it knows each dim's constant factors: IREE vectorizes over
    # those dims (pydisc/driver/dynamic.py, SIZE_MULTIPLE). Another size gets a template of its own.
    # "off" (default), "cuda", "cpu" or "all"
    size_multiples: str = _scope("PYDISC_SIZE_MULTIPLES", "off")
    # on CUDA, matmuls and convolutions run in torch (cuBLAS/cuDNN, several times faster than IREE's
    # code) between compiled clusters; "iree" keeps them inside the clusters
    gpu_matmul: str = _choice("PYDISC_GPU_MATMUL", "torch", ("torch", "iree"))
    # on the CPU the same choice: "torch" runs them in torch's libraries (oneDNN, MKL) between the clusters
    cpu_matmul: str = _choice("PYDISC_CPU_MATMUL", "iree", ("torch", "iree"))
    # on CUDA, how compiled clusters run: "direct" launches IREE's kernels on torch's current stream
    # (pydisc/exec/direct), "iree" calls IREE's runtime (its own stream, a host sync per call)
    gpu_executor: str = _choice("PYDISC_GPU_EXECUTOR", "direct", ("direct", "iree"))
    # on its second call, time each compiled cluster against its ops run eagerly and keep eager where
    # it is >10% faster (exec/clusters.py, CompiledCluster.measure): "cuda" (default), "cpu", "all" or "off"
    measure: str = _scope("PYDISC_MEASURE", "cuda")
    # once a step graph repeats, time a few steps compiled and a few run eagerly op by op, and keep the
    # faster for the rest of the process (pydisc/driver/step_choice.py): "all" (default), "cuda", "cpu", "off"
    step_choice: str = _scope("PYDISC_STEP_CHOICE", "all")
    # a new step graph is compiled the Nth time it is recorded; until then it runs eagerly (a graph seen
    # once, like an optimizer's first step that creates its state, is never compiled). 1: at once
    compile_after: int = max(1, int(_env("PYDISC_COMPILE_AFTER", "2")))
    # a new step graph's plan is built in a thread while the steps run eagerly (pydisc/driver/background.py):
    # "cuda" (default), "cpu", "all" or "off"
    background_compile: str = _scope("PYDISC_BACKGROUND_COMPILE", "cuda")
    # the torch-mlir route: ops with no StableHLO rule are compiled through torch-mlir's FX importer
    # (frontend/torch_mlir.py) instead of running eagerly, where it can
    torch_mlir: bool = _env("PYDISC_TORCH_MLIR", "1") != "0"
    # extra iree-compile flags for every cluster (space-separated, shell quoting), appended to the
    # target's own; part of the compile cache key (bench/kernel_sweep.py times variants of them)
    iree_flags: str = _env("PYDISC_IREE_FLAGS")
    # on CUDA, a step plan that has run twice is captured as one CUDA graph and replayed with one launch
    # (pydisc/exec/graphs.py): 0 runs it kernel by kernel
    cuda_graphs: bool = _env("PYDISC_CUDA_GRAPHS", "1") != "0"
    # on CUDA, attention written out (softmax(q @ k^T * scale) @ v) and its gradient run as torch's
    # flash or memory-efficient attention kernels (pydisc/cluster/attention.py): 0 leaves them as written
    fuse_attention: bool = _env("PYDISC_FUSE_ATTENTION", "1") != "0"
    # a compiled step also computes whether an index is out of range or an integer is divided by zero
    # where eager raises, and is run again eagerly (raising eager's error) when one is
    # (pydisc/cluster/value_checks.py): "cpu" (default), "cuda", "all" or "off"
    value_checks: str = _scope("PYDISC_VALUE_CHECKS", "cpu")
    # forwards that record gradients are recorded as the calls user code makes and differentiated when
    # the step is planned (pydisc/frontend/fast.py), for lazy modules on: "all" (default, or 1), "cuda",
    # "cpu", "off" (or 0: every ATen op through the dispatcher)
    fast_record: str = _fast_scope()
    # on the CPU, a compiled step runs on a worker thread while the next step records; device data is
    # waited for where it is read (pydisc/driver/inflight.py): 1 (default) or 0 (mark_step returns when
    # the step has run)
    async_cpu: bool = _choice("PYDISC_ASYNC", "1", ("0", "1")) == "1"


CONFIG = Config()
