"""One SmolLM2-135M layer's seven decode-step products (one token in) with weights kept in
each GGUF type (``kiln.engines.ort_blocks`` on ONNX Runtime, accuracy level 4, 2 threads),
timed in interleaved rounds in one process: ratios to Q4_1 (kiln's int4 layout) are what
this measures; absolute times depend on the machine's load (docs/llm.md, "GGUF file types").

A K-quant row falls back as llama.cpp does where a row is not a multiple of 256 (SmolLM2's
576-wide rows): "Q4_K" is six Q5_0 products and a Q4_K ``ffn_down``, and so on.

    python benchmarks/llm_gguf_kernels.py
"""
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kiln.engines import ort_blocks  # noqa: E402
from kiln.llm import gguf_blocks  # noqa: E402
from tests import gguf_files  # noqa: E402

shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]   # (K, N)
rng = np.random.default_rng(0)
Ws = [(0.03 * rng.standard_normal((n, k))).astype(np.float32) for k, n in shapes]
def build(kind):
    nodes, inits, table = [], [], {}
    for i, ((k, n), w) in enumerate(zip(shapes, Ws)):
        src = "x" if k == 576 else "h"
        if kind != "F32":
            t = kind if k % 256 == 0 or kind[-1] != "K" else gguf_files.K_FALLBACK[kind]
            kept = gguf_blocks.kept(gguf_files.quantize(w, t), t, k)
            wk = kept.dequantized(); table[ort_blocks.fingerprint(wk)] = kept
        else:
            wk = np.ascontiguousarray(w.T)
        inits.append(numpy_helper.from_array(wk, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [src, f"w{i}"], [f"y{i}"], name=f"m{i}"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 576]),
                                       helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 1, 1536])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(7)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with ort_blocks.keeping(table):
        ort_blocks.apply(m, [f"m{i}" for i in range(7)], 4)
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
kinds = ["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
sess = {k: build(k) for k in kinds}
feeds = {"x": rng.standard_normal((1, 1, 576)).astype(np.float32), "h": rng.standard_normal((1, 1, 1536)).astype(np.float32)}
times = {k: [] for k in kinds}
for r in range(7):
    for k in kinds:
        s = sess[k]
        for _ in range(20): s.run(None, feeds)
        t = time.perf_counter()
        for _ in range(300): s.run(None, feeds)
        times[k].append((time.perf_counter() - t) / 300 * 1e6)
base = statistics.median(times["Q4_1"])
for k in kinds:
    m = statistics.median(times[k]); print(f"{k:5s} median {m:7.1f} us  x{m / base:.2f} of Q4_1  (min {min(times[k]):.1f})")
