"""Interleaved rounds of the single-stream rows (``benchmarks/llm.py --rounds``).

The 2-core machines these runs use change speed from one minute to the next: in one run
(2026-11-28) kiln's int8 and int8+bf16 builds, whose decode graphs are the same, decoded at
83.1 and 92.9 tok/s a minute apart, and each peer ran once, in its own minute. So after the
first pass every single-stream contender (each peer in a fresh process, each kiln build
loaded afresh) runs again, one after the other, ``rounds - 1`` more times; each keeps its best
decode rate and time to first token over the rounds, and every round's figures stay in the
JSON (``rounds``), so a ratio compares bests taken in the same stretch of minutes.
"""
from __future__ import annotations

import statistics


def _keep(row: dict, runs: list):
    """``row`` (a peer's or kiln's single-stream figures) takes the best over ``runs``."""
    rates = [r["decode_tok_s"] for r in runs if r and "decode_tok_s" in r]
    ttfts = [r["ttft_s"] for r in runs if r and "ttft_s" in r]
    if not rates:
        return
    row["rounds"] = [{"decode_tok_s": r.get("decode_tok_s"), "ttft_s": r.get("ttft_s")} for r in runs if r]
    row["decode_tok_s"], row["decode_tok_s_median"] = max(rates), statistics.median(rates)
    if ttfts:
        row["ttft_s"], row["ttft_s_median"] = min(ttfts), statistics.median(ttfts)
    if "step_ms" in row:
        row["step_ms"] = 1e3 / row["decode_tok_s"]


def interleave(res: dict, rounds: int, run_peer, run_kiln, log):
    """Run ``rounds - 1`` more rounds of every single-stream row that ran in ``res``.
    ``run_peer(name)`` and ``run_kiln(variant)`` give one run's figures (dicts with
    ``decode_tok_s`` and ``ttft_s``)."""
    if rounds <= 1:
        return
    peers = [p for p, r in res["peers"].items()
             if r and "decode_tok_s" in r and p not in ("hf-fp32", "llama-server")]
    variants = [v for v, k in res["kiln"].items() if k.get("single")]
    runs = {("peer", p): [dict(res["peers"][p])] for p in peers}
    runs.update({("kiln", v): [dict(res["kiln"][v]["single"])] for v in variants})
    for n in range(2, rounds + 1):
        for p in peers:
            log(f"round {n}/{rounds}: {p}")
            runs[("peer", p)].append(run_peer(p))
        for v in variants:
            log(f"round {n}/{rounds}: kiln {v}")
            runs[("kiln", v)].append(run_kiln(v))
    for p in peers:
        _keep(res["peers"][p], runs[("peer", p)])
    for v in variants:
        _keep(res["kiln"][v]["single"], runs[("kiln", v)])
        k = res["kiln"][v]
        if k.get("weights_mb"):
            k["achieved_gbs"] = k["weights_mb"] / 1e3 / (k["single"]["step_ms"] / 1e3)
    res["rounds"] = rounds
