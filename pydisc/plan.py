"""Planning a step: functional graph -> partition -> emit -> compile, into one runnable `StepPlan`.

A plan is built once per graph structure and then called with each step's inputs. Every failure here
(tracing, lowering, compiling) leaves the affected ops to eager execution, warns once and is counted,
so a plan always exists.
"""
from __future__ import annotations

import math
import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import files
from .cluster.value_checks import guard_values
from .config import CONFIG, applies
from .diagnostics import log, warn_once
from .exec.compiler import forget_module
from .exec.errors import is_out_of_memory
from .frontend import fast
from .frontend.fast import FusedStep
from .frontend.lazy_tensor import StrictModeError
from .frontend.replay import Program, functional_graph
from .metrics import METRICS
from .shape_log import record_cluster
from .step_check import mismatch

__all__ = ["StepPlan", "CompiledCluster", "CompiledRegion", "build_plan", "plan_graph"]


@dataclass
class StepPlan:
    runner: Callable[..., list[torch.Tensor]]
    eager_ops: Counter = field(default_factory=Counter)   # ATen op -> eager runs per execution
    eager_sources: dict = field(default_factory=dict)     # ATen op -> user source line
    eager_dtypes: dict = field(default_factory=dict)      # ATen op -> dtypes
    clusters: int = 0                                     # compiled StableHLO clusters
    regions: int = 0                                      # compiled torch-mlir regions
    library_ops: Counter = field(default_factory=Counter)  # ATen op -> runs in torch's libraries by choice
    graph: Any = None                                     # its CUDA graph, once run (exec/graphs.StepGraph)
    runs: int = 0                                         # counted for PYDISC_CHECK (pydisc/step_check.py)
    value_check: bool = False                             # its last result: a value eager raises on (cluster/value_checks.py)
    fused_forwards: int = 0                               # forwards in it the fast recorder recorded (FusedStep entries)


class CompiledCluster(torch.nn.Module):
    """Stands in for a cluster submodule: allocates its outputs with torch, IREE fills them.

    A cluster with dynamic dims sizes its outputs from its inputs at each call, through a Python
    function generated once from the size expressions (`_size_function`); SymInt inputs are not passed
    to IREE and SymInt outputs are computed there too.
    With PYDISC_CHECK=N, every Nth call also runs the cluster's ops eagerly and compares."""

    route = "stablehlo"

    def __init__(self, name: str, compiled, emitted, device: torch.device, fallback: torch.fx.GraphModule):
        super().__init__()
        self.name = name
        self.compiled = compiled
        self.specs = [(tuple(s.shape), s.dtype) for s in emitted.outputs]
        self.device = device
        self.fallback = fallback
        out_node = next(n for n in fallback.graph.nodes if n.op == "output")
        self.single = not isinstance(out_node.args[0], (tuple, list))
        self.output_ops = [str(getattr(a, "target", a)) for a in
                           (out_node.args[0] if not self.single else [out_node.args[0]])]
        self.prepare = _size_function(emitted, device) if emitted.dynamic else None
        self.calls = 0
        self.eager_faster = False     # measured on its second call (`measure`): eager ran it faster
        from .exec.compiler import text_hash
        self.digest = text_hash(emitted.text)   # names the measured choice kept on disk (exec/choices.py)
        self.decided = False          # compiled or eager chosen, measured here or by an earlier process

    def forward(self, *inputs):
        if self.eager_faster:
            return self.fallback(*inputs)
        measuring = not self.decided and applies(CONFIG.measure, self.device)
        if measuring and self.calls == 0 and self.recall(inputs):
            return self.fallback(*inputs)    # eager measured faster by an earlier process
        results = self.run_compiled(inputs)
        self.calls += 1
        if measuring and self.calls == 2 and not (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            chosen = self.measure(inputs)    # (not while a CUDA graph is captured: it synchronises)
            if chosen is not None:
                return chosen
        if CONFIG.check_every and self.calls % CONFIG.check_every == 0:
            self.check(inputs, results)
        return results[0] if self.single else tuple(results)

    def run_compiled(self, inputs) -> list:
        try:
            if self.prepare is None:
                device = self.device
                outs = results = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.specs]
                self.compiled.run(inputs, outs)
            else:
                arguments, outs, results = self.prepare(inputs)
                self.compiled.run(arguments, outs)
        except Exception as exc:
            if isinstance(exc, RuntimeError) and is_out_of_memory(exc):
                raise self.out_of_memory(exc) from exc
            forget_module(self.compiled)   # neither this process nor the next loads these bytes again
            raise
        return results

    def measure(self, inputs):
        """Time this cluster compiled and its ops run eagerly, on the same inputs (twice each, taking
        turns, the best of each; the first call, which loads the kernels, is not timed), and keep eager
        from now on when it is faster by more than 10%: kernel quality and per-call costs vary, and a
        region goes to IREE only where it pays. Returns eager's outputs when eager is kept, else None.
        The decision is reported in `metrics()["speed_choices"]` and kept in the disk cache
        (exec/choices.py), where `recall` finds it in a later process."""
        from .exec import choices

        self.decided = True
        key = choices.choice_key(self.digest, self.device, inputs)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)

        def timed(run):
            sync(self.device)
            started = time.perf_counter()
            out = run()
            sync(self.device)
            return time.perf_counter() - started, out

        what = self._what()
        compiled, eager = [], []
        try:
            for _ in range(2):
                compiled.append(timed(lambda: self.run_compiled(inputs))[0])
                seconds, expected = timed(lambda: self.fallback(*inputs))
                eager.append(seconds)
        except Exception as exc:   # eager needs more memory, say: keep the compiled cluster
            METRICS.speed_choices.append("%s: not measured (%s)" % (what, type(exc).__name__))
            return None
        c, e = min(compiled), min(eager)
        keep_eager = e < 0.9 * c
        METRICS.speed_choices.append("%s: IREE %.0f us, eager %.0f us -> %s" % (
            what, 1e6 * c, 1e6 * e, "eager" if keep_eager else "IREE"))
        choices.store(key, {"choice": "eager" if keep_eager else "IREE", "iree_us": round(1e6 * c, 1),
                            "eager_us": round(1e6 * e, 1)})
        if not keep_eager:
            return None
        log("compiles", "cluster %s runs eagerly from now on: %.0f us eager, %.0f us compiled", self.name,
            1e6 * e, 1e6 * c)
        METRICS.clusters_eager_faster += 1
        self.eager_faster = True
        return expected

    def recall(self, inputs) -> bool:
        """On the first call: take the choice an earlier process measured for this cluster text at these
        sizes on this kind of device (exec/choices.py), if any; True when that choice is eager."""
        from .exec import choices

        known = choices.lookup(choices.choice_key(self.digest, self.device, inputs))
        if known is None:
            return False
        self.decided = True
        keep_eager = known.get("choice") == "eager"
        METRICS.speed_choices.append("%s: IREE %.0f us, eager %.0f us -> %s (measured before)" % (
            self._what(), known.get("iree_us", 0), known.get("eager_us", 0), "eager" if keep_eager else "IREE"))
        if keep_eager:
            METRICS.clusters_eager_faster += 1
            self.eager_faster = True
        return keep_eager

    def _what(self) -> str:
        ops = [n for n in self.fallback.graph.nodes if n.op == "call_function"]
        names = sorted({str(n.target).replace("aten.", "").replace(".default", "") for n in ops})
        return "%s (%d ops: %s%s)" % (self.name, len(ops), ", ".join(names[:4]), ", ..." if len(names) > 4 else "")

    def out_of_memory(self, exc: RuntimeError) -> RuntimeError:
        """`exc`, a failed allocation of this cluster's outputs or inside IREE, with the cluster named."""
        from .exec.errors import DeviceOutOfMemoryError
        ops = sorted({str(n.target) for n in self.fallback.graph.nodes if n.op == "call_function"})
        where = "compiled cluster %s (%d ops: %s%s)" % (self.name, len(ops), ", ".join(ops[:5]),
                                                        ", ..." if len(ops) > 5 else "")
        if isinstance(exc, DeviceOutOfMemoryError):      # raised inside IREE's call
            return DeviceOutOfMemoryError(str(exc), where=where + " inside IREE's call")
        nbytes = None
        if self.prepare is None:
            nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.specs)
        outputs = "its output" if len(self.specs) == 1 else "its %d outputs" % len(self.specs)
        return DeviceOutOfMemoryError(str(exc), where=where + ", allocating " + outputs, nbytes=nbytes)

    def check(self, inputs, results) -> None:
        """Compare with the same ops run eagerly; report the first output that diverges."""
        METRICS.numerics_checks += 1
        expected = self.fallback(*inputs)
        expected = [expected] if self.single else list(expected)
        for i, (got, want) in enumerate(zip(results, expected)):
            why = mismatch(got, want)       # (a size computed on the host compares as an int)
            if why is not None:
                message = "cluster %s output %d (from %s) diverges from eager: %s" % (
                    self.name, i, self.output_ops[i], why)
                METRICS.numerics_mismatches.append(message)
                warn_once("check:" + self.name + str(i), "pydisc numerics check: " + message)
                return


class CompiledRegion(CompiledCluster):
    """A region of the torch-mlir route (`frontend/torch_mlir.py`): the same calling convention, static
    shapes; its runs are counted apart (`executions_torch_mlir`), so a caller can tell the routes.

    torch-mlir's lowerings are not pydisc's own: some compute wrong values (`_WRONG_VALUES` there lists
    those found), and IREE 3.13 writes the result of a torch-mlir scatter into the scatter's input
    buffer. So the first call keeps a copy of the inputs, checks that none was written (restoring it if
    one was) and runs the region eagerly to compare: a region that fails either check is demoted for
    good (`demote` moves its ops to the plan's eager ledger), warned and counted, and eager's values
    are used."""

    route = "torch-mlir"

    def __init__(self, name: str, compiled, emitted, device: torch.device, fallback: torch.fx.GraphModule,
                 demote: Callable[[], None]):
        super().__init__(name, compiled, emitted, device, fallback)
        self.demote = demote
        self.verified = False
        self.demoted = False

    def forward(self, *inputs):
        if self.demoted:
            return self.fallback(*inputs)
        METRICS.executions_torch_mlir += 1
        if self.verified:
            return super().forward(*inputs)
        self.verified = True
        snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        results = super().forward(*inputs)
        written = [i for i, (t, s) in enumerate(zip(inputs, snapshot)) if isinstance(t, torch.Tensor)
                   and not _same_values(t, s)]
        for i in written:
            inputs[i].copy_(snapshot[i])
        expected = self.fallback(*inputs)
        if written:
            mismatch = "it wrote into its input%s %s" % ("s" if len(written) > 1 else "", written)
        else:
            mismatch = _first_mismatch([results] if self.single else list(results),
                                       [expected] if self.single else list(expected))
        if mismatch is not None:
            ops = sorted({str(n.target) for n in self.fallback.graph.nodes if n.op == "call_function"})
            warn_once("region-wrong:" + ",".join(ops)[:120],
                      "pydisc: torch-mlir region %s (%s) differs from eager on its first call (%s); it "
                      "runs eagerly from now on" % (self.name, ", ".join(ops[:6]), mismatch))
            METRICS.torch_mlir_failures["%s (%s)" % (", ".join(ops[:3]), "wrote its inputs" if written
                                                     else "wrong values")] += 1
            self.demoted = True
            self.demote()
            return expected
        return results


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, NaN equal to NaN."""
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _first_mismatch(results: list, expected: list) -> str | None:
    for i, (got, want) in enumerate(zip(results, expected)):
        why = mismatch(got, want)
        if why is not None:
            return "output %d: %s" % (i, why)
    return None


def _size_function(emitted, device: torch.device) -> Callable:
    """`prepare(inputs) -> (arguments, outputs, results)` for a cluster with dynamic dims, generated as
    Python source once: it reads each needed size symbol from an input's dim, allocates the outputs at
    this call's sizes and lists the cluster's results (tensors, and SymInt outputs as ints). Sympy is
    not involved per call; the cost is a few dim reads and one `torch.empty` per output."""
    from .frontend.lowering.symbolic import python_expression

    bindings = emitted.bindings
    reads: list[str] = []
    names: dict = {}

    def leaf(symbol) -> str:
        if symbol not in names:
            position, dim = bindings.leaves[symbol]
            names[symbol] = "n%d" % len(names)
            if dim is None:     # a size passed as an int (an `index` argument)
                reads.append("    %s = inputs[%d]" % (names[symbol], position))
            else:
                reads.append("    %s = inputs[%d].size(%d)" % (names[symbol], position, dim))
        return names[symbol]

    def size(expr) -> str:
        return python_expression(bindings.resolve(expr), leaf)

    allocations = []
    for k, spec in enumerate(emitted.outputs):
        dims = ", ".join(size(d) for d in spec.shape) + ("," if spec.rank == 1 else "")
        allocations.append("    o%d = empty((%s), dtype=dtype%d, device=device)" % (k, dims, k))
    layout = emitted.layout or tuple(("result", k) for k in range(len(emitted.outputs)))
    results = ["o%d" % value if kind == "result" else size(value) for kind, value in layout]
    arguments = "".join("inputs[%d], " % p for p in emitted.arguments)
    source = "\n".join([
        "def prepare(inputs):",
        *reads,
        *allocations,
        "    return (%s), [%s], (%s)" % (arguments, ", ".join("o%d" % k for k in range(len(emitted.outputs))),
                                       "".join(r + ", " for r in results)),
    ])
    scope = {"empty": torch.empty, "device": device, "max": max, "min": min}
    scope.update({"dtype%d" % k: spec.dtype for k, spec in enumerate(emitted.outputs)})
    exec(compile(source, "<pydisc cluster sizes>", "exec"), scope)
    prepare = scope["prepare"]
    prepare.source = source
    return prepare


# A fused kernel with more buffer bindings than the runtime takes per launch, refused when the module
# loads: IREE's CUDA driver allows 16 ("exceeds maximum"), its CPU runtime 32 ("binding count 47 > 32").
_TOO_BIG = ("exceeds maximum", "binding count")


def _dump(name: str, text: str, failure: bool = False) -> str | None:
    """Write a dump (PYDISC_DUMP_DIR; a failure's also without it) through pydisc/files.py: private
    folders, no symbolic links followed. None where nothing was written."""
    try:
        folder = files.dump_folder(failure)
        return files.write_file(folder, name, text) if folder is not None else None
    except OSError as exc:
        warn_once("dump:" + type(exc).__name__, "pydisc: dumps are not written (%s)" % exc)
        return None


def build_plan(program: Program, inputs: list[torch.Tensor], device: torch.device,
               sources: list[str | None]) -> StepPlan:
    """Plan in a fresh thread: a read such as `.item()` reaches us from inside `__torch_dispatch__`,
    where the dispatcher's thread-local state (autograd, functionalization excluded) would break
    make_fx. A new thread starts with clean dispatch state and default grad mode."""
    result: list = []

    def work():
        try:
            result.append(_build(program, inputs, device, sources))
        except BaseException as exc:   # re-raised in the caller's thread
            result.append(exc)

    worker = threading.Thread(target=work, name="pydisc-plan")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    plan = result[0]
    plan.fused_forwards = sum(isinstance(e[0], FusedStep) for e in program.entries)
    log("plans", "the step was recorded %s", "by the fast recorder (%d forwards)" % plan.fused_forwards
        if plan.fused_forwards else "op by op (the dispatcher)")
    return plan


def _eager_plan(program: Program, sources: list[str | None]) -> StepPlan:
    ops = Counter(str(e[0]) for e in program.entries)
    first = {}
    for e, src in zip(program.entries, sources):
        first.setdefault(str(e[0]), src)
    return StepPlan(program, ops, first)


def _build(program: Program, inputs: list[torch.Tensor], device: torch.device,
           sources: list[str | None]) -> StepPlan:
    from .frontend.decompositions import decompositions_for

    started = time.perf_counter()
    step_id = METRICS.graph_cache_misses
    if CONFIG.dump_dir:
        _dump("step%d_recorded.txt" % step_id, _program_text(program, sources))
        from .exec import target_for
        target = target_for(device)
        _dump("step%d_flags.txt" % step_id, "target %s, runtime driver %s\n%s\n" % (
            target.name, target.driver, " ".join(target.flags)))
    try:
        gm = functional_graph(program, inputs, decompositions_for(device))
    except Exception as exc:  # an op that torch's functionalization or fake tensors cannot trace
        entry = getattr(exc, "pydisc_entry", None)
        where = ""
        if entry is not None and entry < len(program.entries):
            source = sources[entry] if entry < len(sources) else None
            where = " at %s%s" % (program.entries[entry][0], ", recorded at " + source if source else "")
        warn_once("trace:" + type(exc).__name__ + str(exc)[:80],
                  "pydisc: could not build a functional graph for this step (%s: %s)%s; the step runs "
                  "eagerly, as it would without pydisc. Please report this with the op named." % (
                      type(exc).__name__, exc, where))
        if entry is not None and entry < len(program.entries) and isinstance(program.entries[entry][0], FusedStep):
            # a forward recorded by the fast recorder that torch.func cannot differentiate: the next
            # steps are recorded op by op, which plans (and compiles) the same step
            fast.refuse("planning failed: %s" % type(exc).__name__)
        return _eager_plan(program, sources)
    METRICS.plan_seconds += time.perf_counter() - started
    return plan_graph(gm, device, sources, step_id)


def _share_scalars(device: torch.device) -> bool:
    """Whether clusters read the step's lifted scalars behind one barrier (emit.emit_cluster): not on
    CUDA, where each scalar read that way is a buffer copy launched with the module."""
    return device.type != "cuda"


def plan_graph(gm: torch.fx.GraphModule, device: torch.device, sources: list[str | None],
               step_id: int) -> StepPlan:
    """Partition, emit and compile a functional graph of core ATen ops into a runnable `StepPlan`.

    `gm` may be traced with symbolic sizes (`node.meta["val"]` FakeTensors with SymInt dims, SymInt
    nodes such as `aten.sym_size.int`): its clusters are then compiled once with dynamic dimensions and
    the plan runs at every size. `sources[i]` is the user source line of program entry i (nodes carry
    `meta["pydisc_entry"]`); `step_id` names the dump files."""
    from .cluster import (add_torch_mlir_regions, fuse_attention, is_host_scalar, pad_unaligned_matmuls,
                          partition_graph, partition_regions)
    from .exec import compile_module
    from .exec.compiler import precompile
    from .frontend.emit import emit_cluster, unsupported_reason

    started = time.perf_counter()
    _dump("step%d_graph.txt" % step_id, gm.code)
    if CONFIG.disable:
        return StepPlan(gm, Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    value_check = guard_values(gm, flag=applies(CONFIG.value_checks, device))
    attentions = fuse_attention(gm, device)
    padded = pad_unaligned_matmuls(gm, device)
    part = partition_graph(gm, device, unsupported_reason, CONFIG.min_cluster_ops)
    if CONFIG.torch_mlir:   # the second route takes what StableHLO cannot (frontend/torch_mlir.py)
        from .frontend.torch_mlir import torch_mlir_reason
        part = add_torch_mlir_regions(part, device, torch_mlir_reason, CONFIG.min_cluster_ops)
    fused = part.graph_module
    if device.type == "cuda":
        from .cluster.attention_ops import align_attention_biases
        align_attention_biases(fused)
    plan = StepPlan(fused, value_check=value_check)

    def note_eager(node: torch.fx.Node) -> None:
        if is_host_scalar(node) or node.meta.get("pydisc_view"):  # sizes; views torch keeps: not fallbacks
            return
        if node.meta.get("pydisc_library"):   # a matmul left to cuBLAS on purpose
            plan.library_ops[str(node.target)] += 1
            return
        op = str(node.target)
        if getattr(node.target, "is_view", False) and op not in part.reasons:
            # a view the emitter could compile, left out of every cluster because it only feeds torch
            # (the input of a cuDNN convolution, say): metadata, not a fallback
            return
        plan.eager_ops[op] += 1
        entry = node.meta.get("pydisc_entry")
        if entry is not None and entry < len(sources) and sources[entry]:
            plan.eager_sources.setdefault(op, sources[entry])
        val = node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if isinstance(v, torch.Tensor):
                plan.eager_dtypes.setdefault(op, set()).add(str(v.dtype).replace("torch.", ""))

    def note_eager_ops(partition) -> None:
        """Count the nodes a partition left to eager execution."""
        for node in partition.graph_module.graph.nodes:
            if node.op == "call_function" and str(node.target) in partition.eager_ops:
                note_eager(node)

    note_eager_ops(part)
    if CONFIG.strict and plan.eager_ops:
        op = next(iter(plan.eager_ops))
        raise StrictModeError("pydisc strict mode: %s cannot be compiled (%s) and would run eagerly, at %s"
                              % (op, part.reasons.get(op, "not supported"), plan.eager_sources.get(op)))
    METRICS.plan_seconds += time.perf_counter() - started
    summary = ["step %d: %d clusters, %d torch-mlir regions, %d eager ops" % (
        step_id, len(part.clusters), len(part.regions), len(part.eager_ops))]
    if attentions:
        summary.append("  %d written-out attentions run as fused attention kernels (cluster/attention.py)"
                       % attentions)
    if padded:
        summary.append("  padded %d matmuls with unaligned sizes (cluster/pad_matmul.py)" % padded)
    for reason_op, reason in sorted(part.reasons.items()):
        summary.append("  not compiled: %s (%s)" % (reason_op, reason))
    compile_started = time.perf_counter()
    share_scalars = _share_scalars(device)

    def compile_into(parent: torch.fx.GraphModule, name: str, k: int, total: int,
                     shared: bool | None = None) -> None:
        shared = share_scalars if shared is None else shared
        sub = getattr(parent, name)
        ops = [n for n in sub.graph.nodes if n.op == "call_function"]
        op_names = [str(n.target) for n in ops]
        if CONFIG.progress and name not in emitted_ahead and time.perf_counter() - compile_started > 2.0:
            print("pydisc: compiling cluster %d/%d (%d ops)..." % (k + 1, total, len(ops)), flush=True)
        t0 = time.perf_counter()
        try:
            emitted = emitted_ahead.pop(name, None) if parent is fused and shared == share_scalars else None
            if emitted is None:
                emitted = emit_cluster(sub, share_scalars=shared)
            _dump("step%d_%s.mlir" % (step_id, name), emitted.text)
            compiled = compile_module(emitted.text, device)
        except Exception as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            too_big = any(marker in str(exc) for marker in _TOO_BIG)
            if too_big and shared:
                # scalars read behind a shared barrier are one buffer each to the kernels that use
                # them: read in each kernel instead, that cluster may fit
                log("compiles", "cluster %s too large for the target (%s); scalars read per kernel", name,
                    first_line)
                compile_into(parent, name, k, total, shared=False)
                return
            if too_big and len(ops) > 1:
                # a fused kernel of this cluster needs more buffers than the runtime allows per
                # launch: compile the cluster as two halves instead
                log("compiles", "cluster %s (%d ops) too large for the target (%s); splitting", name,
                    len(ops), first_line)
                halves = partition_graph(sub, device, unsupported_reason, 1, max_ops=(len(ops) + 1) // 2)
                for j, inner in enumerate(halves.clusters):
                    compile_into(halves.graph_module, inner, j, len(halves.clusters), shared=shared)
                note_eager_ops(halves)
                setattr(parent, name, halves.graph_module)
                summary.append("  %s: %d ops, split in %d after: %s" % (name, len(ops), len(halves.clusters),
                                                                      first_line))
                return
            path = _dump("step%d_%s.failed.txt" % (step_id, name), "%s\n\n%s" % (exc, sub.code), failure=True)
            warn_once("cluster:" + type(exc).__name__ + first_line[:120],
                      "pydisc: a cluster of %d ops (%s) could not be compiled and runs eagerly (%s: %s); "
                      "IR dump: %s" % (len(ops), ", ".join(sorted(set(op_names))[:6]), type(exc).__name__,
                                       first_line, path))
            METRICS.compile_failures[type(exc).__name__] += 1
            for n in ops:
                note_eager(n)
            summary.append("  %s: %d ops, EAGER after failure: %s" % (name, len(ops), first_line))
            return
        log("compiles", "cluster %s: %d ops, %d inputs, %d outputs, %.2f s", name, len(ops),
            len(emitted.inputs), len(emitted.outputs), time.perf_counter() - t0)
        record_cluster(emitted.text, device)
        setattr(parent, name, CompiledCluster(name, compiled, emitted, device, sub))
        plan.clusters += 1
        METRICS.ops_stablehlo += len(ops)
        summary.append("  %s: %d ops compiled: %s" % (name, len(ops), ", ".join(sorted(set(op_names)))))

    def compile_region(parent: torch.fx.GraphModule, name: str) -> None:
        """A torch-mlir region: compiled, or left to eager (warned once, counted) when torch-mlir's
        importer or IREE rejects it; when the failure names an op, the other ops of the region are
        partitioned again without it (`note_rejection`)."""
        from .frontend.torch_mlir import import_region, note_rejection, op_key, torch_mlir_reason

        sub = getattr(parent, name)
        ops = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        op_names = sorted({str(n.target) for n in ops})
        t0 = time.perf_counter()
        try:
            region = import_region(sub)
            _dump("step%d_%s.mlir" % (step_id, name), region.text)
            compiled = compile_module(region.text, device, region.input_type)
        except Exception as exc:
            detail = getattr(exc, "diagnostics", None) or str(exc)   # IREE's own message first
            first_line = detail.strip().splitlines()[0][:300] if detail.strip() else ""
            path = _dump("step%d_%s.failed.txt" % (step_id, name), "%s\n\n%s" % (exc, sub.code), failure=True)
            rejected = note_rejection(exc)
            warn_once("region:" + (rejected or ",".join(op_names)[:120]),
                      "pydisc: a region of %d ops (%s) has no StableHLO rule and torch-mlir could not compile "
                      "it either; %s runs eagerly (%s: %s); IR dump: %s" % (
                          len(ops), ", ".join(op_names[:6]), rejected or "it", type(exc).__name__, first_line, path))
            METRICS.torch_mlir_failures["%s (%s)" % (rejected or ", ".join(op_names[:3]), type(exc).__name__)] += 1
            named = [n for n in ops if op_key(n.target) == rejected]
            if named and len(named) < len(ops):
                inner = partition_regions(sub, device, torch_mlir_reason, CONFIG.min_cluster_ops)
                note_eager_ops(inner)
                setattr(parent, name, inner.graph_module)
                summary.append("  %s: %d ops, partitioned again without %s after: %s" % (
                    name, len(ops), rejected, first_line))
                for inner_name in inner.regions:
                    compile_region(inner.graph_module, inner_name)
                return
            for n in ops:
                note_eager(n)
            summary.append("  %s: %d ops, EAGER after torch-mlir failure: %s" % (name, len(ops), first_line))
            return
        log("compiles", "torch-mlir region %s: %d ops, %d inputs, %d outputs, %.2f s", name, len(ops),
            len(region.inputs), len(region.outputs), time.perf_counter() - t0)
        record_cluster(region.text, device, region.input_type)
        setattr(parent, name, CompiledRegion(name, compiled, region, device, sub,
                                            demote=lambda: [note_eager(n) for n in ops]))
        plan.regions += 1
        METRICS.ops_torch_mlir += len(ops)
        METRICS.torch_mlir_ops.update(str(n.target) for n in ops)
        summary.append("  %s: %d ops compiled through torch-mlir: %s" % (name, len(ops), ", ".join(op_names)))

    # emit every cluster first and compile the distinct texts in parallel (CONFIG.compile_jobs
    # iree-compile processes); compile_into then finds them compiled. A cluster that fails to emit is
    # left to compile_into, which handles the failure.
    emitted_ahead: dict[str, Any] = {}
    if len(part.clusters) > 1 and CONFIG.compile_jobs > 1:
        for name in part.clusters:
            try:
                emitted_ahead[name] = emit_cluster(getattr(fused, name), share_scalars=share_scalars)
            except Exception:  # noqa: BLE001 - reported by compile_into
                pass

        def announce(n: int, jobs: int) -> None:
            if CONFIG.progress:
                print("pydisc: compiling %d clusters (%d new texts), %d at a time..." % (
                    len(part.clusters), n, jobs), flush=True)

        precompile([e.text for e in emitted_ahead.values()], device, announce=announce)
    for k, name in enumerate(part.clusters):
        compile_into(fused, name, k, len(part.clusters))
    for name in part.regions:
        compile_region(fused, name)
    METRICS.clusters += plan.clusters + plan.regions
    METRICS.clusters_stablehlo += plan.clusters
    METRICS.clusters_torch_mlir += plan.regions
    for op, count in plan.eager_ops.most_common():
        summary.append("  eager: %s x%d%s" % (op, count, (" at " + plan.eager_sources[op])
                                              if op in plan.eager_sources else ""))
    _dump("step%d_partition.txt" % step_id, "\n".join(summary) + "\n\n" + fused.code)
    if CONFIG.dump_dir:
        _dump("step%d_partition.dot" % step_id, _to_dot(fused))
    log("plans", "planned step %d: %d clusters, %d torch-mlir regions, %d eager ops, %.2f s", step_id,
        plan.clusters, plan.regions, sum(plan.eager_ops.values()), time.perf_counter() - started)
    return plan


def _program_text(program: Program, sources: list[str | None]) -> str:
    """The recorded step as the user's ops, one per line: `v12 = aten.mm.default(v3, v7)  # file:line`."""
    from .frontend.trace import RealRef, ScalarRef, ValueRef

    def show(a) -> str:
        if isinstance(a, ValueRef):
            return "v%d" % a.vid
        if isinstance(a, RealRef):
            return "eager%d" % a.index
        if isinstance(a, ScalarRef):
            return "scalar%d" % a.index
        if isinstance(a, list):
            return "[" + ", ".join(map(show, a)) + "]"
        return repr(a)

    lines = ["# inputs: %d storages, %d eager tensors, %d lifted scalars" % (
        program.n_storages, program.n_reals, program.n_scalars)]
    for vid, index, layout in program.inputs:
        lines.append("v%d = input%d%s" % (vid, index, "" if layout is None else " viewed as %s" % (layout,)))
    for i, (fn, args, kwargs, out_vids, _) in enumerate(program.entries):
        outs = ", ".join("v%d" % v if v is not None else "_" for v in out_vids) or "_"
        call = ", ".join([show(a) for a in args] + ["%s=%s" % (k, show(v)) for k, v in kwargs.items()])
        source = sources[i] if i < len(sources) and sources[i] else ""
        lines.append("%s = %s(%s)%s" % (outs, fn, call, "  # " + source if source else ""))
    lines.append("return " + ", ".join("%s%d" % kv for kv in program.outputs))
    return "\n".join(lines) + "\n"


def _to_dot(gm: torch.fx.GraphModule) -> str:
    """The partitioned step graph for Graphviz: compiled clusters green, eager ops orange."""
    lines = ["digraph step {", "  node [shape=box, style=filled, fontname=monospace];"]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            color, label = "lightgrey", node.name
        elif node.op == "output":
            color, label = "lightgrey", "output"
        elif node.op == "call_module":
            sub = getattr(gm, node.target)
            inner = getattr(sub, "fallback", sub)
            n_ops = sum(1 for n in inner.graph.nodes if n.op == "call_function")
            compiled = isinstance(sub, CompiledCluster)
            color = "palegreen" if compiled else "orange"
            label = "%s\\n%d ops %s" % (node.target, n_ops, ("compiled (%s)" % sub.route) if compiled
                                           else "EAGER (failed)")
        elif node.target is operator.getitem:
            continue
        else:
            color, label = "orange", str(node.target).replace("aten.", "")
        lines.append('  "%s" [label="%s", fillcolor=%s];' % (node.name, label, color))
    for node in gm.graph.nodes:
        src = node
        for user in node.users:
            dst = user
            while dst.op == "call_function" and dst.target is operator.getitem and dst.users:
                dst = next(iter(dst.users))
            if src.op == "call_function" and src.target is operator.getitem:
                continue
            lines.append('  "%s" -> "%s";' % (src.name, dst.name))
    lines.append("}")
    return "\n".join(lines) + "\n"
