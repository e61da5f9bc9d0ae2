"""Batch invariance: a request's tokens never depend on what else is in its batch.

The scheduler runs each decode step with the smallest compiled graph covering the occupied
slots, so a request alone runs the 1-row graph and the same request beside seven others
runs row ``r`` of the 8-row graph. Those give the same bits only if every kernel computes a
row the same way whatever the batch holds, and quantized kernels do not everywhere: ONNX
Runtime's ``MatMulNBits`` has a kernel of its own for one row on AVX2 (its M=1 symmetric
int8 kernels), and on an AVX-512 VNNI machine its int8 kernel for 128-wide blocks
computed 1, 3 and 5 rows differently from 8 (``1536 x 576``, 1e-6 apart; measured
2026-11-25). A 1e-6 difference in the logits or in the keys written to the cache is enough
for a greedy run to part from its solo run after a few dozen tokens (issue 30: 5 of 8
SmolLM2 int4 chats).

Which kernels run is decided by the machine that runs the model, not the one that compiled
it, so the check runs where the model runs, once per loaded LLM (:func:`plan`): every
decode graph runs on the same random rows and each row is compared, bit for bit (logits
and the new keys and values), with that row run alone. Graphs whose rows all match are
used; a graph that does not is dropped, and the smallest graph that covers the slots runs
instead. When no set of graphs agrees, decode runs one row at a time through the smallest
graph (:class:`RowByRow`): exact by construction, at the cost of reading the weights once
per row. The result is ``LLM.batch_invariance`` and a warning names what was dropped.
"""
from __future__ import annotations

import time
import warnings

import torch

from kiln.runtime import alloc, kv


class RowByRow:
    """A decode step for any number of rows made of calls of ``step`` (a graph for ``width`` rows)
    with one row at slot 0 and the others empty, as a request alone runs. Empty rows (no
    valid position, not a running request) are not run; their outputs are zeros."""

    def __init__(self, step, width: int):
        self.step, self.width = step, width

    def __call__(self, tokens, positions, *cache):
        valid, rows = cache[-1], tokens.shape[0]
        outputs = None
        for r in range(rows):
            if r and not bool(valid[r].any()):
                continue
            one = self.step(*_alone(self.width, r, tokens, positions, cache))
            if outputs is None:
                outputs = [o.new_zeros(_with_rows(i, o.shape, rows)) for i, o in enumerate(one)]
            for i, o in enumerate(one):
                _row_view(i, outputs[i], r).copy_(_row_view(i, o, 0))
        return tuple(outputs)


# A decode graph's outputs: logits [rows, 1, vocab], then the new keys and the new values,
# each [layers, rows, heads, 1, dim].
def _row_axis(index: int) -> int:
    return 0 if index == 0 else 1


def _with_rows(index: int, shape, rows: int) -> list:
    shape = list(shape)
    shape[_row_axis(index)] = rows
    return shape


def _row_view(index: int, t, row: int):
    return t.select(_row_axis(index), row)


def _alone(width: int, row: int, tokens, positions, cache) -> list:
    """Inputs for a ``width``-row graph holding input row ``row`` at slot 0, every other
    slot empty (token 0, position 0, nothing valid)."""
    def first(t):
        out = torch.zeros((width,) + tuple(t.shape[1:]), dtype=t.dtype)
        out[0] = t[row]
        return out
    return [first(tokens), first(positions), *(first(c) for c in cache)]


def _same(a, b) -> bool:
    return all(torch.equal(_row_view(i, x, 0), _row_view(i, y, 0)) for i, (x, y) in enumerate(zip(a, b)))


def _row(outputs, row: int) -> list:
    return [_row_view(i, o, row).unsqueeze(_row_axis(i)) for i, o in enumerate(outputs)]


def probe(steps: dict, cache_shape, window: int, seed: int = 0, agree=bool):
    """``(kept, calls)``: the row counts of ``steps`` (rows -> decode graph over a cache
    window of ``window`` positions) whose every row equals that row run alone, as a set
    that contains the largest graph, or ``None`` when no such set exists. ``agree(ok)``
    turns this process's finding into the one every rank acts on (tensor parallelism:
    each rank compares its own keys and values, and all must call the same graphs)."""
    layers, batch, heads, _, dim = cache_shape
    alloc.check("KV cache (keys and values)", [layers, batch, heads, window, dim], torch.float32, kv.ADVICE,
                count=2)      # the probe's own cache-sized rows, before any allocator error
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max(window, 2), (batch,), generator=g).clamp(max=window - 1)
    tokens = torch.randint(0, 2, (batch, 1), generator=g)    # ids every vocabulary has
    cache = [torch.randn(batch, heads, window, dim, generator=g) for _ in range(2 * layers)]
    cache.append(torch.arange(window).unsqueeze(0) < lengths.unsqueeze(1))
    positions = lengths.unsqueeze(1)
    sizes, calls = sorted(steps), 0
    with torch.no_grad():
        together = {b: steps[b](tokens[:b], positions[:b], *(c[:b] for c in cache)) for b in sizes}
        calls += len(sizes)
        for c in sizes:          # the reference: row r alone in graph c; smaller graphs first
            alone = [steps[c](*_alone(c, r, tokens, positions, cache)) for r in range(batch)]
            calls += batch
            kept = [b for b in sizes if b >= c and agree(all(_same(_row(together[b], r), alone[r]) for r in range(b)))]
            if c in kept and sizes[-1] in kept:
                return kept, calls
    return None, calls


def plan(decode: dict, windows: dict, cache_shape, agree=bool) -> tuple:
    """``(decode, windows, report)``: the decode graphs to run (rows -> step, for the full
    cache and for each smaller window), every one giving each row exactly what it gives
    alone, and what was found (``invariant``, ``decode_rows``, ``dropped``,
    ``row_by_row``, ``probe_calls``, ``probe_seconds``)."""
    t0 = time.perf_counter()
    every = {cache_shape[3]: decode, **{w: steps for w, steps in windows.items()}}
    kept, calls = set(decode), 0
    serial = False
    for window, steps in every.items():
        found, n = probe(steps, cache_shape, window, agree=agree)
        calls += n
        if found is None:
            serial = True
            break
        kept &= set(found)
    smallest = min(decode)
    if serial:
        rows = max(decode)
        chosen = {w: {rows: RowByRow(steps[smallest], smallest)} for w, steps in every.items()}
    else:
        chosen = {w: {b: steps[b] for b in sorted(kept)} for w, steps in every.items()}
    report = {"invariant": not serial and kept == set(decode), "decode_rows": sorted(chosen[cache_shape[3]]),
              "dropped": [] if serial else sorted(set(decode) - kept), "row_by_row": serial,
              "probe_calls": calls, "probe_seconds": round(time.perf_counter() - t0, 3)}
    if serial:
        warnings.warn(f"no set of this LLM's decode graphs computes a row the same way whatever the batch "
                      f"holds on this machine: decode runs one row at a time through the {smallest}-row graph "
                      "(exact, and slower when several requests run at once)", RuntimeWarning, stacklevel=3)
    elif report["dropped"]:
        warnings.warn(f"decode graphs for {report['dropped']} rows compute a row differently from the "
                      f"{max(decode)}-row graph on this machine; they are not used, so every request gets the "
                      "tokens it gets alone (a lone stream runs a larger graph)", RuntimeWarning, stacklevel=3)
    full = chosen.pop(cache_shape[3])
    return full, chosen, report
