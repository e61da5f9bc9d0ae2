"""One model copy of ``kiln bench``: a fresh interpreter, pinned to one kiln core, driven over JSON lines.

The parent (:class:`kiln.benchmark.runner.Copy`) starts it with
``python -c "from kiln.benchmark.child import main; main()"``, sends one
config line, and reads back ``ready`` (or an error), then one reply per
``{"workers", "duration"}`` window until ``{"exit": true}``. stdout is the
reply channel only: library chatter is sent to stderr.
"""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

from kiln.benchmark import peers
from kiln.benchmark.inputs import factory_inputs, inputs_from_specs
from kiln.errors import KilnError

MAX_SAMPLES = 20000   # latencies a copy sends back; beyond this, a uniform subsample


def main():
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)   # library chatter goes to stderr; stdout is the reply channel

    def reply(msg):
        out.write(json.dumps(msg) + "\n")
        out.flush()

    cfg = json.loads(sys.stdin.readline())
    os.sched_setaffinity(0, cfg["cpus"])
    threads = len(cfg["cpus"])
    import torch
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        run, model, note = _make_runner(cfg, threads)
        setup = time.perf_counter() - t0
        end, n = time.perf_counter() + cfg["warmup"], 0
        while n < 3 or time.perf_counter() < end:
            run()
            n += 1
    except Exception as e:  # noqa: BLE001 - reported to the parent, which skips this runner
        reply({"error": f"{type(e).__name__}: {e}"[:600]})
        return
    reply({"ready": True, "setup_s": setup, "note": note})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("exit"):
            break
        before = _busy(model)
        res = measure(run, int(cmd["workers"]), float(cmd["duration"]), threads)
        if model is not None:
            after = _busy(model)
            busy = (after[0] - before[0]) + (after[1] - before[1])
            res["host_share"] = (after[1] - before[1]) / busy if busy > 0 else 0.0
        reply(res)


def _busy(model):
    """(device seconds, host seconds) the kiln model and the models inside it have run so far."""
    if model is None:
        return (0.0, 0.0)
    from kiln.observe.metrics import metrics
    ids = set(_metric_ids(model))
    device = host = 0.0
    for s in metrics()["models"]:
        if s["id"] in ids:
            device, host = device + s["device_seconds"], host + s["host_seconds"]
    return device, host


def _metric_ids(model):
    m = getattr(model, "metrics", None)
    if m is not None:
        yield m.id
    else:
        for inner in getattr(model, "inner_models", lambda: [])():
            yield from _metric_ids(inner)


def _make_runner(cfg, threads):
    """(zero-argument callable, kiln model or None, note) for this copy's runner."""
    batch = cfg["batch"]
    if cfg["runner"] == "kiln":
        from kiln.runtime import load
        from kiln.runtime.buckets import dynamic_batch
        if cfg["factory"]:   # first: the model's module may define ops its host fallback needs
            _, args, kwargs = factory_inputs(cfg["factory"], cfg["path"], batch)
        model = load(cfg["artifact"], threads=threads)
        note = None
        lead = [s.shape[0] for s in model.input_specs if len(s.shape)]
        if lead and lead[0] != batch:
            model = dynamic_batch(model)
            note = f"compiled at batch {lead[0]}, run through dynamic batch"
        if not cfg["factory"]:
            args, kwargs = inputs_from_specs(model.input_specs, batch, lead[0] if lead else None), {}
        return (lambda: model(*args, **kwargs)), model, note
    model, args, kwargs = factory_inputs(cfg["factory"], cfg["path"], batch)
    return peers.build(cfg["runner"], model, args, kwargs, threads), None, None


def measure(run, workers, duration, threads: int | None = None) -> dict:
    """Call ``run`` back to back from ``workers`` threads for ``duration`` seconds, all starting together.

    ``threads``: the intra-op threads each measuring thread runs with. OpenMP's thread count is
    per thread: torch.set_num_threads in the main thread reaches a new thread only when ATen's
    own parallel code runs there, not MKL/oneDNN GEMMs, which took the OpenMP default (every CPU
    the process had at start). On a copy pinned to one CPU, eager at batch 4 ran a 2-thread team
    on that CPU: 13-32 ms a call instead of 0.02-0.04 ms. Each thread sets it for itself."""
    samples = [[] for _ in range(workers)]
    ends = [0.0] * workers
    errors: list = []
    gate = threading.Barrier(workers + 1)
    state = {}

    def loop(i):
        mine = samples[i]
        if threads is not None:
            import torch
            torch.set_num_threads(threads)   # this thread's OpenMP team (see above)
        gate.wait()
        deadline = state["deadline"]
        try:
            while True:
                t = time.perf_counter()
                if t >= deadline:
                    break
                run()
                mine.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
        ends[i] = time.perf_counter()

    pool = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(workers)]
    for t in pool:
        t.start()
    start = time.perf_counter()
    state["deadline"] = start + duration
    gate.wait()
    for t in pool:
        t.join()
    if errors:
        raise KilnError(f"bench: a call failed: {errors[0]}")
    lat = [x * 1e3 for s in samples for x in s]
    calls = len(lat)
    sent = lat if calls <= MAX_SAMPLES else random.Random(0).sample(lat, MAX_SAMPLES)
    return {"calls": calls, "elapsed": max(ends) - start, "latencies_ms": [round(x, 4) for x in sent],
            "max_ms": round(max(lat), 4) if lat else None, "sum_ms": sum(lat)}
