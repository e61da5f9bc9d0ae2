"""What porting costs, measured: a -O1 compile, its artifact, its answers against eager, a
short timing against eager, and where a call's time goes (each partition and host op, from
kiln's profiler spans).

A model captured whole is compiled as ``kiln.trace`` compiles it (without the compile cache:
the time is a cold compile). A model Dynamo splits runs as a user would run it,
``torch.compile(model, backend="kiln")``, one compiled graph per piece and Python between.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from kiln.compiler.driver import compile_graph
from kiln.errors import KilnError
from kiln.observe.profiler import profile


@dataclass
class Cost:
    route: str                                  # "kiln.trace" | "torch.compile(backend='kiln')" | "not compiled"
    compile_seconds: float | None = None
    artifact_bytes: int | None = None
    eager_ms: float | None = None
    kiln_ms: float | None = None
    max_abs_difference: float | None = None
    tolerance: str | None = None
    spans: list = field(default_factory=list)   # [{name, kind, ms}] per call, largest first
    engines: dict = field(default_factory=dict)  # partition id -> engine, after selection
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        return self.eager_ms / self.kiln_ms if self.eager_ms and self.kiln_ms else None

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out["speedup_vs_eager"] = round(self.speedup, 3) if self.speedup else None
        return out


def traced(subject, captured, options, progress, budget: float) -> Cost:
    """Compile the captured graph at ``options`` and measure it."""
    cost = Cost("kiln.trace")
    started = time.perf_counter()
    compiled = compile_graph(subject.model, subject.args, subject.kwargs, options, name=subject.name,
                             progress=progress, captured=captured)
    cost.compile_seconds = round(time.perf_counter() - started, 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.kiln")
        compiled.save(path)
        cost.artifact_bytes = os.path.getsize(path)
    cost.engines = {p["id"]: p.get("engine") for p in compiled.manifest.get("partitions", [])}
    validation = compiled.manifest.get("validation") or {}
    cost.max_abs_difference = validation.get("max_abs_error", validation.get("max_abs_diff"))
    cost.tolerance = _tolerance(validation)
    _timed(cost, subject, lambda: compiled(*subject.args, **subject.kwargs), budget)
    return cost


def dynamo(subject, options, budget: float) -> Cost:
    """``torch.compile(backend="kiln")`` on a model that breaks into several graphs."""
    from kiln.device.compile_backend import backend
    cost = Cost("torch.compile(backend='kiln')")
    torch._dynamo.reset()
    # whole_graph off: each piece is placed as the report's analysis placed it (host ops on
    # the host), not handed whole to Inductor, which the device's backend does by default
    settings = {"optlevel": options.optlevel, "whole_graph": False, "cache": False}
    run = torch.compile(subject.model, backend=lambda gm, ex: backend(gm, ex, settings))
    started = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(*subject.args, **subject.kwargs)
        want = subject.call()
    cost.compile_seconds = round(time.perf_counter() - started, 2)
    eager = [str(w.message) for w in caught if str(w.message).startswith("kiln")]
    if eager:     # the backend ran a piece eagerly rather than fail: not a compiled model
        raise KilnError(f"{len(eager)} graph(s) could not be compiled and ran eagerly: {eager[0]}")
    cost.max_abs_difference = _max_difference(got, want)
    cost.tolerance = "each graph checked against eager as it compiled (kiln's default tolerances)"
    _timed(cost, subject, lambda: run(*subject.args, **subject.kwargs), budget)
    torch._dynamo.reset()
    return cost


def _timed(cost, subject, call, budget):
    with torch.no_grad():
        cost.eager_ms, cost.kiln_ms = _median_ms(subject.call, call, budget)
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            calls = 10
            with profile(trace):
                for _ in range(calls):
                    call()
            with open(trace) as f:
                events = json.load(f)["traceEvents"]
    totals = defaultdict(float)
    kinds = {}
    spans = [ev for ev in events if ev.get("cat") in ("device", "host")]
    models = {ev.get("args", {}).get("model") for ev in spans}
    for ev in spans:
        # several compiled graphs (Dynamo's pieces) each have a partition 0: name the graph
        name = ev["name"] if len(models) < 2 else f"{ev['name']} [{ev.get('args', {}).get('model')}]"
        totals[name] += ev["dur"] / 1e3 / calls
        kinds[name] = ev["cat"]
    cost.spans = sorted(({"name": n, "kind": kinds[n], "ms": round(ms, 4)} for n, ms in totals.items()),
                        key=lambda s: -s["ms"])


def _median_ms(eager, kiln, budget: float) -> tuple:
    """Median milliseconds per call of each, timed in alternation (a busy machine slows both
    alike) for ``budget`` seconds each, at least 5 calls."""
    eager(), kiln()
    times = ([], [])
    deadline = time.perf_counter() + 2 * budget
    while len(times[0]) < 5 or (time.perf_counter() < deadline and len(times[0]) < 1000):
        for fn, out in ((eager, times[0]), (kiln, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return tuple(round(statistics.median(t) * 1e3, 4) for t in times)


def _max_difference(got, want) -> float:
    flat_got, _ = torch.utils._pytree.tree_flatten(got)
    flat_want, _ = torch.utils._pytree.tree_flatten(want)
    diffs = [float((g.float() - w.float()).abs().max()) for g, w in zip(flat_got, flat_want)
             if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.numel()]
    if len(flat_got) != len(flat_want):
        raise KilnError("the compiled model returns a different number of outputs from eager")
    return max(diffs, default=0.0)


def _tolerance(validation: dict) -> str | None:
    if not validation:
        return None
    keys = [k for k in ("atol", "rtol") if k in validation]
    return ", ".join(f"{k} {validation[k]:g}" for k in keys) or json.dumps(validation)[:120]
