"""Measuring builds on this machine: timing rounds, the comparison with eager, the compile budget.

Selection (:mod:`kiln.compiler.selection`) decides; this module only measures. Eager is
timed as the partition's GraphModule run by PyTorch (what the reference engine's build
runs, without serialising the weights first): the eager engine is built only when it wins.

* **Speed against eager** (-O2 and -O3): the chosen build and eager take turns on the
  partition's example inputs within a small time cap (:data:`COMPARE_SECONDS`); eager
  replaces the build only when the build is slower by more than :data:`MARGIN`.
* **The compile budget** (``--compile-budget``, :func:`kiln.compiler.options.budget_seconds`):
  the time this graph's compile has spent so far (its progress phases) counts against it;
  -O3 skips a candidate whose expected build time exceeds what is left, drops one
  whose first timed calls are :data:`DROP` times slower than the best so far, and
  shortens its final timing to what is left (:func:`final_timing`).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time

import torch

from kiln.compiler.options import budget_seconds
from kiln.engines import openmp

# Eager replaces an engine's build only when the build is slower by more than this
# fraction: on the 2-core machine, medians of a few calls of the same build move by
# up to ~5-8% between runs, so a smaller margin would flip choices on noise.
MARGIN = 0.10
# -O2's per-partition cap on the comparison with eager (seconds), and its shape.
COMPARE_SECONDS, COMPARE_FLOOR = 1.0, 0.3
COMPARE = {"warmup": 1, "rounds": 8, "block": 3, "min_rounds": 2}
# -O3 drops a candidate whose first PROBE_CALLS calls are DROP times slower than the
# best so far (a build that slow does not win the final, longer timing).
PROBE_CALLS, DROP = 3, 1.5
# Expected build time per op of the partition when nothing better is known: engines that
# compile native code (Inductor's AOT build: 21.6 s for BERT-base's 553 ops on 2 cores)
# and engines whose blobs are data (ONNX Runtime 10.4 s, OpenVINO 3.3 s there), never
# less than the floors.
NATIVE_PER_OP, DATA_PER_OP = 0.04, 0.02
NATIVE_SECONDS, DATA_SECONDS = 10.0, 2.0
_LAST_BUILD: dict = {}      # engine name -> seconds per op of its last build in this process


def time_runners(runners: dict, inputs, *, warmup=3, rounds=5, block=3, seconds=3.0,
                 min_rounds=2) -> dict:
    """Median latency in ms per runner: warm-up, then rounds that take turns, each
    runner timing a block of ``block`` calls once it has settled; rounds stop after
    ``min_rounds`` once ``seconds`` per runner have passed.

    Interleaving matters on shared machines: a burst of background load hits
    every candidate alike instead of deciding the winner on its own. Settling
    matters because engines leave their threads busy-waiting for work after a
    call (ONNX Runtime's spinning, OpenMP's wait policy): the next engine's first
    calls compete with them, which once timed OpenVINO at 224 ms for a 133 ms
    BERT-base when it ran right after ONNX Runtime, and times a 0.2 ms eager
    partition (torch's OpenMP threads) at 65-100 ms for its first three calls after
    an ONNX Runtime call on 2 cores. So before its block a runner makes untimed calls
    until one is within ``SETTLED`` of its fastest call so far (at most ``SETTLE_CALLS``).

    Timings on this machine take turns with other kiln processes' (:func:`exclusive`).
    """
    with exclusive():
        return _time_runners(runners, inputs, warmup, rounds, block, seconds, min_rounds)


def _time_runners(runners, inputs, warmup, rounds, block, seconds, min_rounds) -> dict:
    fastest: dict = {}
    for name, runner in runners.items():
        _settle(runner, inputs, fastest, name, warmup, warmup + SETTLE_CALLS)
    samples: dict = {name: [] for name in runners}
    deadline = time.perf_counter() + seconds * len(runners)
    for i in range(rounds):
        if i >= min_rounds and time.perf_counter() > deadline:
            break
        for name, runner in runners.items():
            _settle(runner, inputs, fastest, name, 1, SETTLE_CALLS)
            for _ in range(block):
                ms = _call_ms(runner, inputs)
                fastest[name] = min(fastest[name], ms)
                samples[name].append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


SETTLED, SETTLE_CALLS = 1.25, 4


@contextlib.contextmanager
def exclusive():
    """Hold the machine's measurement lock (a file lock in the temporary directory) while
    timing: the graphs of one LLM compile in parallel processes (:mod:`kiln.llm.parallel`),
    and two of them timing builds at once would each see the other's threads as noise
    in the numbers that choose engines. Where file locks are unavailable, no lock."""
    try:
        import fcntl
        f = open(os.path.join(tempfile.gettempdir(), "kiln-measure.lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _call_ms(runner, inputs) -> float:
    t0 = time.perf_counter()
    runner(inputs)
    return (time.perf_counter() - t0) * 1e3


def _settle(runner, inputs, fastest, name, least, most):
    """Untimed calls: at least ``least``, then until one is within SETTLED of the fastest
    before it (at most ``most``)."""
    for k in range(most):
        ms = _call_ms(runner, inputs)
        best = fastest.get(name)
        fastest[name] = ms if best is None else min(best, ms)
        if k + 1 >= least and best is not None and ms <= SETTLED * best:
            return


# -O3's final timing of the builds kept: up to FINAL_SECONDS per runner, but no more than
# its share of half the budget left (the whole-model check and packaging come after it),
# and never less than FINAL_FLOOR (the choice needs some interleaved rounds); with the
# budget short, one warm-up call instead of three.
FINAL_SECONDS, FINAL_FLOOR, FINAL_WARMUP = 3.0, 0.5, 3


def final_timing(left: float, runners: int) -> dict:
    """time_runners' arguments for -O3's final timing with ``left`` seconds of budget."""
    share = left / (2 * max(runners, 1))
    return {"seconds": min(FINAL_SECONDS, max(share, FINAL_FLOOR)),
            "warmup": FINAL_WARMUP if share >= FINAL_SECONDS else 1}


def compare(runner, eager, inputs, cap: float) -> tuple:
    """(build ms, eager ms): the two timed in turns within about ``cap`` seconds."""
    ms = time_runners({"build": runner, "eager": eager}, inputs, seconds=cap / 2, **COMPARE)
    return ms["build"], ms["eager"]


def probe(runner, inputs) -> float:
    """Median ms of PROBE_CALLS calls once settled: -O3's early look at a build."""
    fastest: dict = {}
    with exclusive():
        _settle(runner, inputs, fastest, "build", 2, 2 + SETTLE_CALLS)
        return statistics.median(_call_ms(runner, inputs) for _ in range(PROBE_CALLS))


def eager_runner(sub, threads: int):
    """The partition run by PyTorch, as the eager engine's build would run it."""
    def run(inputs):
        with torch.no_grad(), openmp.threads(threads):
            out = sub(*inputs)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    return run


def eager_wins(build_ms: float, eager_ms: float) -> bool:
    return build_ms > eager_ms * (1.0 + MARGIN)


class Budget:
    """The compile budget of one graph: what is left, and what a build is expected to take.
    Build times scale with the partition (``ops``: its operator count), so they are
    kept per op: a tiny graph's quick build says little about BERT-base's."""

    def __init__(self, opts, progress, ops: int = 1):
        self.total = budget_seconds(opts)
        self.progress = progress
        self.ops = max(int(ops), 1)
        spent = sum(getattr(progress, "timings", {}).values())   # this graph's phases so far
        self.start = time.perf_counter() - spent
        self.seen: dict = {}          # engine name -> seconds per op of its build in this search

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.start)

    def expected(self, engine) -> float:
        """Seconds ``engine``'s next build should take: at the rate of its build in this
        search or its last build in this process, what it declares (``build_seconds``),
        else the rough per-op default."""
        for rate in (self.seen.get(engine.name), _LAST_BUILD.get(engine.name)):
            if rate:
                return rate * self.ops
        declared = getattr(engine, "build_seconds", None)
        if declared:
            return float(declared)
        if engine.native_code:
            return max(NATIVE_SECONDS, NATIVE_PER_OP * self.ops)
        return max(DATA_SECONDS, DATA_PER_OP * self.ops)

    def built(self, engine, seconds: float):
        self.seen[engine.name] = _LAST_BUILD[engine.name] = seconds / self.ops

    def refusal(self, engine, key: str) -> str | None:
        """Why the budget skips building ``key`` now, or None."""
        left, need = self.left(), self.expected(engine)
        if left >= need:
            return None
        return f"skipped: budget, {max(left, 0.0):.1f} s left, {key} needs ~{need:.1f} s"

    @contextlib.contextmanager
    def shown(self):
        """Progress lines name the budget left while the block runs."""
        label = self.progress.label
        self.progress.label = f"{label} [budget {max(self.left(), 0.0):.0f}s left]"
        try:
            yield
        finally:
            self.progress.label = label


def summarize(partitions) -> dict | None:
    """The model's speed against eager from its partitions' records: summed latencies
    (host ops left out), or None when a partition was not measured."""
    measured = [p for p in partitions if p.get("eager_latency_ms") and p.get("latency_ms")]
    if not measured or len(measured) != len(partitions):
        return None
    kiln_ms = sum(p["latency_ms"] for p in measured)
    eager_ms = sum(p["eager_latency_ms"] for p in measured)
    return {"speed_vs_eager": round(eager_ms / kiln_ms, 3), "latency_ms": round(kiln_ms, 4),
            "eager_latency_ms": round(eager_ms, 4),
            "eager_partitions": [p["id"] for p in measured if p["engine"] == "eager"]}


def notes(partitions) -> list:
    """Report lines: each partition that runs eagerly, and the model's speed against eager."""
    out = [p["note"] for p in partitions if p.get("note")]
    total = summarize(partitions)
    if total:
        out.append(f"speed vs eager: {total['speed_vs_eager']:.2f}x (device partitions "
                   f"{total['latency_ms']:.3g} ms, eager {total['eager_latency_ms']:.3g} ms)")
    return out
