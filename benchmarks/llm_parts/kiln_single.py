#!/usr/bin/env python
"""kiln's single-stream row of ``benchmarks/llm.py``, in a process of its own, as every peer
gets one (``peer.py``): the artifact loaded afresh, one warm-up run, then ``repeats`` timed
runs through a fresh scheduler each, greedy, ``new`` forced tokens on the given prompt ids.
Prints one JSON line: ``ttft_s`` (best), ``decode_tok_s`` (best: tokens after the first over
the time after the first), ``step_ms``, the tokens, the engines of the graphs and the batch
invariance report.

Why a process of its own: in the benchmark's own process (Hugging Face's model loaded and
run, the other variants loaded before), the same int8+bf16 artifact decoded at 61.6-67.5
tok/s against 72.7-74.2 in a fresh one, in one stretch on the 2-core machine (11-28).

    python benchmarks/llm_parts/kiln_single.py ARTIFACT --ids 1,2,3 --new 128 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def bench(llm, ids, new, repeats=2) -> dict:
    """Best time to first token and decode rate over ``repeats`` runs after a warm-up."""
    from kiln.runtime.scheduler import Request
    runs = []
    for _ in range(repeats + 1):                                       # the first is a warm-up
        sched = llm.scheduler()
        r = sched.add(Request(ids, new))
        sched.run()
        t = r.token_times
        runs.append({"ttft_s": t[0] - r.arrived, "decode_tok_s": (len(t) - 1) / (t[-1] - t[0])})
    timed = runs[1:] or runs
    best = {"ttft_s": min(x["ttft_s"] for x in timed), "decode_tok_s": max(x["decode_tok_s"] for x in timed)}
    best["step_ms"] = 1e3 / best["decode_tok_s"]
    best["tokens"] = r.tokens
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    import kiln
    llm = kiln.load(args.artifact, threads=args.threads)
    ids = [int(t) for t in args.ids.split(",")]
    out = bench(llm, ids, args.new, args.repeats)
    out["engines"] = {"prefill": {w: m.manifest.get("engines") for w, m in llm.prefill.items()},
                      "decode": {b: m.manifest.get("engines") for b, m in llm.decode.items()}}
    out["batch_invariance"] = llm.batch_invariance
    print(json.dumps(out))


if __name__ == "__main__":
    main()
