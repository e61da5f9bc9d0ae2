"""Weights kept in the blocks a file stored them in, on ONNX Runtime's ``MatMulNBits``.

A GGUF file stores each matrix in blocks along its input dim (Q8_0, Q4_K, Q6_K ...).
Requantizing the dequantized weights onto kiln's own grid (``quantize="int8"``/``"int4"``)
rounds them a second time; keeping the file's blocks does not: each block's integer
values and scale go to ``MatMulNBits`` as they are, so the kernel multiplies by exactly
the weights the file holds. This module is the engine side and knows no file format:
the caller (:mod:`kiln.llm.gguf_keep`) describes each weight as a :class:`Kept` and
activates a table of them for the length of a compile; :func:`apply`, called by
:mod:`kiln.engines.ort_quantize` before its own quantizers, rewrites the MatMuls whose
constant weight is in the table. A weight is found by its content (a hash of the
``[K, N]`` array the exported graph holds): the exporter renames and transposes
weights, but never changes a value.

Two forms, both ``w = scale * (u - 2**(bits-1)) [+ offset]`` per block of ``block``
weights along K:

* symmetric (``offsets is None``): ``MatMulNBits`` alone, its default zero point;
* with a float offset per block (GGUF's Q4_1/Q5_1/K-quants' minimum): the product is
  split as in :mod:`kiln.engines.ort_int4`, ``MatMulNBits(x) + block_sums(x) @ offsets``,
  because ``MatMulNBits`` with float zero points falls back to dequantizing.

``bits`` is 4 or 8: 5- and 6-bit values (Q5_*, Q6_K) are stored in 8 bits, exactly
(the kernel has no 5- or 6-bit form; 8 bits hold them with room to spare). ``block`` is
16 or 32 (Q6_K's sub-blocks are 16 wide; ``MatMulNBits`` takes 16-wide 8-bit blocks, and
on a 2-core AVX2 machine ran a 576x1536 product at 110 us against 129 us for 32-wide
blocks in one run).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import xxhash

from kiln.engines import ort_int4, ort_rewrites
from kiln.engines.onnx_products import BLOCKS_DOC

_TABLES: list = []


@dataclass
class Kept:
    """One weight ``[K, N]`` as blocks: ``u`` ``[N, K/block, block]`` uint8 in
    ``0 .. 2**bits - 1``, ``scales`` ``[N, K/block]`` float32, ``offsets`` ``[K/block, N]``
    float32 or None; ``label`` names the file's type (for notes)."""
    bits: int
    block: int
    u: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    label: str

    def dequantized(self) -> np.ndarray:
        """The ``[K, N]`` weight these blocks encode, computed as the kernel's blocks
        define it (for checks)."""
        n, nb, _ = self.u.shape
        w = self.scales[..., None] * (self.u.astype(np.float32) - np.float32(1 << (self.bits - 1)))
        if self.offsets is not None:
            w = w + self.offsets.T[..., None]
        return w.reshape(n, nb * self.block).T

    def packed(self) -> np.ndarray:
        """``u`` as ``MatMulNBits`` reads it: ``[N, K/block, block*bits/8]``, two 4-bit
        values per byte, low nibble first."""
        if self.bits == 8:
            return np.ascontiguousarray(self.u)
        return (self.u[..., 0::2] | (self.u[..., 1::2] << 4)).astype(np.uint8)


def q8_0(weight: np.ndarray, block: int = 32) -> Kept:
    """``[K, N]`` float weights as GGUF's Q8_0 makes them: per block of ``block`` along K,
    ``scale = max|w| / 127`` and ``round(w / scale)``. For weights that came from a Q8_0
    file this gives back the file's blocks exactly (``127 * d`` and its quotient by 127 are
    exact in float32 for a float16 ``d``), which ONNX Runtime's own 8-bit quantizer, whose
    scale is ``max|w| / 128``, does not (SmolLM2's output projection: 4 % of its weights
    kept, the rest moved by up to 7e-3)."""
    k, n = weight.shape
    w = np.ascontiguousarray(weight.T, dtype=np.float32).reshape(n, k // block, block)
    scales = (np.abs(w).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales == 0, np.float32(1), scales)
    q = np.clip(np.rint(w / safe[..., None]), -127, 127)
    return Kept(bits=8, block=block, u=(q + 128).astype(np.uint8), scales=scales, offsets=None,
                label="Q8_0 (kiln's, the file's grid)")


def fingerprint(weight: np.ndarray) -> str:
    """The key a ``[K, N]`` weight is found by: its shape and a hash of its float32 bytes
    (xxh3, ~10x blake2b's speed: a 135M-parameter model's weights hash in a fraction of a
    second)."""
    a = np.ascontiguousarray(weight, dtype=np.float32)
    return f"{a.shape}:{xxhash.xxh3_128_hexdigest(memoryview(a).cast('B'))}"


@contextlib.contextmanager
def keeping(table: dict):
    """Make ``table`` (fingerprint -> :class:`Kept`, or None for a weight to leave in
    float) visible to :func:`apply` for the length of the block."""
    _TABLES.append(table)
    try:
        yield
    finally:
        _TABLES.remove(table)


def register(table: dict) -> None:
    """Make ``table`` visible for the rest of the process (a worker compiling one graph)."""
    _TABLES.append(table)


def _find(key):
    for table in reversed(_TABLES):
        if key in table:
            return True, table[key]
    return False, None


def apply(model, nodes: list, accuracy_level: int) -> list:
    """Rewrite the MatMuls in ``nodes`` whose weight an active table holds, in place: a
    :class:`Kept` becomes ``MatMulNBits`` (plus the offset product), None leaves the
    MatMul in float. The names left for kiln's own quantizers returned (all of
    ``nodes`` when no table is active)."""
    if not _TABLES:
        return list(nodes)
    from onnx import numpy_helper
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    ranks = ort_int4.value_ranks(graph)
    wanted, left, sums, out = set(nodes), [], {}, []
    for n in graph.node:
        weight = inits.get(n.input[1]) if n.op_type == "MatMul" and n.name in wanted else None
        found, kept = _find(fingerprint(numpy_helper.to_array(weight))) if weight is not None else (False, None)
        if not found:
            if n.name in wanted:
                left.append(n.name)
            out.append(n)
            continue
        if kept is None or (kept.offsets is not None and not ranks.get(n.input[0])):
            out.append(n)           # kept in float (the file's float type, or no rank for the sums)
            continue
        out.extend(_nodes(graph, n, kept, sums, ranks.get(n.input[0]), accuracy_level))
    ort_rewrites.replace_nodes(model, out, microsoft=True)
    return left


def _nodes(graph, n, kept: Kept, sums: dict, rank, accuracy_level) -> list:
    """The nodes computing MatMul ``n`` from ``kept``'s blocks."""
    from onnx import helper, numpy_helper
    k, cols = kept.u.shape[1] * kept.block, kept.u.shape[0]
    name = n.name + "/kiln_kept"
    graph.initializer.extend([numpy_helper.from_array(kept.packed(), name + "/q"),
                              numpy_helper.from_array(kept.scales.astype(np.float32), name + "/scales")])
    x = n.input[0]
    product = helper.make_node("MatMulNBits", [x, name + "/q", name + "/scales"],
                               [n.output[0] if kept.offsets is None else name + "/main"], name=name,
                               domain="com.microsoft", K=k, N=cols, bits=kept.bits, block_size=kept.block,
                               accuracy_level=accuracy_level)
    product.doc_string = BLOCKS_DOC + kept.label     # counted by type (kiln.engines.onnx_products)
    if kept.offsets is None:
        return [product]
    graph.initializer.append(numpy_helper.from_array(kept.offsets.astype(np.float32), name + "/offsets"))
    return ort_int4.with_offsets(graph, sums, product, x, rank, kept.block, name, n.output[0], tag="kiln_kept")
