"""Process-wide counters that make every compile, fallback and sync visible.

All layers report here; `pydisc.metrics()` returns a snapshot and `metrics_report()` formats it.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["METRICS", "Metrics"]


@dataclass
class Metrics:
    compiles: int = 0                 # IREE compiler invocations
    cache_hits: int = 0               # compiled clusters reused instead of compiled
    disk_cache_hits: int = 0          # of those, read from the on-disk cache (docs/cache.md)
    disk_cache_discarded: Counter = field(default_factory=Counter)  # why -> entries removed unread (docs/cache.md)
    executions: int = 0               # runs of compiled clusters
    clusters: int = 0                 # compiled clusters, both routes (distinct graphs)
    clusters_stablehlo: int = 0       # of those, StableHLO clusters
    clusters_torch_mlir: int = 0      # of those, torch-mlir regions (ops with no StableHLO rule)
    ops_stablehlo: int = 0            # ATen ops (graph nodes) in the compiled StableHLO clusters
    ops_torch_mlir: int = 0           # ATen ops in the compiled torch-mlir regions
    torch_mlir_ops: Counter = field(default_factory=Counter)       # ATen op -> nodes compiled by torch-mlir
    torch_mlir_failures: Counter = field(default_factory=Counter)  # region that stayed eager -> count
    executions_torch_mlir: int = 0    # runs of torch-mlir regions (also counted in `executions`)
    mark_steps: int = 0               # pydisc.mark_step() calls
    steps: int = 0                    # mark_step calls that ran something
    graph_cache_hits: int = 0         # steps whose whole plan was reused
    graph_cache_misses: int = 0       # steps that had to be traced, partitioned and emitted
    materializations: int = 0         # values read before mark_step (.item(), print, ...)
    reads_run_eagerly: int = 0        # of those, reads whose few ops torch ran, with no plan of their own
    recorded_ops: int = 0             # ATen ops recorded by the lazy dispatcher
    fast_entries: int = 0             # calls recorded at __torch_function__ (PYDISC_FAST_RECORD)
    fast_segments: int = 0            # ... forwards (with their backward) recorded that way, as one entry each
    fast_reads: int = 0               # ... values of theirs read before mark_step, computed apart by torch
    fast_demotions: Counter = field(default_factory=Counter)   # reason -> segments re-recorded by the dispatcher
    fast_skipped: int = 0             # forwards recorded op by op at once: their module's demoted twice in a row
    random_state_runs: int = 0        # pending steps run because torch's random state was read or set (random_state.py)
    random_order_changes: int = 0     # steps whose random ops drew after other draws made since they were recorded
    optimizer_steps_stamped: int = 0  # optimizer.step() calls recorded from a template, not run (docs/fast_recording.md)
    optimizer_templates: int = 0      # optimizer steps captured as such templates
    compile_seconds: float = 0.0
    plan_seconds: float = 0.0         # functionalize + partition + emit on graph cache misses
    fallback_ops: Counter = field(default_factory=Counter)      # ATen op name -> eager runs
    # matmuls/convs (cuBLAS/cuDNN) and serial scatters run in torch by choice
    library_ops: Counter = field(default_factory=Counter)
    compile_failures: Counter = field(default_factory=Counter)  # reason -> count
    recompiles: list = field(default_factory=list)              # why a seen graph was planned again
    fallback_sources: dict = field(default_factory=dict)        # ATen op -> first user source line
    fallback_dtypes: dict = field(default_factory=dict)         # ATen op -> dtypes seen
    materialization_sources: Counter = field(default_factory=Counter)  # user source line -> reads
    collectives: Counter = field(default_factory=Counter)       # torch.distributed op -> runs (cuts)
    collective_seconds: float = 0.0   # time in those ops (waiting for the other ranks included)
    plans_compiled: int = 0           # step graphs partitioned and compiled (static plans + templates)
    lookup_seconds: float = 0.0       # finding the plan of each step (structural key + dict lookup)
    async_runs: int = 0               # compiled CPU steps run on the worker thread while the next recorded (PYDISC_ASYNC)
    async_waits: Counter = field(default_factory=Counter)       # what waited for such a run -> count
    async_wait_seconds: float = 0.0   # time the main thread spent waiting for them (and for the worker to take each)
    dynamic_templates: int = 0        # steps recorded with symbolic sizes and planned as templates
    dynamic_matches: int = 0          # new step structures served by a template (no compile)
    dynamic_eager_steps: int = 0      # steps run eagerly because an input dim changed size
    steps_before_compile: int = 0     # steps run eagerly because their graph was new (PYDISC_COMPILE_AFTER)
    background_compiles: int = 0      # plans built in a thread while steps ran eagerly (PYDISC_BACKGROUND_COMPILE)
    background_seconds: float = 0.0   # ... their time from start to ready
    steps_while_compiling: int = 0    # mark_steps that ran eagerly while a plan was being built
    numerics_checks: int = 0
    numerics_mismatches: list = field(default_factory=list)
    clusters_eager_faster: int = 0    # compiled clusters that run eagerly because eager was measured faster
    speed_choices: list = field(default_factory=list)           # per measured cluster: times and choice
    step_choice: str = ""        # the whole-step choice (step_choice.py): times per step and the mode kept
    direct_launches: int = 0          # CUDA kernels, copies and fills pydisc queued on torch's stream itself
    direct_launch_fallbacks: Counter = field(default_factory=Counter)  # reason -> modules run by IREE's runtime
    cuda_graph_captures: int = 0      # step plans captured as one CUDA graph (exec/graphs.py)
    cuda_graph_replays: int = 0       # steps run as one replay of such a graph
    cuda_graph_warmups: int = 0       # runs of such a plan before its capture, kernel by kernel
    cuda_graph_fallbacks: Counter = field(default_factory=Counter)  # reason -> plans run kernel by kernel

    def snapshot(self) -> dict:
        out = {}
        for k, v in self.__dict__.items():
            if isinstance(v, (Counter, dict)):
                v = {key: (sorted(map(str, val)) if isinstance(val, set) else val) for key, val in v.items()}
            elif isinstance(v, list):
                v = list(v)
            out[k] = v
        return out

    def note_fallback(self, op: str, count: int, dtypes=(), source: str | None = None) -> None:
        self.fallback_ops[op] += count
        if source and op not in self.fallback_sources:
            self.fallback_sources[op] = source
        if dtypes:
            self.fallback_dtypes.setdefault(op, set()).update(str(d).replace("torch.", "") for d in dtypes)

    def reset(self) -> None:
        fresh = Metrics()
        self.__dict__.update(fresh.__dict__)


METRICS = Metrics()
METRICS_LOCK = threading.Lock()
