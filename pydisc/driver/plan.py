"""Planning a step: functional graph -> partition -> emit -> compile, into one runnable `StepPlan`.

A plan is built once per graph structure and then called with each step's inputs. Every failure here
(tracing, lowering, compiling) leaves the affected ops to eager execution, warns once and is counted,
so a plan always exists.
"""
from __future__ import annotations

import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import cluster, files
from .. import exec as executor
from ..cluster import add_torch_mlir_regions, is_host_scalar, partition_graph, partition_regions
from ..frontend.attention_ops import align_attention_biases
from ..cluster.value_checks import guard_values
from ..config import CONFIG, applies
from ..diagnostics import log, warn_once
from ..exec import target_for
from ..exec.clusters import CompiledCluster, CompiledRegion
from ..exec.compiler import precompile
from ..frontend import decompositions, fast, torch_mlir
from ..frontend.emit import emit_cluster, size_function, unsupported_reason
from ..frontend.fast import FusedStep
from ..frontend.lazy_tensor import RECORDER, StrictModeError
from ..frontend.replay import Program, functional_graph
from ..frontend.torch_mlir import note_rejection, op_key, torch_mlir_reason
from ..frontend.trace import RealRef, ScalarRef, ValueRef
from ..metrics import METRICS
from .engine import ENGINE
from .shape_log import record_cluster

__all__ = ["StepPlan", "build_plan", "plan_graph"]


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
    runs: int = 0                                         # counted for PYDISC_CHECK (pydisc/driver/step_check.py)
    calls: int = 0                                        # steps it ran (the first few run at once: step._deferrable)
    deferred_clusters: Any = None                         # its clusters where it can run on the worker, else False (inflight.py)
    value_check: bool = False                             # its last result: a value eager raises on (cluster/value_checks.py)
    fused_forwards: int = 0                               # forwards in it the fast recorder recorded (FusedStep entries)
    kept_outputs: Any = None                              # [(cluster, its outputs kept)], once worked out (`keep_base_outputs`)
    flat_outputs: dict = field(default_factory=dict)      # while it keeps them: {id(output): (output, the flat tensor it views)}
    copies: Any = None                                    # ... and the worker's copies of them (bind.worker_copies)
    handovers: Any = None                                 # ... and which of them become their inputs' memory (bind.handovers)


def keep_base_outputs(plan: StepPlan, outputs: tuple) -> None:
    """The plan of a concrete step runs, given its outputs: the outputs of its compiled clusters that are
    only new values of the step's inputs (kind "base": parameters, optimizer state, which the binding
    copies into their tensors at once, keeping nothing of them) are written into the same tensors at every
    run (`CompiledCluster.keep_outputs`), for the last plan that had such outputs: the plan before it lets
    go of its tensors, so that plans of other sizes do not each hold a copy of the parameters."""
    if ENGINE.keeping is plan:
        return
    if plan.kept_outputs is None:
        plan.kept_outputs = _base_outputs(plan, outputs)
    if not plan.kept_outputs:
        return          # (a plan of a read, of an evaluation: the training step's plan keeps its tensors)
    if ENGINE.keeping is not None:
        for cluster, _ in ENGINE.keeping.kept_outputs:
            cluster.keep_outputs(())
        ENGINE.keeping.flat_outputs = {}
        ENGINE.keeping.copies = ENGINE.keeping.handovers = None
    for cluster, indices in plan.kept_outputs:
        cluster.keep_outputs(indices)
        for out in cluster.kept or ():
            if out is not None:
                plan.flat_outputs[id(out)] = (out, out._base)
    ENGINE.keeping = plan


def _base_outputs(plan: StepPlan, outputs: tuple) -> list:
    """[(cluster, indices of its outputs that are returned only as "base" outputs of the step)]."""
    runner = plan.runner
    if not isinstance(runner, torch.fx.GraphModule):
        return []
    out_node = next(n for n in reversed(runner.graph.nodes) if n.op == "output")
    returned = out_node.args[0]
    if not isinstance(returned, (tuple, list)) or len(returned) != len(outputs) + plan.value_check:
        return []
    base_only: dict = {}        # returned node -> whether every place it is returned at is a "base" output
    for node, (kind, _) in zip(returned, outputs):
        base_only[node] = base_only.get(node, True) and kind == "base"
    found = []
    for node in runner.graph.nodes:
        sub = getattr(runner, node.target) if node.op == "call_module" else None
        if not isinstance(sub, CompiledCluster) or sub.single or sub.prepare is not None or \
                sub.device.type != "cpu":
            continue
        kept = [user.args[1] for user in node.users
                if user.op == "call_function" and user.target is operator.getitem and base_only.get(user)
                and list(user.users) == [out_node] and type(user.args[1]) is int]
        if kept:
            found.append((sub, kept))
    return found


def _specs(emitted) -> list:
    return [(tuple(s.shape), s.dtype) for s in emitted.outputs]


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
               sources: list[str | None], multiples: dict | None = None) -> StepPlan:
    """Plan in a fresh thread: a read such as `.item()` reaches us from inside `__torch_dispatch__`,
    where the dispatcher's thread-local state (autograd, functionalization excluded) would break
    make_fx. A new thread starts with clean dispatch state and default grad mode. `multiples`: a
    dynamic-shape template's guarded size multiples (emit.emit_cluster)."""
    result: list = []

    def work():
        me = threading.get_ident()
        RECORDER.planning.add(me)
        try:
            result.append(_build(program, inputs, device, sources, multiples))
        except BaseException as exc:   # re-raised in the caller's thread
            result.append(exc)
        finally:
            RECORDER.planning.discard(me)

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
           sources: list[str | None], multiples: dict | None) -> StepPlan:

    started = time.perf_counter()
    step_id = METRICS.graph_cache_misses
    if CONFIG.dump_dir:
        _dump("step%d_recorded.txt" % step_id, _program_text(program, sources))
        target = target_for(device)
        _dump("step%d_flags.txt" % step_id, "target %s, runtime driver %s\n%s\n" % (
            target.name, target.driver, " ".join(target.flags)))
    try:
        gm = functional_graph(program, inputs, decompositions.decompositions_for(device))
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
    return plan_graph(gm, device, sources, step_id, multiples)


def _share_scalars(device: torch.device) -> bool:
    """Whether clusters read the step's lifted scalars behind one barrier (emit.emit_cluster): not on
    CUDA, where each scalar read that way is a buffer copy launched with the module."""
    return device.type != "cuda"


def plan_graph(gm: torch.fx.GraphModule, device: torch.device, sources: list[str | None],
               step_id: int, multiples: dict | None = None) -> StepPlan:
    """Partition, emit and compile a functional graph of core ATen ops into a runnable `StepPlan`.

    `gm` may be traced with symbolic sizes (`node.meta["val"]` FakeTensors with SymInt dims, SymInt
    nodes such as `aten.sym_size.int`): its clusters are then compiled once with dynamic dimensions and
    the plan runs at every size. `sources[i]` is the user source line of program entry i (nodes carry
    `meta["pydisc_entry"]`); `step_id` names the dump files; `multiples`: size symbol -> what it is
    guaranteed a multiple of (emit.emit_cluster)."""

    started = time.perf_counter()
    _dump("step%d_graph.txt" % step_id, gm.code)
    if CONFIG.disable:
        return StepPlan(gm, Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
    value_check = guard_values(gm, flag=applies(CONFIG.value_checks, device))
    attentions = cluster.fuse_attention(gm, device)
    padded = cluster.pad_unaligned_matmuls(gm, device)
    part = partition_graph(gm, device, unsupported_reason, CONFIG.min_cluster_ops)
    if CONFIG.torch_mlir:   # the second route takes what StableHLO cannot (frontend/torch_mlir.py)
        part = add_torch_mlir_regions(part, device, torch_mlir_reason, CONFIG.min_cluster_ops)
    fused = part.graph_module
    if device.type == "cuda":
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
                emitted = emit_cluster(sub, share_scalars=shared, multiples=multiples)
            _dump("step%d_%s.mlir" % (step_id, name), emitted.text)
            compiled = executor.compile_module(emitted.text, device)
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
        setattr(parent, name, CompiledCluster(
            name, compiled, _specs(emitted), emitted.text, device, sub,
            size_function(emitted, device) if emitted.dynamic else None))
        plan.clusters += 1
        METRICS.ops_stablehlo += len(ops)
        summary.append("  %s: %d ops compiled: %s" % (name, len(ops), ", ".join(sorted(set(op_names)))))

    def compile_region(parent: torch.fx.GraphModule, name: str) -> None:
        """A torch-mlir region: compiled, or left to eager (warned once, counted) when torch-mlir's
        importer or IREE rejects it; when the failure names an op, the other ops of the region are
        partitioned again without it (`note_rejection`)."""

        sub = getattr(parent, name)
        ops = [n for n in sub.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
        op_names = sorted({str(n.target) for n in ops})
        t0 = time.perf_counter()
        try:
            region = torch_mlir.import_region(sub)
            _dump("step%d_%s.mlir" % (step_id, name), region.text)
            compiled = executor.compile_module(region.text, device, region.input_type)
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
        setattr(parent, name, CompiledRegion(name, compiled, _specs(region), region.text, device, sub,
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
                emitted_ahead[name] = emit_cluster(getattr(fused, name), share_scalars=share_scalars,
                                                   multiples=multiples)
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
