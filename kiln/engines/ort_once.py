"""Each weight quantized once per compile, however many graphs hold it.

An LLM is several graphs (a prefill per context bucket, a decode per batch size), and
each is exported with every weight of the model: quantizing them graph by graph computed
the same blocks three times over (SmolLM2-135M's int8 build spent 7.0 of its 25.9 s of
quantizing in ONNX Runtime's block quantizer and 3.6 s in the output projection's Q8_0
blocks, three graphs, under load). Within :func:`sharing` the blocks are computed once:
the results are kept by what they are computed from (the weight's values, its dtype and
the quantizer's settings), so a graph that holds the same weight gets the same arrays
back, and a weight that differs in one value is quantized afresh. Nothing else changes:
the arrays are the ones the quantizer returned for that weight, so the quantized graphs
are the same bytes as without sharing (a test compares them).

Outside a :func:`sharing` block every call computes, as before; blocks nest, and the
outermost owns the memo (its arrays are freed when it ends).
"""
from __future__ import annotations

import contextlib

import numpy as np
import xxhash

_MEMOS: list = []


@contextlib.contextmanager
def sharing():
    """Within the block, :func:`once` computes each result once (module doc)."""
    _MEMOS.append(_MEMOS[-1] if _MEMOS else {})
    try:
        yield
    finally:
        _MEMOS.pop()


def active() -> bool:
    return bool(_MEMOS)


def once(kind: str, weight: np.ndarray, settings: tuple, compute, digest=None):
    """``compute()``, or the result it gave in this block for the same ``kind``, the same
    ``weight`` (values, shape and dtype) and the same ``settings``. ``digest``: the weight's
    key where the caller has hashed it already (a 113 MB output projection is hashed once).
    The result's arrays (an array, a tuple of them, or an object's array attributes) are
    made read-only: a caller that wrote into one would change another graph's weights."""
    if not _MEMOS:
        return compute()
    key = (kind, digest if digest is not None else _digest(weight), settings)
    memo = _MEMOS[-1]
    if key not in memo:
        memo[key] = _frozen(compute())
    return memo[key]


def _digest(weight) -> tuple:
    """The weight's dtype, shape and a hash of its bytes (xxh3: a 135M-parameter model's
    weights hash in a fraction of a second)."""
    a = np.ascontiguousarray(weight)
    return a.dtype.name, a.shape, xxhash.xxh3_128_hexdigest(a.reshape(-1).view(np.uint8))


def _frozen(result):
    parts = result if isinstance(result, tuple) else (result,) if isinstance(result, np.ndarray) \
        else tuple(vars(result).values())
    for a in parts:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return result
