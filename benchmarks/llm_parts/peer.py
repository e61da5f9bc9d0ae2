#!/usr/bin/env python
"""One single-stream peer of ``benchmarks/llm.py``, in a process of its own (so no peer
shares a process with another's threads, model or allocator): llama.cpp through
``llama-cpp-python``, OpenVINO GenAI's ``LLMPipeline`` or ONNX Runtime GenAI, on the same
prompt ids, greedy, ``new`` forced tokens. Prints one JSON line: ``ttft_s``,
``decode_tok_s`` (tokens after the first over the time after the first, by the wall
clock), the peer's own metrics where it has them, the tokens, or ``{"missing": why}``
when the peer is not installed.

    python benchmarks/llm_parts/peer.py {llama.cpp,openvino-genai,ort-genai} --model PATH --ids 1,2,3 --new 128
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def llamacpp(path, ids, new, threads) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    llm.create_completion(ids, max_tokens=2, temperature=0)            # warm-up
    best = None
    for _ in range(2):
        llm.reset()             # else it reuses the previous run's KV cache for the same prompt
        times = []
        t0 = time.perf_counter()
        for chunk in llm.create_completion(ids, max_tokens=new, temperature=0, stream=True):
            times.append(time.perf_counter())
        run = {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}
        best = run if best is None or run["decode_tok_s"] > best["decode_tok_s"] else best
    return dict(best, version=llama_cpp.__version__)


def openvino_genai(path, ids, new, threads) -> dict:
    """``LLMPipeline`` on the GGUF file itself, at OpenVINO GenAI's own defaults for the CPU
    (its stateful model, compressed weights as the file has them, dynamic quantization and
    the KV-cache precision it picks), threads pinned. Its own TTFT and TPOT, and the wall clock."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og
    t0 = time.perf_counter()
    pipe = og.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads)
    load = time.perf_counter() - t0

    def inputs(first):
        x = np.array([[first] + ids[1:]], dtype=np.int64)
        return og.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))

    def generate(n, first):
        cfg = og.GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, ignore_eos=True)
        t0 = time.perf_counter()
        res = pipe.generate(inputs(first), cfg)
        return res, time.perf_counter() - t0

    # Its CPU pipeline may keep a prompt's keys and values for the next request with the same
    # prefix (prefix caching): each timed call starts with a token no earlier call started with,
    # so every prefill is a whole one; the prompt itself gives the tokens compared with the others'.
    generate(2, ids[0])                                                # warm-up
    tokens = [int(t) for t in generate(new, ids[0])[0].tokens[0]]
    best = None
    for k in range(2):
        _, ttft = generate(1, ids[0] + 1 + 2 * k)
        res, wall = generate(new, ids[0] + 2 + 2 * k)
        m = res.perf_metrics
        run = {"ttft_s": ttft, "decode_tok_s": (new - 1) / (wall - ttft), "wall_s": wall,
               "own_ttft_s": m.get_ttft().mean / 1e3, "own_tpot_ms": m.get_tpot().mean,
               "own_decode_tok_s": 1e3 / m.get_tpot().mean, "tokens": tokens}
        best = run if best is None or run["decode_tok_s"] > best["decode_tok_s"] else best
    return dict(best, version=og.__version__, load_s=load)


def ort_genai(folder, ids, new, threads) -> dict:
    """ONNX Runtime GenAI on a model its own builder made (``folder``)."""
    import onnxruntime_genai as og
    config = og.Config(folder)
    config.clear_providers()
    model = og.Model(config)

    def generate(n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(model, params)
        times, t0 = [], time.perf_counter()
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
            times.append(time.perf_counter())
        return t0, times, list(gen.get_sequence(0))[len(ids):]

    generate(2)
    best = None
    for _ in range(2):
        t0, times, tokens = generate(new)
        run = {"ttft_s": times[0] - t0, "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
               "tokens": [int(t) for t in tokens]}
        best = run if best is None or run["decode_tok_s"] > best["decode_tok_s"] else best
    return dict(best, version=og.__version__)


PEERS = {"llama.cpp": ("llama_cpp", llamacpp), "openvino-genai": ("openvino_genai", openvino_genai),
         "ort-genai": ("onnxruntime_genai", ort_genai)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peer", choices=sorted(PEERS))
    p.add_argument("--model", required=True, help="the GGUF file (ort-genai: its model folder)")
    p.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    module, fn = PEERS[args.peer]
    try:
        __import__(module)
    except ImportError as e:
        print(json.dumps({"missing": f"{module} is not installed ({e})"}))
        return
    ids = [int(i) for i in args.ids.split(",")]
    print(json.dumps(fn(args.model, ids, args.new, args.threads)))


if __name__ == "__main__":
    sys.exit(main())
