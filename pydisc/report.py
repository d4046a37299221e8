"""`metrics_report()`: the counters as a short text a user can read."""
from __future__ import annotations

from .metrics import METRICS

__all__ = ["metrics_report"]


def metrics_report(top: int = 10) -> str:
    m = METRICS
    lines = [
        "pydisc metrics",
        "  steps run            %d (plans reused %d, planned %d)" % (m.steps, m.graph_cache_hits,
                                                                   m.graph_cache_misses),
        "  recorded ops         %d" % m.recorded_ops,
        "  compiled clusters    %d" % m.clusters,
        "  IREE compiles        %d (%.2f s), cache hits %d" % (m.compiles, m.compile_seconds, m.cache_hits),
        "  cluster executions   %d" % m.executions,
        "  materializations     %d (values read before mark_step)" % m.materializations,
        "  planning time        %.2f s" % m.plan_seconds,
    ]
    total = sum(m.fallback_ops.values())
    lines.append("  eager (fallback) ops %d" % total)
    for op, count in m.fallback_ops.most_common(top):
        lines.append("    %-40s %d" % (op, count))
    if m.compile_failures:
        lines.append("  compile failures     " + ", ".join("%s x%d" % kv for kv in m.compile_failures.items()))
    return "\n".join(lines)
