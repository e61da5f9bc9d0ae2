"""Speculative decoding in kiln's scheduler on SmolLM2-135M-Instruct (real weights, CPU):
the fp32 target alone, with the int4 build of the same model drafting, and with n-gram
(prompt lookup) drafting; one stream and ``--streams`` at once; on an ordinary prompt and
on one whose answer quotes it.

Reported per case: decode tokens/s (each stream's tokens after its first, over the time
from its first token to its last, summed over streams), the speed-up over the target
alone in the same round, draft tokens proposed / accepted, and whether every stream's
tokens equal the target's alone (greedy). Rounds alternate the modes, so a machine
shared with other work slows them alike; only ratios from one run mean anything.

    python benchmarks/llm_speculative.py                   # compile (cached in --work), measure
    python benchmarks/llm_speculative.py --reuse --rounds 3

Writes ``benchmarks/results/llm_speculative.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import latency  # noqa: E402  (machine info)
from llm import TEXT, gguf_path  # noqa: E402  (benchmarks/llm.py: the GGUF file and its prompt text)


def log(msg):
    print(f"[llm-spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def prompts(tok, n: int) -> dict:
    """``plain``: the benchmark text continued; ``quote``: a chat asking for it word for
    word (the answer quotes the prompt: what n-gram drafting is for)."""
    plain = tok.encode(TEXT * 8)[:n]
    passage = tok.decode(tok.encode(TEXT)[: max(16, n - 40)])
    quote = tok.apply_chat_template([{"role": "user", "content": "Repeat this text word for word:\n\n" + passage}],
                                    add_generation_prompt=True)
    quote = quote["input_ids"] if hasattr(quote, "keys") else quote
    return {"plain": plain, "quote": list(quote)[:n]}


def build(model, tok, args, work: Path, name: str, **options):
    """Compile one LLM (kiln's compile cache makes a repeated run cheap); with --save, also
    write it to --work, and with --reuse load it from there. Not saved by default: the fp32
    target's five graphs are 2.7 GB, whose saving ran a 23 GB machine shared with other
    work out of memory."""
    import kiln
    path = work / f"smollm2-{name}-b{args.streams}-c{args.cache}-k{args.k}.kiln"
    if args.reuse and path.exists():
        return kiln.load(path, threads=args.threads)
    from kiln.llm.build import compile_llm
    t0 = time.perf_counter()
    llm = compile_llm(model, batch_size=args.streams, context_buckets=(args.prompt,), cache_length=args.cache,
                      tokenizer=tok, on_graph=lambda g, i, n, s: log(f"{name}: compiled {g} ({i}/{n}) in {s:.1f}s"),
                      **options)
    log(f"{name}: compiled in {time.perf_counter() - t0:.0f}s")
    if args.save:
        llm.save(path)
    return llm


def eager_llm(model, args):
    """An LLM whose graphs are the uncompiled DecoderSteps (the same modules kiln compiles)."""
    from kiln.llm.decoder import DecoderStep, cache_shape
    from kiln.runtime.llm import FORMAT, LLM
    prefill = DecoderStep(model, with_cache=False, last_only=True).eval()
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    rows = sorted({1, args.streams})
    meta = {"format": FORMAT, "batch_size": args.streams, "decode_batches": rows, "context_buckets": [args.prompt],
            "speculation_length": args.k, "cache_shape": list(cache_shape(model.config, args.streams, args.cache)),
            "vocab_size": model.config.vocab_size, "eos_token_ids": []}
    return LLM({args.prompt: prefill}, {b: step for b in rows}, meta, {}, manifest={"kind": "llm"},
               verify={b: step for b in rows})


def run(target, draft, prompt: list, streams: int, new: int) -> dict:
    """``streams`` copies of ``prompt`` through one scheduler (speculative with ``draft``)."""
    from kiln.runtime.scheduler import Request
    sched = target.scheduler() if draft is None else target.scheduler(draft=draft)
    requests = [sched.add(Request(prompt, new)) for _ in range(streams)]
    t0 = time.perf_counter()
    sched.run()
    wall = time.perf_counter() - t0
    rate = 0.0
    for r in requests:
        t = r.token_times
        rate += (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0
    return {"tokens": [r.tokens for r in requests], "decode_tok_s": rate, "wall_s": wall,
            "proposed": sched.draft_proposed, "accepted": sched.draft_accepted}


def measure(target, drafts: dict, texts: dict, args) -> list:
    rows = []
    for text, prompt in texts.items():
        for streams in sorted({1, args.streams}):
            samples = {mode: [] for mode in ["target", *drafts]}
            for _ in range(args.rounds):
                for mode in samples:
                    log(f"{text}, {streams} stream(s): {mode}")
                    samples[mode].append(run(target, drafts.get(mode), prompt, streams, args.new))
            alone = samples["target"]
            for mode, runs in samples.items():
                best = max(runs, key=lambda r: r["decode_tok_s"])
                base = max(r["decode_tok_s"] for r in alone)
                rows.append({"prompt": text, "streams": streams, "mode": mode,
                             "decode_tok_s": best["decode_tok_s"], "speedup": best["decode_tok_s"] / base,
                             "speedups_per_round": [r["decode_tok_s"] / a["decode_tok_s"] for r, a in zip(runs, alone)],
                             "proposed": best["proposed"], "accepted": best["accepted"],
                             "acceptance": best["accepted"] / best["proposed"] if best["proposed"] else None,
                             "equal_to_target": all(r["tokens"] == alone[0]["tokens"] for r in runs)})
    return rows


def render(res) -> str:
    out = [f"SmolLM2-135M-Instruct fp32 target ({res['graphs']} graphs), k={res['k']}, {res['new_tokens']} new tokens, "
           f"{res['threads']} threads ({res['date']})", "",
           "| prompt | streams | drafting | decode tok/s | speed-up | accepted / proposed | same tokens |",
           "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        acc = "-" if r["acceptance"] is None else f"{r['accepted']}/{r['proposed']} ({r['acceptance']:.0%})"
        out.append(f"| {r['prompt']} | {r['streams']} | {r['mode']} | {r['decode_tok_s']:.1f} | "
                   f"{r['speedup']:.2f}x | {acc} | {'yes' if r['equal_to_target'] else 'NO'} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens / the context bucket (default 128)")
    p.add_argument("--new", type=int, default=96, help="generated tokens per stream (default 96)")
    p.add_argument("--streams", type=int, default=4, help="streams at once, also the batch size (default 4)")
    p.add_argument("--k", type=int, default=4, help="speculation length (default 4)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--save", action="store_true", help="save the compiled artifacts in --work")
    p.add_argument("--eager", action="store_true",
                   help="run the target's steps as eager PyTorch modules instead of compiling (minutes "
                        "less on a busy machine; n-gram drafting only): the scheduler and acceptance are "
                        "kiln's, the per-step speed PyTorch's")
    p.add_argument("--reuse", action="store_true", help="load the artifacts an earlier --save run wrote")
    p.add_argument("--work", default=os.path.expanduser("~/.cache/kiln/llm-spec-bench"))
    p.add_argument("--json", default=str(HERE / "results" / "llm_speculative.json"))
    args = p.parse_args(argv)
    args.cache = args.prompt + args.new + args.k
    torch.set_num_threads(args.threads)
    from kiln.llm.source import load_pretrained
    model, tok = load_pretrained(gguf_path())
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.eager:
        target, drafts = eager_llm(model, args), {"n-gram": "ngram"}
    else:
        target = build(model, tok, args, work, "fp32-verify", speculation_length=args.k)
        drafts = {"int4 draft": build(model, tok, args, work, "int4", quantize="int4"), "n-gram": "ngram"}
        del model
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": latency.machine_info(args.threads),
           "k": args.k, "new_tokens": args.new, "threads": args.threads, "streams": args.streams,
           "graphs": "eager PyTorch" if args.eager else "compiled"}
    res["rows"] = measure(target, drafts, prompts(tok, args.prompt), args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(render(res))


if __name__ == "__main__":
    main()
