#!/usr/bin/env python
"""Encoder-decoder generation: ``NeuronModelForSeq2SeqLM`` (kiln, with and without its KV
cache) against transformers eager (with and without its cache), in one process.

Model: a random-weight T5 the size of t5-small (``d_model=512, d_ff=2048``, 6+6 layers, 8
heads, 32,128 tokens; nothing is downloaded), batch 1, a 64-token input, ``--new`` forced new
tokens (``min_new_tokens`` = ``max_new_tokens``, so every run decodes the same number), greedy,
``--threads`` threads. Each configuration's tokens must equal transformers' cached greedy
tokens, and kiln's per-step logits are compared with eager's. Timing: ``--reps`` rounds, each
running every configuration once in turn, so a shared machine's drift lands on all; the table
gives the median ms per token and each one's ratio to kiln's cached decoder (median of the
per-round ratios).

Usage::

    python benchmarks/seq2seq.py                 # t5-small size, -O2 exports (~2 minutes on 2 cores)
    python benchmarks/seq2seq.py --quick         # a tiny T5: a smoke test

Results: a table on stdout and JSON (default ``benchmarks/results/seq2seq.json``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--optlevel", default="2")
    p.add_argument("--json", default=str(HERE / "results" / "seq2seq.json"))
    args = p.parse_args(argv)
    import torch
    import transformers

    from kiln.optimum.neuron import NeuronModelForSeq2SeqLM
    torch.set_num_threads(args.threads)
    size = (dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=128) if args.quick else
            dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, vocab_size=32128))
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        cfg = transformers.T5Config(**size, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        transformers.T5ForConditionalGeneration(cfg).eval().save_pretrained(d)
        hf = transformers.T5ForConditionalGeneration.from_pretrained(d).eval()
        ids = torch.randint(2, size["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        models, compile_s = {}, {}
        for cached in (True, False):
            t = time.perf_counter()
            models[cached] = NeuronModelForSeq2SeqLM.from_pretrained(
                d, export=True, batch_size=1, sequence_length=64, optlevel=args.optlevel, decoder_kv_cache=cached,
                disable_neuron_cache=True)
            compile_s[cached] = round(time.perf_counter() - t, 1)
        res = _run(hf, models, ids, mask, args.new, args.reps)
    res.update(model="T5 " + ("tiny" if args.quick else "t5-small size (random weights)"), threads=args.threads,
               new_tokens=args.new, optlevel=args.optlevel,
               export_seconds={"kiln, KV cache": compile_s[True], "kiln, no cache": compile_s[False]})
    _table(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


def _run(hf, models, ids, mask, new, reps) -> dict:
    import torch
    gen = dict(max_new_tokens=new, min_new_tokens=new)

    def eager(cache):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, use_cache=cache, **gen)

    runs = {"kiln, KV cache": lambda: models[True].generate(ids, attention_mask=mask, **gen),
            "kiln, no cache": lambda: models[False].generate(ids, attention_mask=mask, **gen),
            "transformers eager, cache": lambda: eager(True),
            "transformers eager, no cache": lambda: eager(False)}
    want = runs["transformers eager, cache"]()
    same = {name: fn().tolist() == want.tolist() for name, fn in runs.items()}
    times = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) / new * 1e3)
    base = times["kiln, KV cache"]
    rows = {k: {"ms_per_token": round(statistics.median(v), 2),
                "x_kiln_cached": round(statistics.median([b / a for a, b in zip(base, v)]), 2),
                "tokens_equal_transformers": same[k]} for k, v in times.items()}
    return {"rows": rows, "max_abs_logit_difference": _logits(hf, models[True], ids, mask, want, new)}


def _logits(hf, model, ids, mask, tokens, new) -> float:
    import torch
    with torch.no_grad():
        hidden = hf.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        want = hf(encoder_outputs=(hidden,), attention_mask=mask, decoder_input_ids=tokens[:, :new],
                  use_cache=False).logits
    cache = model.new_cache()
    return max(float((model.decode(tokens[:, t:t + 1], hidden, mask, cache=cache)[:, 0] - want[:, t]).abs().max())
               for t in range(new))


def _table(res) -> None:
    print(f"\n{res['model']}, batch 1, 64 input tokens, {res['new_tokens']} new tokens, {res['threads']} threads, "
          f"-O{res['optlevel']}")
    print(f"{'':32s} {'ms/token':>9s} {'x kiln cached':>14s} {'tokens = HF':>12s}")
    for name, r in res["rows"].items():
        print(f"{name:32s} {r['ms_per_token']:9.2f} {r['x_kiln_cached']:14.2f} {str(r['tokens_equal_transformers']):>12s}")
    print(f"kiln's per-step logits vs eager: max abs difference {res['max_abs_logit_difference']:.2e}; "
          f"exports: {res['export_seconds']}")


if __name__ == "__main__":
    sys.exit(main())
