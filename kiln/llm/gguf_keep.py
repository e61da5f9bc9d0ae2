"""``quantize="gguf"``: compile a model loaded from a GGUF file with each matrix kept in
the blocks the file stores it in, where ONNX Runtime's ``MatMulNBits`` has a kernel for
them (:mod:`kiln.llm.gguf_blocks`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), and
in float32 where the file stores float (F32, F16, BF16: dequantized, exactly).

What a user downloading ``model.Q4_K_M.gguf`` expects is that model: its size, speed and
answers, not a second quantization of its dequantized weights onto kiln's own grid
(``quantize="int4"`` rounds Q4_K's blocks again; Q6_K tensors would lose two bits).

How a tensor is matched to the model's parameter: transformers dequantizes every tensor
and may reorder rows (Llama's query and key rows are un-permuted from llama.cpp's
layout), so each file matrix is matched by content, not by name: a permutation-free key
(the sorted projections of its rows on a fixed random vector) finds the parameter, the
same projections give the row order, and the parameter must then equal the reordered
dequantized tensor exactly. The blocks are reordered the same way and checked once more
against the parameter (exact for the symmetric types; the offset types within the last
bit, recorded as ``max_error``). A matrix that fails a check is left in float with the
reason in the manifest: it is never kept wrong.

Which graph weights are which is settled in the engine by content too
(:mod:`kiln.engines.ort_blocks`); the table rides on the model to the compile workers
(:class:`_WorkerTable`) and names the graphs' cache entries (:attr:`Plan.digest`), so a
kept-blocks compile never shares a cache entry with a plain int8 one.
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter

import numpy as np
import xxhash

from kiln.engines import ort_blocks
from kiln.errors import CompilerArgsError
from kiln.llm import gguf_blocks, gguf_file

# The accuracy gate's limits (perplexity ratio, greedy agreement) against the float32 model
# on the file's dequantized weights: the kept blocks are those weights, so what is left to
# judge is the kernel's int8 activations (MatMulNBits' accuracy level 4). int8's perplexity
# limit; agreement 85 %, not int8's 90 %: SmolLM2 files of each type measured 90.6 % (Q4_0)
# to 98.1 % (Q8_0, Q5_K) over the gate's 53 tokens (one token is 1.9 %) at perplexity ratios
# of 1.000-1.024, so 90 % would refuse a correct Q4_0 build on one more near-tie.
LIMITS = (1.05, 0.85)


class Plan:
    """Per tensor of one GGUF file, how it is compiled; ``table`` for the engine
    (fingerprint -> :class:`~kiln.engines.ort_blocks.Kept`, or None: float)."""

    def __init__(self, path: str, table: dict, tensors: dict):
        self.path, self.table, self.tensors = path, table, tensors
        h = xxhash.xxh3_64()
        for key in sorted(table):
            h.update(key.encode())
            kept = table[key]
            if kept is not None:
                for part in (kept.u, kept.scales, kept.offsets if kept.offsets is not None else np.zeros(0)):
                    h.update(np.ascontiguousarray(part).tobytes())
        self.digest = h.hexdigest()

    def counts(self) -> tuple:
        """``(kept, float, unused)``: Counters of ggml type over the file's matrices."""
        kept, floats, unused = Counter(), Counter(), Counter()
        for t in self.tensors.values():
            (kept if t["kept"] else unused if t["as"] == "unused" else floats)[t["type"]] += 1
        return kept, floats, unused

    def summary(self) -> str:
        kept, floats, unused = self.counts()

        def listing(c):
            return ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
        text = (f"{os.path.basename(self.path)}: {sum(kept.values())} matrices kept as the file's blocks "
                f"({listing(kept) or 'none'})")
        if floats:
            text += f"; {sum(floats.values())} in float32 ({listing(floats)})"
        reasons = sorted({t["reason"] for t in self.tensors.values() if t.get("reason")})
        if reasons:
            text += "; not kept: " + "; ".join(reasons)
        return text

    def manifest(self) -> dict:
        kept, floats, unused = self.counts()
        return {"file": os.path.basename(self.path), "kept": dict(kept), "float32": dict(floats),
                "unused": dict(unused), "tensors": self.tensors}


class _WorkerTable:
    """The table, riding on the model to a compile worker (:mod:`kiln.llm.parallel`
    pickles the model): unpickling it there registers it with the engine for the
    worker's life, which is one graph's compile."""

    def __init__(self, table: dict):
        self.table = table

    def __getstate__(self):
        return self.table

    def __setstate__(self, table):
        self.table = table
        ort_blocks.register(table)


@contextlib.contextmanager
def keeping(model, plan: Plan | None):
    """For the length of the block, graphs compiled from ``model`` (here or in a worker)
    keep ``plan``'s blocks (None: nothing to keep)."""
    if plan is None:
        yield
        return
    model.kiln_kept_blocks = _WorkerTable(plan.table)
    try:
        with ort_blocks.keeping(plan.table):
            yield
    finally:
        del model.kiln_kept_blocks


def plan(model, path: str) -> Plan:
    """How each matrix of the GGUF file at ``path`` (the file ``model`` was loaded from)
    is compiled; see the module docstring."""
    import gguf
    tensors_info, data_start = gguf_file.read(path)
    params = _parameters(model)
    table, tensors = {}, {}
    for t in tensors_info:
        if len(t.shape) != 2:
            continue
        raw = np.memmap(path, np.uint8, "r", data_start + t.offset, (t.shape[1], gguf_file.row_bytes(t)))
        dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.type]).reshape(t.shape[1], t.shape[0])
        projections = _projections(dense)
        found = params.get(_row_key(dense.shape, projections))
        if found is None:
            tensors[t.name] = {"type": t.type, "kept": False, "as": "unused",
                               "reason": "no parameter of the model holds this tensor's values"}
            continue
        weight, order = found
        perm = np.empty_like(order)
        perm[order] = np.argsort(projections, kind="stable")
        decision, kept = _decide(raw, t, dense[perm], weight, perm)
        tensors[t.name] = decision
        table[ort_blocks.fingerprint(weight.T)] = kept
    return Plan(path, table, tensors)


def _decide(raw, t, dense, weight, perm) -> tuple:
    """``(manifest entry, Kept or None)`` for file tensor ``t`` (bytes ``raw``) matched to
    ``weight`` (``[N, K]``, which should equal ``dense``: the dequantized tensor with rows in
    ``perm``'s order)."""
    if not np.array_equal(dense, weight):
        return ({"type": t.type, "kept": False, "as": "float32",
                 "reason": "the model's parameter differs from the file's dequantized tensor"}, None)
    if t.type not in gguf_blocks.LAYOUT:
        return {"type": t.type, "kept": False, "as": "float32", "exact": True}, None
    kept = gguf_blocks.kept(np.asarray(raw), t.type, int(t.shape[0]))
    kept = ort_blocks.Kept(kept.bits, kept.block, kept.u[perm], kept.scales[perm],
                           None if kept.offsets is None else kept.offsets[:, perm].copy(), t.type)
    error = float(np.abs(kept.dequantized() - weight.T).max())
    scale = float(np.abs(weight).max()) or 1.0
    if error > 1e-6 * scale:
        return ({"type": t.type, "kept": False, "as": "float32",
                 "reason": f"{t.type} blocks did not reproduce the weights (max error {error:.3g})"}, None)
    return ({"type": t.type, "kept": True, "as": gguf_blocks.describe(t.type), "exact": error == 0.0,
             "max_error": error}, kept)


def _projections(matrix: np.ndarray) -> np.ndarray:
    """Each row's 64-bit hash (xxh3 of its float32 bytes): equal rows, equal numbers,
    wherever they sit; for SmolLM2-135M's ~200,000 rows, well under a second."""
    a = np.ascontiguousarray(matrix, dtype=np.float32)
    width = a.shape[1] * 4
    flat = memoryview(a.reshape(-1)).cast("B")
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(flat[i:i + width]) for i in range(0, len(flat), width)), np.uint64, len(a))


def _row_key(shape, projections: np.ndarray) -> str:
    return f"{tuple(shape)}:{xxhash.xxh3_128_hexdigest(np.sort(projections).tobytes())}"


def _parameters(model) -> dict:
    """The model's matrices by :func:`_row_key`: ``(weight [N, K] float32, row order)``, each
    also transposed: GPT-2's ``Conv1D`` holds ``[in, out]`` (its product is ``x @ W``), which
    the file stores as ``[out, in]`` like any other matrix. Unmatched, GPT-2's layer matrices
    went to int8 under ``quantize="gguf"``, F16 ones too (found by probing)."""
    out = {}
    for _, p in model.named_parameters():
        if p.dim() != 2:
            continue
        for w in (p.detach().float().numpy(), np.ascontiguousarray(p.detach().float().numpy().T)):
            projections = _projections(w)
            out.setdefault(_row_key(w.shape, projections), (w, np.argsort(projections, kind="stable")))
    return out


def source_path(model, quantize) -> str:
    """The GGUF file ``model`` was loaded from, for ``quantize="gguf"``."""
    from kiln.llm.source import gguf_path
    path = gguf_path(model)
    if path is None:
        raise CompilerArgsError(f"quantize={quantize!r} keeps a GGUF file's own blocks: load the model with "
                                "kiln.llm.source.load_pretrained('model.gguf') (or `kiln llm compile "
                                "model.gguf`); for other models use quantize='int8' or 'int4'")
    return path
