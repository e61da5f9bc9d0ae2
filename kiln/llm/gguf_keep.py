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
import hashlib
import os
from collections import Counter

import numpy as np

from kiln.engines import ort_blocks
from kiln.errors import CompilerArgsError
from kiln.llm import gguf_blocks, gguf_file

# The accuracy gate's limits (perplexity ratio, greedy agreement) against the float32 model
# on the file's dequantized weights: the kept blocks are those weights, so what is left to
# judge is the kernel's int8 activations (MatMulNBits' accuracy level 4), as for int8.
LIMITS = (1.05, 0.90)


class Plan:
    """Per tensor of one GGUF file, how it is compiled; ``table`` for the engine
    (fingerprint -> :class:`~kiln.engines.ort_blocks.Kept`, or None: float)."""

    def __init__(self, path: str, table: dict, tensors: dict):
        self.path, self.table, self.tensors = path, table, tensors
        h = hashlib.blake2b(digest_size=8)
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
    gguf_file.check(path)
    params = _parameters(model)
    reader = gguf.GGUFReader(path)
    table, tensors = {}, {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        type_name = t.tensor_type.name
        dense = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0]))
        found = params.get(_row_key(dense))
        if found is None:
            tensors[t.name] = {"type": type_name, "kept": False, "as": "unused",
                               "reason": "no parameter of the model holds this tensor's values"}
            continue
        weight, order = found
        perm = np.empty_like(order)
        perm[order] = np.argsort(_projections(dense), kind="stable")
        decision, kept = _decide(t, type_name, dense[perm], weight, perm)
        tensors[t.name] = decision
        table[ort_blocks.fingerprint(weight.T)] = kept
    return Plan(path, table, tensors)


def _decide(t, type_name, dense, weight, perm) -> tuple:
    """``(manifest entry, Kept or None)`` for file tensor ``t`` matched to ``weight``
    (``[N, K]``, equal to ``dense``: the dequantized tensor with rows in ``perm``'s order)."""
    if not np.array_equal(dense, weight):
        return ({"type": type_name, "kept": False, "as": "float32",
                 "reason": "the model's parameter differs from the file's dequantized tensor"}, None)
    if type_name not in gguf_blocks.LAYOUT:
        return {"type": type_name, "kept": False, "as": "float32", "exact": True}, None
    kept = gguf_blocks.kept(np.asarray(t.data), type_name, int(t.shape[0]))
    kept = ort_blocks.Kept(kept.bits, kept.block, kept.u[perm], kept.scales[perm],
                           None if kept.offsets is None else kept.offsets[:, perm].copy(), type_name)
    error = float(np.abs(kept.dequantized() - weight.T).max())
    scale = float(np.abs(weight).max()) or 1.0
    if error > 1e-6 * scale:
        return ({"type": type_name, "kept": False, "as": "float32",
                 "reason": f"{type_name} blocks did not reproduce the weights (max error {error:.3g})"}, None)
    return ({"type": type_name, "kept": True, "as": gguf_blocks.describe(type_name), "exact": error == 0.0,
             "max_error": error}, kept)


_VECTORS: dict = {}


def _projections(matrix: np.ndarray) -> np.ndarray:
    """Each row's dot product with a fixed random vector (float64): equal rows, equal
    numbers, whatever the row order."""
    k = matrix.shape[1]
    if k not in _VECTORS:
        _VECTORS[k] = np.random.default_rng(k).standard_normal(k)
    return matrix.astype(np.float64) @ _VECTORS[k]


def _row_key(matrix: np.ndarray) -> str:
    p = np.sort(_projections(matrix))
    return f"{matrix.shape}:{hashlib.blake2b(p.tobytes(), digest_size=16).hexdigest()}"


def _parameters(model) -> dict:
    """The model's matrices by :func:`_row_key`: ``(weight [N, K] float32, row order)``."""
    out = {}
    for _, p in model.named_parameters():
        if p.dim() != 2:
            continue
        w = p.detach().float().numpy()
        out[_row_key(w)] = (w, np.argsort(_projections(w), kind="stable"))
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
