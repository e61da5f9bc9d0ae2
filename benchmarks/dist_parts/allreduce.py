#!/usr/bin/env python
"""Part (c): what one all-reduce of a decode step's size costs between 2 ranks on one host.

Two processes x 1 thread, each pinned to its own kiln core (``kiln.distributed.launch.
start_ranks``), all-reduce a decode step's activation: ``[1,1,576]`` and ``[8,1,576]`` fp32
(SmolLM2-135M, batch 1 and 8) and ``[1,1,2048]`` (a 1.1B Llama); ``[1,128,2048]`` shows a
prefill chunk. Paths, measured in the same run on the same ranks:

* ``gloo``  ``torch.distributed.all_reduce`` on a copy (TorchGroup's path without shared memory)
* ``shm``   kiln's TorchGroup with its shared-memory all-reduce (:mod:`kiln.distributed.shm`),
  as ``torch.ops.kiln.all_reduce`` calls it
* ``dist``  ``torch.distributed.all_reduce`` on a ``"kiln_shm"`` group
  (:mod:`kiln.distributed.shm_backend`: the same shared memory behind torch's Python API)

Each call is timed on rank 0 alone, back to back (``gap 0``) and with ~150 µs of matmul
between calls on both ranks (``gap 150us``: ranks arrive at slightly different times, as
they do between two layers, so the waiting path is measured too). ``decode_share`` is 60
all-reduces (SmolLM2's 30 layers x 2) over a 20 ms decode step.

    python -m benchmarks.dist_parts.allreduce [--rounds 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = [(1, 1, 576), (8, 1, 576), (1, 1, 2048), (1, 128, 2048)]
DECODE_MS, PER_STEP = 20.0, 60


def _stats(times):
    times = sorted(times)
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6


def measure(info, payload):
    """Every rank runs this (the entry of ``start_ranks``); rank 0's rows are the result."""
    import torch
    import torch.distributed as dist

    from kiln.distributed import groups
    world = groups.get("world")
    world.all_reduce(torch.zeros(1))          # the group chooses its path here (KILN_DIST_SHM=on)
    if world.fast is None:
        raise RuntimeError(f"no shared-memory path: {world.choice}")
    via_dist = dist.new_group(backend="kiln_shm")
    a = torch.randn(64, 256)
    b = torch.randn(256, 256)
    rows = []
    for shape in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(info.rank))
        rounds = payload["rounds"] if shape[1] == 1 else max(20, payload["rounds"] // 20)
        for gap in (0, 150):
            for path, fn in (("gloo", lambda: dist.all_reduce(x.clone())), ("shm", lambda: world.all_reduce(x)),
                             ("dist", lambda: dist.all_reduce(x.clone(), group=via_dist))):
                times = []
                for i in range(rounds + 20):
                    if gap:
                        for _ in range(2):
                            a @ b
                    t = time.perf_counter()
                    fn()
                    if i >= 20:
                        times.append(time.perf_counter() - t)
                med, p90 = _stats(times)
                rows.append({"shape": list(shape), "path": path, "gap_us": gap, "median_us": round(med, 1),
                             "p90_us": round(p90, 1), "rounds": rounds,
                             "decode_share": round(PER_STEP * med / (DECODE_MS * 1e3), 3)})
    same = torch.equal(world.all_reduce(x), _gloo(x))
    return {"rows": rows, "shm_equals_gloo": same, "choice_probe": _probe(world)}


def _gloo(x):
    import torch.distributed as dist
    out = x.clone()
    dist.all_reduce(out)
    return out


def _probe(world):
    from kiln.distributed import shm
    from kiln.distributed.groups import TorchGroup
    auto = TorchGroup()
    auto.shm_mode = "auto"
    made, reason = shm.for_group(auto, "auto")
    if made is not None:
        made.close()
    return reason


def _rank0(rounds, out):
    os.environ["KILN_DIST_SHM"] = "on"
    from kiln.distributed import launch
    with launch.start_ranks(2, "benchmarks.dist_parts.allreduce:measure", {"rounds": rounds}) as ranks:
        result = ranks.call_entry()
        ranks.wait(120)
    with open(out, "w") as f:
        json.dump(result, f)


def run(rounds: int = 2000) -> list:
    """Rows of the table (runs the ranks in processes of their own: rank 0 pins itself)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        proc = subprocess.run([sys.executable, "-m", "benchmarks.dist_parts.allreduce", "--rank0", out,
                               "--rounds", str(rounds)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"the all-reduce benchmark failed:\n{proc.stderr[-4000:]}")
        with open(out) as f:
            result = json.load(f)
    for row in result["rows"]:
        row["shm_equals_gloo"] = result["shm_equals_gloo"]
        row["auto_probe"] = result["choice_probe"]
    return result["rows"]


def table(rows) -> str:
    lines = ["| shape | gap | gloo median / p90 µs | shm median / p90 µs | dist on kiln_shm median / p90 µs "
             "| speed-up | 60 x gloo / 20 ms | 60 x shm / 20 ms |",
             "|---|---|---|---|---|---|---|---|"]
    keyed = {(tuple(r["shape"]), r["gap_us"], r["path"]): r for r in rows}
    for (shape, gap, path), g in keyed.items():
        if path != "gloo":
            continue
        s, d = keyed[(shape, gap, "shm")], keyed[(shape, gap, "dist")]
        lines.append(f"| {list(shape)} | {gap} µs | {g['median_us']:.0f} / {g['p90_us']:.0f} | "
                     f"{s['median_us']:.0f} / {s['p90_us']:.0f} | {d['median_us']:.0f} / {d['p90_us']:.0f} | "
                     f"{g['median_us'] / s['median_us']:.1f}x | "
                     f"{g['decode_share']:.0%} | {s['decode_share']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "dist-allreduce.json"))
    p.add_argument("--rank0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank0:
        return _rank0(args.rounds, args.rank0)
    load = os.getloadavg()[0]
    rows = run(args.rounds)
    print(table(rows))
    print(f"1-minute load average before the run: {load:.2f} on {os.cpu_count()} CPUs "
          "(other processes on the cores slow gloo's wake-ups most)")
    print(f"shm result equals gloo's (sum of 2, fp32): {rows[0]['shm_equals_gloo']}; "
          f"KILN_DIST_SHM=auto's probe on this machine: {rows[0]['auto_probe']}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "machine": os.uname().machine, "cpus": os.cpu_count(), "load_before": round(load, 2),
                   "when": time.strftime("%Y-%m-%d %H:%M")}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
