"""int4 weights with a float minimum per block, on ONNX Runtime's ``MatMulNBits``.

Each block of 32 weights along the input dim is stored as GGUF's Q4_1 stores it:
``w = d * q + m`` with ``q`` in 0..15, ``d = (max - min) / 15`` and ``m = min``. For weights
that came from a Q4_1 GGUF file (transformers dequantizes them) this recovers the file's
own blocks exactly; for other weights it is asymmetric int4 with a float zero point,
closer than symmetric int4 (the grid spans the block's range, not twice its largest
magnitude).

``MatMulNBits`` takes integer zero points only (its float-zero-point form exists but
falls back to dequantizing: 1.3 ms instead of 38 us for a 576x1536 product), so the
product is split in two exact parts::

    x @ w = sum_k x_k * d (q_k - 8)  +  sum_blocks (m + 8 d) * sum_{k in block} x_k
          = MatMulNBits(x; q, d)      +  MatMul(block_sums(x), m + 8 d)

The second part reads one float per block and output (a fifth of the int4 part's bytes);
inputs shared by several products (query, key and value) are summed once.

Why not symmetric int4 (ORT's own quantizer): SmolLM2-135M's weights are Q4_1 blocks,
and quantizing them again onto a symmetric grid failed kiln's accuracy gate (perplexity
x1.33, greedy agreement 64 %). Measured on its int4 decode step (2 cores, ORT alone):
logits within 0.67 of float32's instead of 9.8, at 11.5-12.5 instead of 9.0-10.2 ms
(same runs); merging the products that share an input took it to 11.0 ms in an experiment
(not built).
"""
from __future__ import annotations

import numpy as np

from kiln.engines import ort_once, ort_rewrites

BLOCK = 32


def blocks(weight: np.ndarray):
    """``weight`` ``[K, N]`` (K a multiple of :data:`BLOCK`) → ``(packed [N, K/32, 16]
    uint8, scales [N, K/32] float32, offsets [K/32, N] float32)``, where the weight is
    ``scales * (q - 8) + offsets`` blockwise; ``q`` packed two per byte, low nibble first,
    as ``MatMulNBits`` reads them."""
    k, n = weight.shape
    w = weight.T.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    low, high = w.min(-1), w.max(-1)
    scale = (high - low) / 15.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint((w - low[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale.astype(np.float32), (low + 8 * scale).T.astype(np.float32).copy()


def dequantized(packed: np.ndarray, scales: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The ``[K, N]`` weight :func:`blocks` encodes (for tests and checks)."""
    q = np.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:2], BLOCK).astype(np.float32)
    n, nb = scales.shape
    w = scales[..., None] * (q - 8) + offsets.T[..., None]
    return w.reshape(n, nb * BLOCK).T


def value_ranks(graph) -> dict:
    """Each value's rank, where the graph knows its shape (the block sums reshape by it)."""
    return {v.name: len(v.type.tensor_type.shape.dim) for v in list(graph.value_info) + list(graph.input)
            if v.type.tensor_type.HasField("shape")}


def with_offsets(graph, sums: dict, product, x: str, rank: int, block: int, name: str, output: str,
                 tag: str = "kiln_int4") -> list:
    """The nodes making ``output = product + block_sums(x) @ offsets``. ``product`` is the
    symmetric ``MatMulNBits`` writing ``name + "/main"`` (its ``K`` attribute the input dim);
    ``name + "/offsets"``, the ``[K / block, N]`` initializer of each block's offset, must be
    in the graph. An activation's per-block sums are computed once per rewrite: ``sums`` maps
    ``(x, block)`` to their value, shared by every product reading ``x``; ``tag`` keeps the
    names of two rewrites of one graph (:mod:`~kiln.engines.ort_blocks`, then this module's)
    apart."""
    from onnx import helper, numpy_helper
    k = next(helper.get_attribute_value(a) for a in product.attribute if a.name == "K")
    out, key = [], (x, block)
    if key not in sums:
        sums[key] = f"{x}/{tag}_block_sums_{block}"
        shape = [0] * (rank - 1) + [k // block, block]
        graph.initializer.extend([numpy_helper.from_array(np.array(shape, np.int64), sums[key] + "/shape"),
                                  numpy_helper.from_array(np.array([-1], np.int64), sums[key] + "/axis")])
        out.append(helper.make_node("Reshape", [x, sums[key] + "/shape"], [sums[key] + "/blocks"],
                                    name=sums[key] + "/reshape"))
        out.append(helper.make_node("ReduceSum", [sums[key] + "/blocks", sums[key] + "/axis"], [sums[key]],
                                    name=sums[key] + "/sum", keepdims=0))
    return out + [product,
                  helper.make_node("MatMul", [sums[key], name + "/offsets"], [name + "/offset"], name=name + "/offset"),
                  helper.make_node("Add", [name + "/main", name + "/offset"], [output], name=name + "/add")]


def apply(model, nodes: list, accuracy_level: int) -> list:
    """Replace the constant-weight MatMuls named in ``nodes`` (weights ``[K, N]``, K a
    multiple of :data:`BLOCK`, activation rank known) in ``model`` in place; the names of
    those left for another quantizer."""
    from onnx import helper, numpy_helper
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    ranks = value_ranks(graph)
    wanted, left, sums, out = set(nodes), [], {}, []
    for n in graph.node:
        weight = inits.get(n.input[1]) if n.op_type == "MatMul" and n.name in wanted else None
        rank = ranks.get(n.input[0]) if weight is not None else None
        if weight is None or len(weight.dims) != 2 or weight.dims[0] % BLOCK or not rank:
            if n.name in wanted:
                left.append(n.name)
            out.append(n)
            continue
        k, cols = weight.dims
        w = numpy_helper.to_array(weight)
        packed, scales, offsets = ort_once.once("q4_1", w, (BLOCK,), lambda: blocks(w))
        name = n.name + "/kiln_int4"
        graph.initializer.extend([numpy_helper.from_array(packed, name + "/q"),
                                  numpy_helper.from_array(scales, name + "/scales"),
                                  numpy_helper.from_array(offsets, name + "/offsets")])
        product = helper.make_node("MatMulNBits", [n.input[0], name + "/q", name + "/scales"], [name + "/main"],
                                   name=name, domain="com.microsoft", K=k, N=cols, bits=4, block_size=BLOCK,
                                   accuracy_level=accuracy_level)
        out += with_offsets(graph, sums, product, n.input[0], rank, BLOCK, name, n.output[0])
    ort_rewrites.replace_nodes(model, out, microsoft=True)
    return left
