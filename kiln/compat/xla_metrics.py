"""torch_xla's ``debug.metrics`` over kiln's device metrics (:mod:`kiln.device.metrics`):
``CompileTime``, ``ExecuteTime``, ``TensorsGraphSize``; ``UncachedCompile``,
``CachedCompile``, ``MarkStep``, ``InterpretedGraphs``, ``EagerGraphs``."""
from __future__ import annotations

from kiln.device import metrics

counter_names = metrics.counter_names
counter_value = metrics.counter_value
metric_names = metrics.metric_names
metric_data = metrics.metric_data


def metrics_report() -> str:
    return metrics.report()


def short_metrics_report(counter_names=None, metric_names=None) -> str:
    keep = set(counter_names or ("CachedCompile", "UncachedCompile", "MarkStep")) | \
        set(metric_names or ("CompileTime", "ExecuteTime"))
    blocks = metrics.report().split("\n")
    out, keeping = [], False
    for line in blocks:
        if line.startswith(("Metric: ", "Counter: ")):
            keeping = line.split(": ", 1)[1] in keep
        if keeping and line:
            out.append(line)
    return "\n".join(out) + "\n"


def clear_all():
    metrics.clear()


clear_counters = clear_all
clear_metrics = clear_all
