#!/usr/bin/env python
"""Part (b): the NxD training script's step time at TP=2 (2 processes x 1 thread) against
one process (TP=1, 2 threads) on the same cores.

The script is tests/data/nxd_train.py (NxD's parallel layers, parallel_cross_entropy,
AdamW under NeuronZero1Optimizer with clipping) on CPU tensors over gloo
(``NXD_CPU_MODE=1``: PyTorch's eager kernels, so the comparison is the parallel layers'
and collectives' cost, not a compiler's), with a Llama-like model big enough for the
matmuls to matter on 2 cores: hidden 512, 4 layers, 8 heads, FFN 1408, vocabulary 8192,
batch 8 x 128 tokens. Reported: the median step after ``--warmup`` steps, tokens/s, and
each rank's resident memory, parameter bytes and optimizer-state bytes (TP shards the
weights and so the state; ZeRO-1 would shard it again over DP, here DP=1).

    python -m benchmarks.dist_parts.train [--steps 10] [--json benchmarks/results/dist-train.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "data", "nxd_train.py")
MODEL = ["--hidden", "512", "--layers", "4", "--heads", "8", "--ffn", "1408", "--vocab", "8192",
         "--batch", "8", "--seq", "128", "--lr", "1e-4"]
CASES = [("tp1, 1 process x 2 threads", 1, 1, "2", {}),
         ("tp2, 2 processes x 1 thread", 2, 2, "1", {}),
         ("tp2, gloo all-reduce (KILN_DIST_SHM=off)", 2, 2, "1", {"KILN_DIST_SHM": "off"})]


def _launch(nproc, tp, threads, steps, cpus, extra_env):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        env = dict(os.environ, OMP_NUM_THREADS=threads, NXD_CPU_MODE="1", **extra_env,
                   PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", SCRIPT, "--tp", str(tp), "--steps",
               str(steps), *MODEL, "--out", out]
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"the training benchmark ({nproc} processes, tp {tp}) failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def run(args) -> list:
    """One row per case: the step time (median of the steps after warm-up, in the least
    disturbed of ``--repeats`` launches; the cases alternate so that load from other
    processes falls on all of them), tokens/s, memory per rank."""
    runs = {case[0]: [] for case in CASES}
    for _ in range(args.repeats):
        for name, nproc, tp, threads, extra_env in CASES:
            report = _launch(nproc, tp, threads, args.steps, args.cpus, extra_env)
            runs[name].append((statistics.median(report["step_s"][args.warmup:]), report))
    rows, tokens = [], 8 * 128
    for name, nproc, tp, threads, extra_env in CASES:
        step, report = min(runs[name], key=lambda r: r[0])
        rows.append({"case": name, "tp": tp, "processes": nproc, "threads_per_process": int(threads),
                     "env": extra_env, "step_ms": step * 1e3, "step_ms_each_launch": [r[0] * 1e3 for r in runs[name]],
                     "tokens_per_s": tokens / step, "losses": report["losses"], "ranks": report["ranks"]})
    base = rows[0]["step_ms"]
    for row in rows:
        row["speed_vs_tp1"] = base / row["step_ms"]
    return rows


def table(rows) -> str:
    lines = ["| case | step ms (each launch) | tokens/s | × tp1 | per-rank RSS MB (peak) | per-rank params MB "
             "| per-rank optimizer state MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ranks = r["ranks"]
        rss = ", ".join(f"{x['rss_mb']:.0f} ({x['peak_rss_mb']:.0f})" for x in ranks)
        params = ", ".join(f"{x['param_bytes'] / 2**20:.1f}" for x in ranks)
        state = ", ".join(f"{x['optimizer_state_bytes'] / 2**20:.1f}" for x in ranks)
        each = ", ".join(f"{t:.0f}" for t in r["step_ms_each_launch"])
        lines.append(f"| {r['case']} | {r['step_ms']:.0f} ({each}) | {r['tokens_per_s']:.0f} | {r['speed_vs_tp1']:.2f} "
                     f"| {rss} | {params} | {state} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cpus", default="0,1", help="taskset CPU list both cases run on ('' for none)")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "dist-train.json"))
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    rows = run(args)
    print(table(rows))
    same = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(rows[1]["losses"], rows[0]["losses"]))
    print(f"losses tp2 == tp1 (rtol 1e-4): {same}; 1-minute load average before the run: {load:.2f} "
          f"on {os.cpu_count()} CPUs; target: tp2 step >= 0.8x tp1")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "machine": os.uname().machine, "cpus": os.cpu_count(),
                   "load_before": round(load, 2), "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
