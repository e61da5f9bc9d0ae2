#!/usr/bin/env python
"""Throughput benchmark: one all-CPU session vs DataParallel vs pipeline, plus bucketing overhead.

Models as in ``latency.py`` (random weights from transformers configs, nothing downloaded):
ResNet-50 1x3x224x224 and BERT-base batch 1, seq 128, fp32. Every request is batch 1.

Modes, all on kiln artifacts of the same model, in one process:

* ``single``        one compiled model using every CPU of the process (engine threads = CPUs),
                    called back to back: what a server without kiln cores gets
* ``dataparallel``  ``kiln.DataParallel`` with one replica process per kiln core, each pinned to
                    its core with one engine thread per CPU; 2 requests in flight per replica
* ``pipeline``      ``kiln.trace(..., pipeline_cores=N)`` over all N cores, stages on pinned
                    worker threads, 2 requests in flight per stage

Each mode runs a closed loop (a new request as soon as one completes, the stated number in
flight) for ``--seconds`` split into ``--rounds`` rounds; rounds interleave the modes, so slow
drift of a shared machine lands on all of them. Throughput = completed requests / time.

Bucketing overhead: an artifact bucketed on the sequence length (BERT: 64 and 128) or the image
size (ResNet: 192 and 224), run at exactly the largest bucket, against an artifact compiled for
exactly that shape; medians of back-to-back interleaved blocks of sequential calls; overhead =
bucketed / exact - 1.

Targets: DataParallel >= 1.1x the single session's throughput; bucketing overhead <= 5 %.

Usage::

    python benchmarks/throughput.py               # full run (~10 minutes on 2 cores)
    python benchmarks/throughput.py --quick       # tiny configs, smoke test
    python benchmarks/throughput.py --models bert-base --seconds 60

Results: a table on stdout and JSON (default ``benchmarks/results/throughput.json``).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import latency  # noqa: E402  (models, machine info, load sampling, JSON writing)

import kiln  # noqa: E402
from kiln.host import cores as placement  # noqa: E402

TARGET_DP = 1.1
TARGET_BUCKET_OVERHEAD_PCT = 5.0


def log(msg):
    latency.log(msg)


def bucket_setup(case, quick):
    """(buckets, output_dims, example at the largest bucket) for the model."""
    if case.name == "bert-base":
        seq = case.kwargs["input_ids"].shape[1]
        return {"input_ids": {1: [seq // 2, seq]}}, None, case.example
    size = case.args[0].shape[-1]
    small = size - (16 if quick else 32)
    # the feature map is image/32: it changes with the bucket but is not a slice of it
    return ([(torch.randn(1, 3, small, small),), case.example],
            {"last_hidden_state": {2: None, 3: None}}, case.example)


def call(model, example):
    return model(**example) if isinstance(example, dict) else model(*example)


def submit(model, example):
    return model.submit(**example) if isinstance(example, dict) else model.submit(*example)


def closed_loop(model, example, seconds, in_flight):
    """Completed requests, elapsed seconds, per-request latencies (s)."""
    lat = []
    start = time.perf_counter()
    deadline = start + seconds
    if in_flight == 1:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            call(model, example)
            lat.append(time.perf_counter() - t0)
        return len(lat), time.perf_counter() - start, lat
    pending = collections.deque()
    while True:
        now = time.perf_counter()
        while now < deadline and len(pending) < in_flight:
            pending.append((now, submit(model, example)))
        if not pending:
            break
        t0, fut = pending.popleft()
        fut.result()
        lat.append(time.perf_counter() - t0)
    return len(lat), time.perf_counter() - start, lat


def sequential_median(model, example, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call(model, example)
        out.append(time.perf_counter() - t0)
    return out


def run_model(name, args):
    case = latency.build_case(name, args.quick, args.seed)
    ncores = len(placement.visible())
    log(f"{name}: {case.description}; {ncores} kiln cores "
        f"({', '.join(placement.format_cpus(c.cpus) for c in placement.visible())})")
    res = {"model": name, "description": case.description, "kiln_cores": ncores, "modes": {},
           "bucketing": {}}
    with torch.no_grad():
        reference = latency.flat_tensors(call(case.model, case.example))

    t0 = time.perf_counter()
    single = kiln.trace(case.model, case.example, quiet=True)
    res["compile_seconds"] = {"single": round(time.perf_counter() - t0, 1)}
    modes = {"single": (single, 1)}
    t0 = time.perf_counter()
    dp = kiln.DataParallel(single)
    res["compile_seconds"]["dataparallel_start"] = round(time.perf_counter() - t0, 1)
    modes["dataparallel"] = (dp, 2 * dp.num_workers)
    if ncores >= 2 and "pipeline" not in args.skip:
        try:
            t0 = time.perf_counter()
            pipe = kiln.trace(case.model, case.example, pipeline_cores=ncores, quiet=True)
            res["compile_seconds"]["pipeline"] = round(time.perf_counter() - t0, 1)
            modes["pipeline"] = (pipe, 2 * ncores)
            res["pipeline_stages"] = pipe.manifest.get("pipeline", {}).get("stages")
        except Exception as e:  # noqa: BLE001
            res["modes"]["pipeline"] = {"error": latency.short_error(e)}
            log(f"{name}: pipeline failed: {latency.short_error(e)}")

    for mode, (model, in_flight) in modes.items():
        err = latency.max_abs_diff(reference, call(model, case.example))
        res["modes"][mode] = {"in_flight": in_flight, "max_abs_diff_vs_eager": err, "completed": 0,
                              "seconds": 0.0, "latencies": []}
        closed_loop(model, case.example, args.warmup_seconds, in_flight)   # warm-up

    res["load_before"] = latency.background_load()
    per_round = args.seconds / args.rounds
    for r in range(args.rounds):
        for mode, (model, in_flight) in modes.items():
            done, elapsed, lat = closed_loop(model, case.example, per_round, in_flight)
            m = res["modes"][mode]
            m["completed"] += done
            m["seconds"] += elapsed
            m["latencies"] += lat
        log(f"{name}: round {r + 1}/{args.rounds} done")
    res["load_after"] = latency.background_load()
    for m in res["modes"].values():
        if "error" in m:
            continue
        lat = sorted(m.pop("latencies"))
        m["throughput_per_s"] = round(m["completed"] / m["seconds"], 2)
        m["latency_ms_p50"] = round(1e3 * lat[len(lat) // 2], 2)
        m["latency_ms_p99"] = round(1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 2)
    base = res["modes"]["single"]["throughput_per_s"]
    for m in res["modes"].values():
        if "throughput_per_s" in m:
            m["vs_single"] = round(m["throughput_per_s"] / base, 3)
    dp.close()
    if "pipeline" in modes:
        modes["pipeline"][0].close()

    # bucketing overhead
    buckets, output_dims, exact_example = bucket_setup(case, args.quick)
    t0 = time.perf_counter()
    bucketed = kiln.trace(case.model, case.example, buckets=buckets, output_dims=output_dims, quiet=True)
    res["bucketing"]["compile_seconds"] = round(time.perf_counter() - t0, 1)
    res["bucketing"]["buckets"] = bucketed.describe_buckets()
    res["bucketing"]["max_abs_diff_vs_exact"] = latency.max_abs_diff(
        latency.flat_tensors(call(single, exact_example)),
        latency.flat_tensors(call(bucketed, exact_example)))
    for m in (single, bucketed):
        sequential_median(m, exact_example, args.warmup_calls)
    samples = {"exact": [], "bucketed": []}
    ratios = []
    for _ in range(args.rounds * 2):
        a = sequential_median(single, exact_example, args.bucket_calls)
        b = sequential_median(bucketed, exact_example, args.bucket_calls)
        samples["exact"] += a
        samples["bucketed"] += b
        ratios.append(statistics.median(b) / statistics.median(a))
    ex, bu = statistics.median(samples["exact"]), statistics.median(samples["bucketed"])
    res["bucketing"].update({
        "exact_ms_p50": round(1e3 * ex, 3), "bucketed_ms_p50": round(1e3 * bu, 3),
        "overhead_pct": round(100 * (bu / ex - 1), 2),
        "overhead_pct_paired": round(100 * (statistics.median(ratios) - 1), 2)})
    dp_ratio = res["modes"]["dataparallel"].get("vs_single")
    res["targets"] = {
        "dataparallel_vs_single": {"value": dp_ratio, "limit": f">= {TARGET_DP}",
                                   "met": dp_ratio is not None and dp_ratio >= TARGET_DP},
        "bucketing_overhead_pct": {"value": res["bucketing"]["overhead_pct_paired"],
                                   "limit": f"<= {TARGET_BUCKET_OVERHEAD_PCT}",
                                   "met": res["bucketing"]["overhead_pct_paired"] <= TARGET_BUCKET_OVERHEAD_PCT},
    }
    warning = latency.load_warning(res["load_after"]) or latency.load_warning(res["load_before"])
    if warning:
        res["warning"] = warning
    return res


def render(results):
    lines = []
    for res in results["models"]:
        lines.append(f"\n{res['description']} — {res['kiln_cores']} kiln cores, batch-1 requests")
        lines.append(f"{'mode':<14}{'in flight':>10}{'req/s':>10}{'vs single':>11}{'p50 ms':>10}{'p99 ms':>10}")
        for mode, m in res["modes"].items():
            if "error" in m:
                lines.append(f"{mode:<14}  error: {m['error']}")
                continue
            lines.append(f"{mode:<14}{m['in_flight']:>10}{m['throughput_per_s']:>10.1f}"
                         f"{m['vs_single']:>10.2f}x{m['latency_ms_p50']:>10.1f}{m['latency_ms_p99']:>10.1f}")
        b = res["bucketing"]
        lines.append(f"bucketing ({b['buckets']}): exact {b['exact_ms_p50']:.2f} ms, bucketed "
                     f"{b['bucketed_ms_p50']:.2f} ms at the largest bucket, overhead "
                     f"{b['overhead_pct']:+.1f}% (paired {b['overhead_pct_paired']:+.1f}%)")
        for key, t in res["targets"].items():
            lines.append(f"target {key}: {t['value']} (need {t['limit']}): "
                         f"{'met' if t['met'] else 'MISSED'}")
        if res.get("warning"):
            lines.append(f"WARNING: {res['warning']}")
    print("\n".join(lines))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="resnet50,bert-base")
    p.add_argument("--seconds", type=float, default=None, help="timed seconds per mode (default 30; 4 with --quick)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-seconds", type=float, default=2.0)
    p.add_argument("--warmup-calls", type=int, default=5)
    p.add_argument("--bucket-calls", type=int, default=None, help="calls per bucketing block (default 10; 5 with --quick)")
    p.add_argument("--skip", default="", help="comma-separated modes to skip (pipeline)")
    p.add_argument("--quick", action="store_true", help="tiny model configs: a smoke test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.seconds = a.seconds or (4.0 if a.quick else 30.0)
    a.bucket_calls = a.bucket_calls or (5 if a.quick else 10)
    a.skip = {s for s in a.skip.split(",") if s}
    a.json = a.json or str(HERE / "results" / ("throughput-quick.json" if a.quick else "throughput.json"))
    return a


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("KILN_QUIET", "1")
    results = {"benchmark": "throughput", "created": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": latency.machine_info(placement.available_cpus() if hasattr(placement, "available_cpus")
                                               else len(placement.process_cpus())),
               "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
               "models": []}
    for name in [m for m in args.models.split(",") if m]:
        results["models"].append(run_model(name, args))
        latency.write_json(results, args.json)
    render(results)
    print(f"\nJSON: {latency.display_path(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
