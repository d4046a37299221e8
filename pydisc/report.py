"""`metrics_report()`: the counters as a short text a user can read (docs/metrics.md explains it)."""
from __future__ import annotations

from .metrics import METRICS

__all__ = ["metrics_report"]


def metrics_report(top: int = 10) -> str:
    m = METRICS
    lines = [
        "pydisc metrics",
        "  steps run            %d (plans reused %d, planned %d)" % (m.steps, m.graph_cache_hits,
                                                                   m.graph_cache_misses),
        "  recorded ops         %d" % m.recorded_ops + (
            " (+ %d calls in %d forwards recorded at __torch_function__)" % (m.fast_entries, m.fast_segments)
            if m.fast_entries else "") + (
            "; %d optimizer steps recorded from %d templates" % (m.optimizer_steps_stamped, m.optimizer_templates)
            if m.optimizer_steps_stamped else ""),
        "  compiled clusters    %d (StableHLO %d with %d ops, torch-mlir %d with %d ops)" % (
            m.clusters, m.clusters_stablehlo, m.ops_stablehlo, m.clusters_torch_mlir, m.ops_torch_mlir),
        "  IREE compiles        %d (%.2f s), cache hits %d (%d from disk)" % (
            m.compiles, m.compile_seconds, m.cache_hits, getattr(m, "disk_cache_hits", 0)),
        "  cluster executions   %d" % m.executions,
        "  materializations     %d (values read before mark_step%s)" % (
            m.materializations, "; %d needed a few ops, run by torch" % m.reads_run_eagerly
            if m.reads_run_eagerly else ""),
        "  planning time        %.2f s" % m.plan_seconds,
    ]
    if m.random_state_runs:
        lines.append("  random state runs    %d (pending steps run early: torch's random generator state read or "
                     "set while random draws were pending, as gradient checkpointing with dropout does)"
                     % m.random_state_runs)
    skipped = "%d forwards recorded op by op at once (their module's were demoted twice in a row)" % m.fast_skipped
    if m.fast_demotions:
        lines.append("  fast path demoted    %s (re-recorded op by op)%s" % (", ".join(
            "%s x%d" % kv for kv in m.fast_demotions.most_common(top)), "; then " + skipped if m.fast_skipped else ""))
    elif m.fast_skipped:
        lines.append("  fast path skipped    " + skipped)
    for source, count in m.materialization_sources.most_common(3):
        lines.append("    read x%d at %s" % (count, source))
    total = sum(m.fallback_ops.values())
    lines.append("  eager (fallback) ops %d" % total)
    for op, count in m.fallback_ops.most_common(top):
        dtypes = ",".join(sorted(m.fallback_dtypes.get(op, ())))
        source = m.fallback_sources.get(op)
        lines.append("    %-40s %6d  %s%s" % (op, count, dtypes, ("  first at " + source) if source else ""))
    if m.torch_mlir_ops:
        lines.append("  through torch-mlir   %s" % ", ".join("%s x%d" % kv for kv in m.torch_mlir_ops.most_common(top)))
    if m.torch_mlir_failures:
        lines.append("  torch-mlir rejected  %s (those ops ran eagerly)" % ", ".join(
            "%s x%d" % kv for kv in m.torch_mlir_failures.most_common(top)))
    if m.collectives:
        total = sum(m.collectives.values())
        per_step = " (%.1f per mark_step)" % (total / m.mark_steps) if m.mark_steps else ""
        lines.append("  collectives (cuts)   %d%s, %.2f s in them" % (total, per_step, m.collective_seconds))
        for op, count in m.collectives.most_common(top):
            lines.append("    %-40s %6d" % (op, count))
    if m.library_ops:
        lines.append("  in torch by choice   %d (%s): matmuls, convolutions and fused attention "
                     "(PYDISC_GPU_MATMUL=iree, on the CPU PYDISC_CPU_MATMUL=iree, compiles them too), softmax, "
                     "scatters, max pooling and concatenations, slow in IREE's code" % (
            sum(m.library_ops.values()), ", ".join("%s x%d" % kv for kv in m.library_ops.most_common(4))))
    if m.async_runs:
        lines.append("  run on the worker    %d steps while the next recorded; waited %.2f s for them, at %s" % (
            m.async_runs, m.async_wait_seconds, ", ".join("%s x%d" % kv for kv in m.async_waits.most_common(4))))
    if m.background_compiles:
        lines.append("  built in background  %d plans, %.1f s; %d steps ran eagerly meanwhile" % (
            m.background_compiles, m.background_seconds, m.steps_while_compiling))
    if m.step_choice:
        lines.append("  whole steps          %s" % m.step_choice)
    if m.speed_choices:
        lines.append("  measured clusters    %d, %d kept eager because eager was faster" % (
            len(m.speed_choices), m.clusters_eager_faster))
        for choice in m.speed_choices[:3]:
            lines.append("    " + choice)
    if m.dynamic_templates or m.dynamic_eager_steps:
        lines.append("  dynamic shapes       %d templates, %d step structures matched to one, %d steps run "
                     "eagerly while switching" % (m.dynamic_templates, m.dynamic_matches, m.dynamic_eager_steps))
    lines.append("  step graphs compiled %d; plan lookup %.1f us/step%s" % (
        m.plans_compiled, 1e6 * m.lookup_seconds / max(1, m.steps),
        "; %d steps ran eagerly as new graphs (PYDISC_COMPILE_AFTER)" % m.steps_before_compile
        if m.steps_before_compile else ""))
    if m.recompiles:
        lines.append("  recompiles           %d" % len(m.recompiles))
        for reason in m.recompiles[-3:]:
            lines.append("    " + reason)
    if m.direct_launches or m.direct_launch_fallbacks:
        lines.append("  direct GPU launches  %d kernels/copies on torch's stream%s" % (
            m.direct_launches, "; through IREE's runtime: " + ", ".join(
                "%s x%d" % kv for kv in m.direct_launch_fallbacks.most_common(top))
            if m.direct_launch_fallbacks else ""))
    if m.cuda_graph_captures or m.cuda_graph_fallbacks:
        lines.append("  CUDA graphs          %d captured, %d steps replayed%s" % (
            m.cuda_graph_captures, m.cuda_graph_replays, "; kernel by kernel: " + ", ".join(
                "%s x%d" % kv for kv in m.cuda_graph_fallbacks.most_common(top))
            if m.cuda_graph_fallbacks else ""))
    if m.disk_cache_discarded:
        lines.append("  cache entries discarded " + ", ".join("%s x%d" % kv for kv in m.disk_cache_discarded.items()))
    if m.compile_failures:
        lines.append("  compile failures     " + ", ".join("%s x%d" % kv for kv in m.compile_failures.items()))
    if m.numerics_checks:
        lines.append("  numerics checks      %d, mismatches %d" % (m.numerics_checks, len(m.numerics_mismatches)))
        for message in m.numerics_mismatches[:3]:
            lines.append("    " + message)
    return "\n".join(lines)
