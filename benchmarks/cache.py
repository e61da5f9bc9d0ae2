#!/usr/bin/env python
"""Compile-cache benchmark: cold trace, warm-cache trace and load time for BERT-base seq 128.

* ``cold``         ``kiln.trace`` with an empty cache directory (capture + compile + validate + store)
* ``warm``         ``kiln.trace`` of the same model again in the same process (fingerprint → alias → entry)
* ``warm-fresh``   the same in a fresh process that builds the model from the same config and seed:
                   what a second pod of a fleet sees (interpreter start and model construction are
                   not counted; the ``kiln.trace`` call is)
* ``load``         ``kiln.load`` of the saved artifact (median of 5 in this process, and once in a
                   fresh process)

Targets: warm-cache trace <= 1 s and <= 10 % of cold; load <= 0.3 s.

Usage::

    python benchmarks/cache.py            # BERT-base (BertConfig() defaults), ~3 minutes on 2 cores
    python benchmarks/cache.py --quick    # tiny BERT, smoke test

Results: a table on stdout and JSON (default ``benchmarks/results/cache.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import latency  # noqa: E402

FRESH = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {here!r}); sys.path.insert(0, {root!r})
import latency, kiln
from kiln.compiler import cache
case = latency.build_case("bert-base", {quick!r}, {seed!r})
t0 = time.perf_counter(); kiln.trace(case.model, case.example, cache={url!r}, quiet=True)
trace = time.perf_counter() - t0
t0 = time.perf_counter(); kiln.load({artifact!r}); load = time.perf_counter() - t0
print("RESULT " + json.dumps({{"trace": trace, "load": load, "stats": cache.stats}}))
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.json = a.json or str(HERE / "results" / ("cache-quick.json" if a.quick else "cache.json"))
    warnings.filterwarnings("ignore")
    os.environ.setdefault("KILN_QUIET", "1")
    import kiln
    from kiln.compiler import cache
    case = latency.build_case("bert-base", a.quick, a.seed)
    res = {"benchmark": "cache", "created": datetime.datetime.now().isoformat(timespec="seconds"),
           "model": case.description, "machine": latency.machine_info(len(os.sched_getaffinity(0)))}
    with tempfile.TemporaryDirectory(prefix="kiln-cache-bench-") as tmp:
        url = os.path.join(tmp, "cache")
        latency.log(f"cold trace of {case.description}")
        t0 = time.perf_counter()
        compiled = kiln.trace(case.model, case.example, cache=url, quiet=True)
        cold = time.perf_counter() - t0
        artifact = os.path.join(tmp, "bert.kiln")
        compiled.save(artifact)
        res["artifact_mb"] = round(os.path.getsize(artifact) / 1e6, 1)
        t0 = time.perf_counter()
        warm_model = kiln.trace(case.model, case.example, cache=url, quiet=True)
        warm = time.perf_counter() - t0
        assert warm_model.manifest["cache"]["hit"], "the warm trace missed the cache"
        loads = []
        for _ in range(5):
            t0 = time.perf_counter()
            kiln.load(artifact)
            loads.append(time.perf_counter() - t0)
        latency.log("warm trace in a fresh process")
        r = subprocess.run([sys.executable, "-c", FRESH.format(here=str(HERE), root=str(HERE.parent),
                                                               quick=a.quick, seed=a.seed, url=url,
                                                               artifact=artifact)],
                           capture_output=True, text=True, timeout=900)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"fresh process failed: {r.stderr[-2000:]}")
        fresh = json.loads(line[7:])
        res["entry"] = cache.Cache(url).entries()[0]
    res["seconds"] = {"cold": round(cold, 3), "warm": round(warm, 3), "warm_fresh_process": round(fresh["trace"], 3),
                      "load_median": round(statistics.median(loads), 3), "load_fresh_process": round(fresh["load"], 3)}
    res["fresh_process_cache_stats"] = fresh["stats"]
    worst_warm = max(warm, fresh["trace"])
    worst_load = max(statistics.median(loads), fresh["load"])
    res["targets"] = {
        "warm_trace_s": {"value": round(worst_warm, 3), "limit": "<= 1.0", "met": worst_warm <= 1.0},
        "warm_over_cold": {"value": round(worst_warm / cold, 4), "limit": "<= 0.10", "met": worst_warm / cold <= 0.10},
        "load_s": {"value": round(worst_load, 3), "limit": "<= 0.3", "met": worst_load <= 0.3},
    }
    s = res["seconds"]
    print(f"\n{case.description} (artifact {res['artifact_mb']} MB)")
    print(f"{'step':<34}{'seconds':>10}")
    for label, key in (("cold trace (empty cache)", "cold"), ("warm trace, same process", "warm"),
                       ("warm trace, fresh process", "warm_fresh_process"),
                       ("kiln.load, median of 5", "load_median"), ("kiln.load, fresh process", "load_fresh_process")):
        print(f"{label:<34}{s[key]:>10.3f}")
    for key, t in res["targets"].items():
        print(f"target {key}: {t['value']} (need {t['limit']}): {'met' if t['met'] else 'MISSED'}")
    latency.write_json(res, a.json)
    print(f"\nJSON: {latency.display_path(a.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
