"""Part (a): tensor-parallel LLM serving, SmolLM2-135M-Instruct (real weights) at tp 1 and tp 2.

Both artifacts are compiled fp32 with the same options (batch 8, one context bucket,
cache 256, ``optlevel=1``) and loaded with ``kiln.load``: tp 1 with 2 engine threads in
this process, tp 2 as 2 processes x 1 thread (``TensorParallelLLM.start()``'s default:
rank 0 is this process, pinned to its core, rank 1 a child pinned to the other). tp 1 runs
first because starting the ranks pins this process.

Measured: time to first token (one ~121-token prompt), single-stream decode tokens/s
(128 greedy tokens, ``stop_at_eos=False``), 8 prompts at once through ``llm.generate``
(aggregate tokens/s), greedy agreement of tp 2 with tp 1 over 128 tokens (leading run and
overall), resident memory of every rank, compile seconds, and for tp 2 where a decode step
goes: its engine partitions and host (collective) steps from the graph's manifest.
"""
from __future__ import annotations

import os
import statistics
import time

from benchmarks.llm import TEXT, gguf_path  # the same file and prompt text as the LLM benchmark

BUILD = dict(batch_size=8, context_buckets=(128,), cache_length=256, optlevel=1)


def log(msg):
    import sys
    print(f"[dist-llm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mb(pid=None) -> float:
    import psutil
    return psutil.Process(pid).memory_info().rss / 2**20


def compile_both(work: str, reuse: bool) -> dict:
    """Compile tp 1 and tp 2 (or reuse the files from an earlier run); seconds each."""
    from kiln.llm.build import compile_llm
    from kiln.llm.source import load_pretrained
    model, tok = load_pretrained(gguf_path())
    out = {}
    for tp in (1, 2):
        path = os.path.join(work, f"smollm2-tp{tp}.kiln")
        if reuse and os.path.exists(path):
            secs = open(path + ".seconds").read().strip() if os.path.exists(path + ".seconds") else None
            out[tp] = {"path": path, "compile_s": float(secs) if secs else None}
            continue
        log(f"compile tp {tp}")
        t0 = time.perf_counter()
        llm = compile_llm(model, tokenizer=tok, tp_degree=tp, **BUILD)
        secs = time.perf_counter() - t0
        llm.save(path)
        with open(path + ".seconds", "w") as f:
            f.write(f"{secs:.1f}\n")
        out[tp] = {"path": path, "compile_s": secs}
        log(f"compiled tp {tp} in {secs:.1f} s")
        del llm
    return out, tok


def single_stream(llm, ids, new, repeats=2) -> dict:
    """Best of ``repeats`` runs after a warm-up: time to first token, decode tokens/s."""
    from kiln.runtime.scheduler import Request
    runs = []
    for i in range(repeats + 1):
        sched = llm.scheduler()
        r = Request(ids, new)
        sched.add(r)
        sched.run()
        t = r.token_times
        if i:
            runs.append({"ttft_s": t[0] - r.arrived, "decode_tok_s": (len(t) - 1) / (t[-1] - t[0]),
                         "step_ms": (t[-1] - t[0]) / (len(t) - 1) * 1e3, "tokens": list(r.tokens)})
    best = {"ttft_s": min(x["ttft_s"] for x in runs), "decode_tok_s": max(x["decode_tok_s"] for x in runs),
            "step_ms": min(x["step_ms"] for x in runs), "tokens": runs[-1]["tokens"],
            "decode_tok_s_each": [round(x["decode_tok_s"], 1) for x in runs]}
    return best


def multi_stream(llm, prompts, new) -> dict:
    llm.generate(prompts[:2], 4, stop_at_eos=False)                  # warm-up of the batch graphs
    t0 = time.perf_counter()
    outs = llm.generate(prompts, new, stop_at_eos=False)
    wall = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    return {"streams": len(prompts), "stream_tokens": n, "wall_s": wall, "aggregate_tok_s": n / wall}


def graph_shape(llm) -> dict:
    """Engine partitions and host steps of the 1-row decode graph (collectives run on the host)."""
    m = llm.leader.decode[1].manifest if hasattr(llm, "leader") else llm.decode[1].manifest
    parts = m.get("partitions", [])
    steps = m.get("program", {}).get("steps", [])
    kinds = {}
    for s in steps:
        k = s.get("kind") or s.get("op") or s.get("type") or "?" if isinstance(s, dict) else type(s).__name__
        kinds[str(k)] = kinds.get(str(k), 0) + 1
    return {"partitions": len(parts), "program_steps": len(steps), "step_kinds": kinds,
            "engines": sorted({p.get("engine", "?") for p in parts})}


def time_decode_step(llm, rounds=40) -> float:
    """Median ms of one 1-row decode step through the scheduler, measured from token times."""
    from kiln.runtime.scheduler import Request
    sched = llm.scheduler()
    r = Request(list(range(1, 9)), rounds + 1)
    sched.add(r)
    sched.run()
    t = r.token_times
    return statistics.median(b - a for a, b in zip(t, t[1:])) * 1e3


def measure(tp, path, ids, prompts, new) -> dict:
    import kiln
    base = rss_mb()
    t0 = time.perf_counter()
    llm = kiln.load(path, threads=2) if tp == 1 else kiln.load(path)
    row = {"tp": tp, "load_s": time.perf_counter() - t0, "rss_before_load_mb": base}
    if tp == 2:
        t0 = time.perf_counter()
        llm.start()                                                  # default: processes, pinned
        row["start_s"] = time.perf_counter() - t0
        row["mode"] = llm.mode
    log(f"tp {tp}: single stream")
    row.update(single_stream(llm, ids, new))
    log(f"tp {tp}: {len(prompts)} streams")
    row.update(multi_stream(llm, prompts, new))
    row["decode_step_ms_median"] = time_decode_step(llm)
    row["graph"] = graph_shape(llm)
    row["rss_mb"] = {"rank0": rss_mb()}
    if tp == 2:
        for r, pid in llm._launched.pids.items():
            row["rss_mb"][f"rank{r}"] = rss_mb(pid)
        llm.close()
    return row


def agreement(a, b) -> dict:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    same = sum(x == y for x, y in zip(a, b))
    return {"leading": n, "leading_frac": n / len(a), "overall_frac": same / len(a), "of": len(a)}


def rank_weight_mb(path) -> dict:
    """Bytes of each rank's nested artifact (weights dominate it)."""
    from kiln.artifact.container import Artifact
    with open(path, "rb") as f:
        art = Artifact.from_bytes(f.read())
    return {k: len(v) / 2**20 for k, v in art.blobs.items() if k.startswith("rank/")}


def run(work: str, reuse: bool = False, new: int = 128, prompt_len: int = 121) -> dict:
    """Compile, then measure tp 1 and tp 2 (in that order); the rows and the comparisons."""
    os.makedirs(work, exist_ok=True)
    compiled, tok = compile_both(work, reuse)
    ids = tok.encode(TEXT * 8)[:prompt_len]
    prompts = [tok.encode(TEXT * 8)[i * 7:i * 7 + prompt_len] for i in range(8)]
    rows = {}
    for tp in (1, 2):
        rows[tp] = measure(tp, compiled[tp]["path"], ids, prompts, new)
        rows[tp]["compile_s"] = compiled[tp]["compile_s"]
        rows[tp]["artifact_mb"] = os.path.getsize(compiled[tp]["path"]) / 2**20
    try:
        rows[2]["rank_artifact_mb"] = rank_weight_mb(compiled[2]["path"])
    except Exception as e:                                          # informative only
        rows[2]["rank_artifact_mb"] = f"unavailable: {e}"
    agree = agreement(rows[1]["tokens"], rows[2]["tokens"])
    return {"rows": [rows[1], rows[2]], "agreement": agree,
            "decode_ratio": rows[2]["decode_tok_s"] / rows[1]["decode_tok_s"],
            "aggregate_ratio": rows[2]["aggregate_tok_s"] / rows[1]["aggregate_tok_s"],
            "prompt_tokens": len(ids), "new_tokens": new, "build": {**BUILD, "context_buckets": [128]}}


def table(res) -> str:
    lines = ["| tp | layout | compile s | load s | TTFT ms | decode tok/s (step ms) | 8-stream tok/s "
             "| RSS MB per rank | decode graph partitions / steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        layout = "1 proc x 2 threads" if r["tp"] == 1 else "2 procs x 1 thread"
        rss = ", ".join(f"{v:.0f}" for v in r["rss_mb"].values())
        comp = f"{r['compile_s']:.0f}" if r["compile_s"] is not None else "reused"
        lines.append(f"| {r['tp']} | {layout} | {comp} | {r['load_s']:.2f} | {r['ttft_s'] * 1e3:.0f} | "
                     f"{r['decode_tok_s']:.1f} ({r['step_ms']:.1f}) | {r['aggregate_tok_s']:.1f} | {rss} | "
                     f"{r['graph']['partitions']} / {r['graph']['program_steps']} |")
    a = res["agreement"]
    lines.append(f"\ntp2/tp1 decode: {res['decode_ratio']:.2f}x (target >= 0.9); 8-stream: "
                 f"{res['aggregate_ratio']:.2f}x; greedy agreement over {a['of']} tokens: leading "
                 f"{a['leading']} ({a['leading_frac']:.0%}), overall {a['overall_frac']:.0%} (target >= 95%)")
    return "\n".join(lines)
