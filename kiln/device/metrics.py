"""Counters and timings of the graphs kiln compiles at run time, and the recompilation
warning.

torch_xla users find recompilation storms with ``metrics_report()``: a ``CompileTime``
metric whose sample count keeps growing, ``UncachedCompile`` climbing step after step.
kiln keeps the same names (``CompileTime``, ``ExecuteTime``, ``TensorsGraphSize``;
``UncachedCompile``, ``CachedCompile``, ``MarkStep``...) and also says it outright: when
one graph (the same operations) has been compiled for :data:`RECOMPILE_WARNING_AFTER`
different input shapes, a warning names the inputs whose shapes changed and the first
operation that reads them.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections import defaultdict

RECOMPILE_WARNING_AFTER = 3

_LOCK = threading.Lock()
_counters: dict = defaultdict(int)
_samples: dict = defaultdict(list)
_shapes_seen: dict = defaultdict(list)      # graph structure -> input shapes compiled for
_warned: set = set()


def count(name: str, n: int = 1):
    with _LOCK:
        _counters[name] += n


def sample(name: str, value: float):
    with _LOCK:
        _samples[name].append(value)


def counter_value(name: str) -> int:
    with _LOCK:
        return _counters.get(name, 0)


def metric_data(name: str):
    """``(count, total, samples)`` of a metric, or None (torch_xla's ``metric_data``)."""
    with _LOCK:
        values = list(_samples.get(name, ()))
    return (len(values), sum(values), values) if values else None


def counter_names() -> list:
    with _LOCK:
        return sorted(_counters)


def metric_names() -> list:
    with _LOCK:
        return sorted(_samples)


def clear():
    """Forget every count and sample (between experiments, in tests)."""
    with _LOCK:
        _counters.clear()
        _samples.clear()
        _shapes_seen.clear()
        _warned.clear()


_BEFORE_REPORT: list = []      # kiln.device.trace's wait for background compiles


def before_report(wait):
    """Call ``wait()`` before each report (so it includes the compiles under way)."""
    _BEFORE_REPORT.append(wait)


def _nearest_rank(ordered: list, q: float):
    """The ``q``th percentile of sorted samples by nearest rank (until 12-01 "99%" printed the
    largest sample: one 5 s first call among 1000 1 ms calls read as a 5 s p99)."""
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def report() -> str:
    """The counters and metrics as torch_xla's ``metrics_report()`` lays them out, once
    the compiles under way in the background are done (their times are part of it)."""
    for wait in _BEFORE_REPORT:
        wait()
    with _LOCK:
        samples = {k: list(v) for k, v in _samples.items()}
        counters = dict(_counters)
    lines = []
    for name in sorted(samples):
        values = samples[name]
        seconds = name.endswith("Time")
        unit = (lambda v: f"{v * 1e3:.3f}ms") if seconds else (lambda v: f"{v:g}")
        ordered = sorted(values)
        lines += [f"Metric: {name}", f"  TotalSamples: {len(values)}", f"  Accumulator: {unit(sum(values))}",
                  f"  Percentiles: 50%={unit(_nearest_rank(ordered, 50))}; 99%={unit(_nearest_rank(ordered, 99))}"]
    for name in sorted(counters):
        lines += [f"Counter: {name}", f"  Value: {counters[name]}"]
    return "\n".join(lines) + "\n"


def note_compile(structure: str, shapes: list, readers: list, where: str):
    """Record that a graph of ``structure`` was compiled for input ``shapes``; warn once
    when it has been compiled for :data:`RECOMPILE_WARNING_AFTER` shapes. ``readers``:
    per input, the first operation that reads it (for the message)."""
    with _LOCK:
        seen = _shapes_seen[structure]
        if shapes in seen:
            return
        seen.append(shapes)
        if len(seen) < RECOMPILE_WARNING_AFTER or structure in _warned:
            return
        _warned.add(structure)
        first = seen[0]
    changed = [f"input {i} ({readers[i]}): {list(a)} then {list(b)}"
               for i, (a, b) in enumerate(zip(first, shapes)) if a != b]
    warnings.warn(f"kiln: {where} has been compiled for {len(seen)} different input shapes: "
                  f"{'; '.join(changed) or 'the shapes of its inputs changed'}. Each new shape is a new "
                  "compile; keep shapes fixed (pad to a few sizes) or mark the dimension dynamic",
                  RuntimeWarning, stacklevel=3)
