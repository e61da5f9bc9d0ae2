"""Which sizes the padding and batch checks (:mod:`kiln.compiler.padcheck`) probe, and what
they say where eager PyTorch runs none of them.

A probe proves something only where eager runs it. A model that takes only some sizes (pairs
of rows or positions: ``x.reshape(B, L // 2, 2 * D)``) fails on the shortest padded input, and
a check that skipped it accepted padding and splitting it never saw (``Pairs`` was 1.11 off at
length 2 in bucket 4, ``PairDiff`` answered 2 rows with two values). So the checks try other
sizes that are padded the same way, a few, and where eager runs none, padding or splitting is
unproven and refused (``ValidationError``), never accepted silently.
"""
from __future__ import annotations

import itertools
import math

import torch

from kiln.errors import ValidationError

MAX_PROBE_TRIES = 8     # sizes tried per bucket before padding counts as unproven


def probe_sizes(bucketed, bucket, examples):
    """Sizes (one per axis) that bucket ``bucket`` pads, in the order the check tries them: one
    past the next smaller size on every axis (the shortest such input) first, then, for a model
    eager runs only at some lengths, the next multiples of 2, 4, ... (the divisors of the axis'
    sizes) and the example's own length where it lies in the bucket's range; at most
    :data:`MAX_PROBE_TRIES`, each padded on some axis."""
    per_axis = []
    for a, ax in enumerate(bucketed.axes):
        size = bucket[a]
        smaller = [s for s in ax["sizes"] if s < size]
        low = max(smaller) if smaller else 0
        step = 0
        for s in ax["sizes"]:
            step = math.gcd(step, s)
        options = [low + 1]
        for g in range(2, step + 1):
            if step % g == 0:
                options.append((low // g + 1) * g)
        i, d = ax["inputs"][0]
        own = example_size(examples, i, d, bucketed)
        if own is not None:
            options.append(own)
        per_axis.append(list(dict.fromkeys(o for o in options if low < o <= size)))
    combos = sorted(itertools.product(*[range(len(o)) for o in per_axis]), key=lambda c: (sum(c), c))
    out = []
    for c in combos:
        probe = tuple(per_axis[a][j] for a, j in enumerate(c))
        if list(probe) != list(bucket) and probe not in out:
            out.append(probe)
        if len(out) == MAX_PROBE_TRIES:
            break
    return out


def example_size(examples, i, d, bucketed):
    """The user's own example's size of flat input ``i`` dim ``d`` (a size eager ran), if known."""
    original = getattr(examples, "original", None)
    if not original:
        return None
    try:
        named = original[1] or {}
        name = bucketed.input_specs[i].name
        t = named.get(name)
        return int(t.shape[d]) if isinstance(t, torch.Tensor) and t.dim() > d else None
    except Exception:   # noqa: BLE001 - a nested input: no hint, the other sizes remain
        return None


def unproven_padding(bucketed, bucket, tried) -> ValidationError:
    """The refusal where eager runs none of the padded inputs of a bucket: no probe, no proof."""
    on = "; ".join(f"axis {a} ({', '.join(repr(bucketed.input_specs[i].name) + f' dim {d}' for i, d in ax['inputs'])})"
                   for a, ax in enumerate(bucketed.axes))
    sizes = ", ".join(str(list(p)) for p, _ in tried)
    why = tried[0][1]
    return ValidationError(
        f"padding cannot be checked for {bucketed.name}: eager PyTorch fails on every input that "
        f"bucket {list(bucket)} would pad (tried sizes {sizes} on {on}; first error: {why}), so "
        "nothing shows that padding such an input gives eager's answer on it, and a compiled "
        "bucket would answer inputs the model itself refuses. If the model takes only some sizes, "
        "compile it at exactly those sizes without buckets (one model per size, calls exactly "
        "that size), or give buckets whose padded sizes it runs (every size between two buckets is "
        "padded to the larger); validate=False skips this check (and validation) at your own risk",
        {"bucket": list(bucket), "tried": [list(p) for p, _ in tried]})


def batch_counts(batch_size: int) -> list:
    """Row counts the batch check tries, in order, until eager runs one: one row more than
    compiled (two chunks, the last padded), then, for a model eager runs only at some counts
    (pairs of rows), the compiled batch plus each divisor of it (``4 + 2``), then each divisor
    alone (one padded chunk). Every one is split and padded as a call of that many rows is."""
    divisors = [g for g in range(1, batch_size) if batch_size % g == 0]
    counts = [batch_size + 1] + [batch_size + g for g in divisors if g > 1] + divisors
    return list(dict.fromkeys(counts))


def grown(example, batched, rows, batch_size):
    """``example`` (one compiled batch) with ``rows`` rows on its batched inputs: its own rows,
    and past them its last row rolled by one position (so the new row differs), then repeated."""
    out = []
    for t, b in zip(example, batched):
        if b:
            if rows <= batch_size:
                t = t[:rows]
            else:
                extra = t[-1:]
                if extra.dim() > 1 and extra.shape[-1] > 1:   # a row unlike the others
                    extra = extra.roll(1, dims=-1)
                t = torch.cat([t, extra.expand(rows - batch_size, *extra.shape[1:])])
            t = t.contiguous()
        out.append(t)
    return out


def batch_shaped(wrapped, expected, rows) -> str:
    """Where an output's shape depends on the batch size other than by its rows (``squeeze()``:
    ``()`` at 1 row, ``(B,)`` at B; one value per pair of rows), which output and its two shapes;
    else ""."""
    batch = wrapped.batch_size
    for o, (spec, e) in enumerate(zip(wrapped.inner.output_specs, expected)):
        compiled = tuple(int(n) for n in spec.shape)
        if not isinstance(e, torch.Tensor) or tuple(e.shape) == compiled:
            continue
        row_wise = (len(compiled) == e.dim() and e.dim() > 0 and compiled[0] == batch
                    and e.shape[0] == rows and tuple(e.shape[1:]) == compiled[1:])
        if not row_wise:
            one = "row" if batch == 1 else "rows"
            return (f"the shape of its output '{spec.name}' depends on the batch size other than by "
                    f"its rows: eager answers {compiled} at {batch} {one} (the compiled batch) and "
                    f"{tuple(e.shape)} at {rows} rows")
    return ""
