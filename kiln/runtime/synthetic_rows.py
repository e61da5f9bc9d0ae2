"""Rows made up for a measurement the caller's data cannot give: a dynamic batch's empty
call must know which outputs follow the rows (0 rows of those are its answer), and a call
of 0 rows has no row to measure on (:meth:`kiln.runtime.buckets.DynamicBatch._measure`)."""
from __future__ import annotations

import torch


def synthetic_chunk(input_specs, index_ranges, seed: int = 0) -> list:
    """One compiled batch of distinct random rows: floats standard normal; an input that
    indexes, ids over the range the artifact records (``index_ranges``:
    :func:`kiln.runtime.value_checks.ranges`); other integers and bools 0/1. Every input at
    its compiled shape."""
    gen = torch.Generator().manual_seed(seed)
    ranges = {r[0]: (r[2], r[3]) for r in index_ranges or ()}
    out = []
    for i, spec in enumerate(input_specs):
        shape = [int(n) for n in spec.shape]
        if spec.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(spec.dtype))
        else:
            low, high = ranges.get(i, (0, 2))
            out.append(torch.randint(low, high, shape, generator=gen).to(spec.dtype))
    return out
