"""Which outputs of a compiled model follow its rows, measured, and rows made up to measure on.

An output whose dim 0 (or DataParallel's ``dim``) equals the compiled batch may follow the
rows (a row-wise layer) or only share the size (a mean over rows of as many features): a
split batch joins the first and has no answer for the second, and the shape cannot tell
them apart. :func:`follows_rows` tells them apart by running one batch with its rows rolled
by one: at trace time only, on :func:`synthetic_chunk` (never all alike), and verified against
eager by the batch check; :func:`proven_rows` reads that proof back, and without one a batch is
not split (a call's own rows decide nothing: all alike, they cannot tell)."""
from __future__ import annotations

import torch


def made_up(shape, dtype, index_range, gen) -> torch.Tensor:
    """One made-up tensor: floats standard normal; an input that indexes (``index_range``,
    ``(low, high)`` as the artifact records it) random ids over its whole range, so rows differ
    in their ids' statistics too; other integers and bools 0/1 (masks), the first entry 1 (no
    all-masked row). Also the server's merge check's rows (:mod:`kiln.serving.merging`)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if index_range is not None and index_range[1] - index_range[0] > 2:
        return torch.randint(index_range[0], index_range[1], shape, generator=gen).to(dtype)
    t = torch.randint(0, 2, shape, generator=gen).to(dtype)
    if t.numel():
        t.view(-1)[0] = 1
    return t


def synthetic_chunk(input_specs, index_ranges, seed: int = 0) -> list:
    """One compiled batch of made-up rows (:func:`made_up`; ``index_ranges``:
    :func:`kiln.runtime.value_checks.ranges`), every input at its compiled shape."""
    gen = torch.Generator().manual_seed(seed)
    ranges = {r[0]: (r[2], r[3]) for r in index_ranges or ()}
    return [made_up([int(n) for n in spec.shape], spec.dtype, ranges.get(i), gen)
            for i, spec in enumerate(input_specs)]


def follows_rows(run, chunk: list, batched_in: list, batched_out: list, first=None, dim: int = 0) -> list:
    """Per output: whether it follows the rows of ``chunk`` (one compiled batch; ``run`` the
    model's flat call, ``first`` its outputs if already run): with the rows rolled by one
    along ``dim``, a row-wise output rolls with them exactly. Rows all alike cannot tell,
    and count as following."""
    first = run(chunk) if first is None else first
    rolled = [t.roll(1, dim) if b and t.dim() > dim else t for t, b in zip(chunk, batched_in)]
    moved = first if all(same(a, b) for a, b in zip(rolled, chunk)) else run(rolled)
    return [b and same(m, o.roll(1, dim)) for b, o, m in zip(batched_out, first, moved)]


def same(a, b) -> bool:
    """Equal shapes and values, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def proven_rows(manifest: dict, inner_manifest: dict, candidates: list):
    """``(follows, None)`` where splitting a batch along dim 0 into compiled-size chunks is
    proven, at trace time against the eager model, to give the model's answers (``follows``:
    per output, whether it is joined from the chunks; ``candidates``: which outputs have the
    compiled batch on dim 0), else ``(None, why)``. Never decided from a call's rows: a call
    whose rows are all alike cannot tell (rows rolled by one look the same).

    The proofs: ``kiln.trace(dynamic_batch=True)``'s ``batch_check`` in ``manifest`` (one
    skipped by ``validate=False`` is the caller's own request for a dynamic batch: its recorded
    ``follows_rows`` are used); or the ``row_check`` every ``kiln.trace`` records in the traced
    model's ``inner_manifest`` (:func:`kiln.compiler.padcheck.check_rows`). A check skipped
    because eager could not run the probe proves nothing (until 12-01 it was taken as the
    caller's request: a model of row pairs, ``reshape(-1, 2, 3)``, traced at 4 rows answered 8
    rows with 2 values where eager gives 4). A model saved without either (an older kiln) has
    no proof, and is not split."""
    check = manifest.get("batch_check")
    unproven = None
    if isinstance(check, dict):
        got = _sound((manifest.get("dynamic_batch") or {}).get("follows_rows"), candidates)
        if "max_abs_error" in check:    # before follows_rows were recorded, every candidate was joined
            return (got if got is not None else list(candidates)), None
        if got is not None and check.get("skipped") == "validate=False":
            return got, None
        unproven = ("kiln.trace(..., dynamic_batch=True) could not check at trace time that splitting a "
                    f"batch gives its answers ({check.get('skipped') or 'no answer'})")
    rows = inner_manifest.get("row_check")
    if isinstance(rows, dict):
        got = _sound(rows.get("follows_rows"), candidates)
        if "max_abs_error" in rows and got is not None:
            return got, None
        if rows.get("mixes"):
            if rows.get("batch_shape"):
                return None, f"an output's shape depends on the batch size (checked at trace time: {rows['mixes']})"
            return None, f"the model mixes the rows of a batch (checked at trace time: {rows['mixes']})"
        return None, unproven or ("kiln could not check at trace time that its rows are independent "
                                  f"({rows.get('skipped') or 'no answer'})")
    return None, unproven or ("the model carries no trace-time proof that its rows are independent (traced "
                              "by an older kiln, or with validate=False)")


def row_multiple(manifest: dict, inner_manifest: dict) -> int:
    """The row counts a split call may have are multiples of this (1: any): where eager ran the
    trace-time check only at a multiple of 2 rows (a model of row pairs), a call of an odd count
    has no eager answer to match, and is refused rather than padded into one."""
    for check in (manifest.get("batch_check"), inner_manifest.get("row_check")):
        if isinstance(check, dict) and "max_abs_error" in check:
            step = check.get("row_multiple")
            return step if isinstance(step, int) and step > 0 else 1
    return 1


def _sound(got, candidates):
    """A recorded ``follows_rows`` if sound (an output without the batch on dim 0 never follows)."""
    if (isinstance(got, list) and len(got) == len(candidates)
            and all(isinstance(f, bool) and (c or not f) for f, c in zip(got, candidates))):
        return list(got)
    return None
