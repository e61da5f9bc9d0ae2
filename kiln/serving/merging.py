"""Merging requests into one batch, splitting the outputs back, and proving that is exact.

Requests are concatenated along dim 0. Requests of one bucket group (the same
bucket on every varying non-batch axis, see :mod:`kiln.serving.layout`) are
padded to the longest request of the group with each input's pad value
(``pad_values`` at compile time, default 0); the model pads the rest of the way
to its bucket exactly as it does for a single call, and each request's outputs
are sliced back to its own length along the output dims that follow the axis.

This is correct for the same models bucketing is correct for: padding must not
change the unpadded part of the result (masked attention, per-position ops),
and rows of a batch must not interact (no batch norm in training mode, no
cross-row reductions, no activation scale per batch). The server does not
assume it: :func:`check_merging` runs a model on merged batches of distinct
synthetic rows, merged by the same :func:`merge` and :func:`split` the batcher
uses, and compares every row with that row run alone; a model that fails it is
never merged.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kiln.runtime.synthetic_rows import made_up
from kiln.serving.layout import Axis, Layout


class Request:
    """One queued request: its checked flat inputs, rows along dim 0, sizes on the layout's
    axes, bucket-group key, the future its result goes to and its arrival time."""
    __slots__ = ("flat", "rows", "sizes", "key", "future", "arrival")

    def __init__(self, flat, rows, sizes, key, future, arrival):
        self.flat, self.rows, self.sizes, self.key = flat, rows, sizes, key
        self.future, self.arrival = future, arrival


# -- merging and splitting ---------------------------------------------------------------------
def pad_to(t: torch.Tensor, dims: dict, value) -> torch.Tensor:
    """``t`` padded at the end of each dim in ``dims`` (dim -> size) with ``value``."""
    shape = list(t.shape)
    for d, size in dims.items():
        shape[d] = max(shape[d], size)
    if shape == list(t.shape):
        return t
    out = t.new_full(shape, value)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def merge(requests, layout: Layout):
    """Flat inputs of the merged batch and the group's size on every axis."""
    targets = [max(r.sizes[a] for r in requests) for a in range(len(layout.axes))]
    flat = []
    for i in range(len(requests[0].flat)):
        grow, value = {}, 0
        for a, ax in enumerate(layout.axes):
            for ii, d in ax.inputs:
                if ii == i:
                    grow[d] = targets[a]
                    value = ax.pads.get(i, 0)
        parts = [pad_to(r.flat[i], grow, value) if grow else r.flat[i] for r in requests]
        flat.append(torch.cat(parts, 0))
    return flat, targets


def split(outs, requests, layout: Layout, targets):
    """Per-request outputs: rows of the batch, sliced back to each request's sizes."""
    results, start = [], 0
    for r in requests:
        mine = []
        for o, t in enumerate(outs):
            piece = t.narrow(0, start, r.rows)
            for a, ax in enumerate(layout.axes):
                if r.sizes[a] == targets[a]:
                    continue
                for oo, d in ax.outputs:
                    if oo == o:
                        piece = piece.narrow(d, 0, r.sizes[a])
            mine.append(piece)
        results.append(mine)
        start += r.rows
    return results


# -- proving that merging is exact for a model ----------------------------------------------------
# float tolerances of the merge check: (atol, rtol of the output's largest magnitude)
MERGE_TOLERANCES = {torch.float16: (1e-3, 1e-2), torch.bfloat16: (1e-2, 2e-2)}
MERGE_TOLERANCE_DEFAULT = (1e-5, 1e-4)
MERGE_CHECK_ROWS = 8     # rows of a merged batch compared with the row alone (plus the last one)


@dataclass
class MergeCheck:
    """What :func:`check_merging` found: ``safe`` when every row of every merged batch it
    tried equals that row run alone."""
    safe: bool
    cases: list                  # the merged batches tried, e.g. "4 rows, lengths 8 7 6 5"
    max_diff: float = 0.0        # largest |merged - alone| over every output compared
    output: str | None = None    # the first output that differed
    case: str | None = None      # the merged batch where it differed
    row: int | None = None       # the row (request) that differed
    tolerance: str | None = None
    error: str | None = None     # the merged batch (or a row alone) failed to run
    seconds: float = 0.0

    def describe(self) -> str:
        if self.safe:
            return (f"merging checked: {len(self.cases)} merged batches equal their rows run alone "
                    f"(max diff {self.max_diff:.3g})")
        if self.error is not None:
            return f"merging could not be checked: {self.error}"
        return (f"rows interact: merged into a batch of {self.case}, rows differ from the same rows "
                f"run alone by up to {self.max_diff:.3g} (first: output '{self.output}' of row "
                f"{self.row}, beyond {self.tolerance})")


def _synthetic_row(spec, i, layout: Layout, lengths, gen, index_range=None) -> torch.Tensor:
    """One row (batch 1) of flat input ``i``: random floats; for an input that indexes
    (``index_range``, ``(low, high)`` from the artifact), random ids over its whole range, so
    rows differ in their ids' statistics too (a model dividing by ``ids.max()`` across the
    batch was proven mergeable on 0/1 ids, and mixed clients' answers); other ints and bools
    0/1 (masks), the first entry 1 (no all-masked row); bucketed axes at ``lengths``."""
    shape = [1] + [int(n) for n in spec.shape[1:]]
    for a, ax in enumerate(layout.axes):
        for ii, d in ax.inputs:
            if ii == i:
                shape[d] = lengths[a]
    return made_up(shape, spec.dtype, index_range, gen)


def _merge_sizes(layout: Layout, max_rows: int) -> list:
    """Batch sizes to try: two rows, the most rows, and (a bucketed batch dim) a size the
    model pads up to its next bucket."""
    sizes = {2, max_rows}
    if layout.batch_sizes:
        padded = [n for n in range(2, max_rows + 1) if n not in layout.batch_sizes]
        if padded:
            sizes.add(padded[0])
    return sorted(s for s in sizes if 2 <= s <= max_rows)


def _axis_lengths(ax: Axis) -> tuple:
    """(shortest, longest) lengths of one bucket of ``ax`` that holds at least two lengths
    (the smallest such bucket), so merged rows are padded to the group's longest."""
    prev = 0
    for s in ax.sizes:
        if s - prev >= 2:
            return prev + 1, s
        prev = s
    return ax.sizes[0], ax.sizes[0]


def _row_diff(merged: torch.Tensor, alone: torch.Tensor):
    """(max |merged - alone|, allowed, tolerance text) of one output of one row."""
    if merged.shape != alone.shape or merged.dtype != alone.dtype:
        return math.inf, 0.0, f"shape {list(merged.shape)} vs {list(alone.shape)}"
    if not (alone.dtype.is_floating_point or alone.dtype.is_complex):
        if torch.equal(merged, alone):
            return 0.0, 0.0, "exact"
        if alone.dtype == torch.bool:
            return 1.0, 0.0, "exact"
        return float((merged.long() - alone.long()).abs().max()), 0.0, "exact"
    atol, rtol = MERGE_TOLERANCES.get(alone.dtype, MERGE_TOLERANCE_DEFAULT)
    a, b = merged.detach().double(), alone.detach().double()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return math.inf, 0.0, "NaN in one of them"
    ok = ~nan_b
    if not ok.any():
        return 0.0, atol, f"atol {atol:g}, rtol {rtol:g}"
    a, b = a[ok], b[ok]
    same_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    diff = (a - b).abs().masked_fill(same_inf, 0.0)
    finite = b[torch.isfinite(b)]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return float(diff.max()), atol + rtol * scale, f"atol {atol:g}, rtol {rtol:g} of {scale:.3g}"


def _case_requests(rows, n: int, layout: Layout) -> tuple:
    """The first ``n`` synthetic rows as one-row requests, and the case's description."""
    reqs = []
    for flat in rows[:n]:
        sizes = layout.sizes(flat)
        reqs.append(Request(flat, 1, sizes, layout.key(sizes), None, 0.0))
    shown = reqs if n <= 2 * MERGE_CHECK_ROWS else reqs[:MERGE_CHECK_ROWS]
    case = f"{n} rows" + "".join(
        f", lengths {' '.join(str(r.sizes[a]) for r in shown)}{' ...' if len(shown) < n else ''}"
        for a in range(len(layout.axes)))
    return reqs, case


def _compare_rows(model, rows, merged, n: int, case: str, alone: dict, names, result: MergeCheck):
    """Compare the merged outputs of the compared rows with each row run alone (cached in
    ``alone``), recording the first difference beyond tolerance in ``result``."""
    for r in sorted(set(range(min(n, MERGE_CHECK_ROWS))) | {n - 1}):
        if r not in alone:
            try:
                alone[r] = model.run_flat(rows[r])
            except Exception as e:  # noqa: BLE001 - the model's own failure: nothing proven
                result.safe = False
                result.error = f"a synthetic row alone failed: {type(e).__name__}: {e}"
                return
        for o, (m, a) in enumerate(zip(merged[r], alone[r])):
            diff, allowed, tol = _row_diff(m, a)
            result.max_diff = max(result.max_diff, diff)
            if diff > allowed and result.safe:
                result.safe = False
                result.output, result.case, result.row, result.tolerance = names[o], case, r, tol


def check_merging(model, layout: Layout, max_rows: int, seed: int = 0) -> MergeCheck:
    """Prove on synthetic inputs that the batcher's merging does not change ``model``'s answers.

    Builds ``max_rows`` distinct one-row requests (random floats, ids over their ranges, else 0/1
    ints; rows of a bucketed
    axis at different lengths within one bucket), merges them exactly as the batcher does
    (concatenated on dim 0, padded to the group's longest, and by the model to its batch bucket
    or chunk), and compares the rows' outputs (the first ``MERGE_CHECK_ROWS`` and the last, which
    a chunked batch pads with) with each row run alone. Rows of a model that normalises across
    the batch, or sees its padding, differ: such a model must not be merged."""
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    specs = list(model.input_specs)
    spans = [_axis_lengths(ax) for ax in layout.axes]
    ranges = {r[0]: (r[2], r[3]) for r in getattr(model, "index_ranges", None) or ()}
    rows = []
    for r in range(max_rows):
        lengths = [hi - r % (hi - lo + 1) for lo, hi in spans]    # the longest first, then shorter
        rows.append([_synthetic_row(s, i, layout, lengths, gen, ranges.get(i)) for i, s in enumerate(specs)])
    names = [s.name for s in model.output_specs]
    result = MergeCheck(True, [])
    alone: dict = {}
    for n in _merge_sizes(layout, max_rows):
        reqs, case = _case_requests(rows, n, layout)
        result.cases.append(case)
        try:
            flat, targets = merge(reqs, layout)
            merged = split(model.run_flat(flat), reqs, layout, targets)
        except Exception as e:  # noqa: BLE001 - a batch the model cannot run is not mergeable
            result.safe, result.case = False, case
            result.error = f"the merged batch of {case} failed: {type(e).__name__}: {e}"
            break
        _compare_rows(model, rows, merged, n, case, alone, names, result)
        if not result.safe:
            break
    result.seconds = time.perf_counter() - started
    return result
