"""Observability: per-model counters, profiler timelines, the process registry, monitor and top.

Nothing here starts at import. The runtime calls :func:`announce_model` once a
model is ready; that is when the process begins to show up in ``kiln ls`` /
``kiln monitor`` / ``kiln top`` and when ``KILN_PROFILE`` recording begins.
This layer imports only base modules, ``kiln.host``, ``kiln.engines`` and
``kiln.artifact``: the compiler and runtime report into it, never the reverse.
"""
from __future__ import annotations

from kiln.observe import metrics, profiler, registry


def announce_model(model_metrics: "metrics.ModelMetrics"):
    """A model is loaded: count it in ``kiln.metrics()``, start this process's heartbeat
    (once) and, with ``KILN_PROFILE`` set, its profile (once)."""
    metrics.track(model_metrics)
    registry.announce()
    profiler.start_from_env()
