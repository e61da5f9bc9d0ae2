"""Check at trace time that padding and batching do not change answers.

Bucketing pads an input up to the next compiled size, and dynamic batch splits a
batch into compile-size chunks, padding the last one with repeated rows. Both
are only correct for models that cannot see the padding (masked attention,
per-position and per-row ops). A model that can see it (attention without a
mask, a mean over the sequence, rows normalised against each other) would
answer for the padded input instead of the user's, silently.

So ``kiln.trace`` runs, for every bucket that pads and for dynamic batch, a
*probe*: an input shorter than the compiled size (one row more than compiled,
for dynamic batch) through the compiled model, compared with eager PyTorch on
the same unpadded probe, at the trace's ``atol``/``rtol``. Each probe size runs
on three inputs (:data:`DATA`): the user's own example (narrowed, or tiled where
it is too short), and two synthetic ones (:func:`synthetic`), since a model that
sees its padding can hide it on one example's values (``x.amax(1)`` on an
all-positive example answers right with zero padding): standard normal floats,
and floats shifted negative and scaled beyond the example's magnitude; ids over
the range the capture recorded for an input that indexes; masks (0/1 examples)
random 0/1 with a 1 in every row. It is a test on those inputs, not a proof for
every input. A difference is a ``ValidationError`` that names the padded input,
the data, the measured error, and what to pass instead. A probe the eager model
itself cannot run (a model with hard-wired sizes, or one that refuses the
synthetic values) proves nothing; it is then recorded as skipped, with the
reason, in the manifest. Eager runs as the capture does: in eval mode, every
module's own mode restored after (a model left in training mode is not changed).
"""
from __future__ import annotations

import inspect
import math

import torch

from kiln.artifact import specs
from kiln.graph.capture import bind_inputs, call_bound, eval_mode
from kiln.errors import ValidationError
from kiln.graph.validation import compare, quality_gate
from kiln.compiler import probe_sizes as sizing


def flat_example(model, input_structure, args, kwargs) -> list:
    """An example call as the flat tensors a compiled model takes."""
    named = bind_inputs(model, args, kwargs)
    flat: list = []
    for name, structure in input_structure["dict"]:
        specs.flatten_inputs(structure, named.get(name), name, flat)
    return flat


def eager(model, input_structure, flat) -> list:
    """Flat outputs of the eager model, in eval mode, on flat inputs (rebuilt into its arguments)."""
    with torch.no_grad(), eval_mode(model):
        out = call_bound(model, specs.decode(input_structure, flat))
    leaves: list = []
    specs.encode(out, "", leaves, [])
    return [t.detach() for t in leaves]


def _resize(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` with ``size`` entries on ``dim``: its own data, narrowed or tiled (never a pad
    value, so the probe is a real input)."""
    n = t.shape[dim]
    if size > n:
        reps = [1] * t.dim()
        reps[dim] = -(-size // n)
        t = t.repeat(*reps)
    return t.narrow(dim, 0, size).contiguous()


DATA = ("example", "standard normal", "negative-shifted, scaled")


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or (t.numel() > 0 and bool(((t == 0) | (t == 1)).all()))


def synthetic(flat: list, kind: int, ranges: dict, seed: int = 0, pads: dict | None = None) -> list:
    """``flat`` (an example probe) with synthetic values of the same shapes and dtypes;
    ``kind`` 1: standard normal floats, 2: ``(N(0, 1) * 2 - 3) * s`` (mostly negative, ``s``
    the example's largest magnitude, at least 1). An input that indexes (``ranges``, position:
    ``(low, high)``) takes random ids over its range; a mask (bool, or only 0s and 1s) random
    0/1 with a 1 first in every row (no all-masked row); an integer input padded with a pad
    value it may really take (``pads``, position: ``(pad value, padded dim)``; segment ids
    padded with the default 0) random values among the example's own and the pad value, the
    pad value first on the padded dim, so a model that cannot tell padding from a real value
    is caught; other ints keep the example's values (lengths, positions: their meaning is
    unknown)."""
    gen = torch.Generator().manual_seed(seed + kind)
    out = []
    for i, t in enumerate(flat):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            out.append(t)
        elif pads and i in pads and not t.is_floating_point() and not _is_mask(t) and i not in ranges:
            pad, dim = pads[i]
            values = torch.cat([torch.unique(t)[:15], torch.tensor([pad], dtype=t.dtype)]).unique()
            v = values[torch.randint(0, values.numel(), t.shape, generator=gen)]
            v.select(dim, 0).fill_(pad)
            out.append(v)
        elif _is_mask(t):
            m = torch.randint(0, 2, t.shape, generator=gen).to(t.dtype)
            m.select(-1, 0).fill_(1) if m.dim() else m.fill_(1)
            out.append(m)
        elif i in ranges and not t.is_floating_point():
            low, high = ranges[i]
            out.append(torch.randint(low, high, t.shape, generator=gen).to(t.dtype))
        elif t.is_floating_point():
            x = torch.randn(t.shape, generator=gen)
            if kind == 2:
                scale = max(1.0, t.detach().abs().nan_to_num(0, 0, 0).max().double().item())
                x = (x * 2 - 3) * scale
            out.append(x.to(t.dtype))
        else:
            out.append(t)
    return out


def _ranges(compiled) -> dict:
    return {r[0]: (r[2], r[3]) for r in getattr(compiled, "index_ranges", None) or ()}


def _reference(model, structure, probe):
    try:
        return eager(model, structure, probe), None
    except Exception as e:   # the model's own code: any error means "no reference"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _pad_collisions(bucketed, source, ranges) -> dict:
    """``{position: (0, dim)}`` of padded integer inputs that are neither masks nor indices
    and have no pad value of their own: padded with 0, which may be one of their real values
    (a segment id 0), so the synthetic probes give them real 0s. An explicit ``pad_values``
    entry is taken as a value the input never really holds, and is not probed."""
    out = {}
    for ax in bucketed.axes:
        for i, d in ax["inputs"]:
            t = source[i]
            if (str(i) in bucketed.pad_values or i in ranges or not isinstance(t, torch.Tensor)
                    or t.is_floating_point() or t.is_complex() or _is_mask(t)):
                continue
            out.setdefault(i, (0, d))
    return out


def _collision_hint(bucketed, probe, pads) -> str:
    """Which integer inputs held their pad value at real positions in ``probe``, and the fix."""
    held = [bucketed.input_specs[i].name for i, (pad, _) in pads.items()
            if isinstance(probe[i], torch.Tensor) and bool((probe[i] == pad).any())]
    if not held:
        return ""
    names = ", ".join(f"'{n}'" for n in held)
    fix = ", ".join(f"{n!r}: -1" for n in held)
    return (f" Integer input {names} (neither a mask nor an index) held its pad value 0 at real "
            "positions in this probe: a model that compares its values (segment ids) cannot tell "
            "those positions from padding, and kiln pads it with 0 unless told otherwise. Pad it "
            f"with a value no real one takes, e.g. pad_values={{{fix}}}.")


def _mask_hint(model) -> str:
    """Advice for a model that sees its padding."""
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if "attention_mask" in params:
        return ("pass the model's attention_mask input as well (kiln pads it with "
                "pad_values={'attention_mask': 0}), and pad_values for any other input whose "
                "padding must be neutral")
    return ("give the model an input that marks real positions (an attention mask) and set "
            "pad_values so padding is neutral")


class Tolerance:
    """How close a padded answer must be: ``atol``/``rtol`` like validation (no tighter than
    ``precision``'s floor, "tf32" for GPU builds checked at it), or, for lossy compiles
    (int8, auto-cast) whose unpadded answers already differ from eager, the accuracy
    gate's cosine similarity."""

    def __init__(self, atol=1e-3, rtol=1e-3, min_cosine=None, precision=None):
        self.atol, self.rtol, self.min_cosine, self.precision = atol, rtol, min_cosine, precision

    def __str__(self):
        if self.min_cosine is not None:
            return f"cosine similarity >= {self.min_cosine:g}"
        held = f" ({self.precision}'s precision, at least)" if self.precision else ""
        return f"atol={self.atol:g}, rtol={self.rtol:g}{held}"

    def compare(self, expected, actual, names) -> float:
        """The max abs error; raises ValidationError (first line: what failed) beyond tolerance."""
        if self.min_cosine is not None:
            quality_gate([(expected, actual)], self.min_cosine, 0.0, "the padded answer")
            errors = [(e.double() - a.double()).abs().max().item() for e, a in zip(expected, actual)
                      if e.is_floating_point() and e.numel() and e.shape == a.shape]
            return max(errors, default=0.0)
        return compare(expected, actual, names, self.atol, self.rtol,
                       computed_in=self.precision)["max_abs_error"]


def _detail(e: ValidationError) -> str:
    lines = str(e).splitlines()
    return (lines[1] if len(lines) > 1 else lines[0]).strip()


def check_buckets(model, bucketed, examples, tol: Tolerance) -> dict:
    """Probe every bucket that pads; raises ValidationError if padding changes an answer."""
    structure = bucketed.input_structure
    sizes = bucketed.variant_sizes
    largest = bucketed._order[-1]        # variants sorted by volume
    # the user's own example (bucket_examples keeps it): the largest bucket's was padded up
    # to it where the example is shorter, and narrowing that would probe with pad values
    source = flat_example(model, structure, *(getattr(examples, "original", None) or examples[largest]))
    names = [s.name for s in bucketed.output_specs]
    ranges = _ranges(bucketed)
    pads = _pad_collisions(bucketed, source, ranges)
    record = {"probes": 0, "data": list(DATA), "max_abs_error": 0.0, "skipped": []}
    seen = set()
    for k in bucketed._order:
        # the shortest input that still lands in bucket k (one past the next smaller size) first;
        # where eager cannot run it (a model that takes only even lengths), other padded sizes
        found = None
        tried = []
        for probe_sizes in sizing.probe_sizes(bucketed, sizes[k], examples):
            if probe_sizes in seen:
                found = "seen"
                break
            probe = list(source)
            for a, ax in enumerate(bucketed.axes):
                for i, d in ax["inputs"]:
                    probe[i] = _resize(probe[i], d, probe_sizes[a])
            probe = _fold_indices(bucketed, probe, probe_sizes)
            expected, why = _reference(model, structure, probe)
            if expected is not None:
                found = probe_sizes
                break
            tried.append((probe_sizes, why))
            record["skipped"].append({"sizes": list(probe_sizes), "reason": f"eager failed: {why}"})
        if found == "seen":
            continue
        if found is None:
            if tried:       # a bucket that pads, and no padded input eager runs: padding unproven
                raise sizing.unproven_padding(bucketed, sizes[k], tried)
            continue
        seen.add(probe_sizes)
        record["probes"] += 1
        base = probe
        for kind, data in enumerate(DATA):
            if kind:
                probe = synthetic(base, kind, ranges, pads=pads)
                expected, why = _reference(model, structure, probe)
                if expected is None:
                    record["skipped"].append({"sizes": list(probe_sizes), "data": data,
                                              "reason": f"eager failed: {why}"})
                    continue
            k_run, _ = bucketed._select(probe)
            actual = bucketed.run_flat(probe)
            _same_shapes(bucketed, expected, actual, probe_sizes, sizes[k_run])
            try:
                error = tol.compare(expected, actual, names)
            except ValidationError as e:
                hint = _collision_hint(bucketed, probe, pads)
                padded = [f"'{bucketed.input_specs[i].name}' dim {d}"
                          for a, ax in enumerate(bucketed.axes) for i, d in ax["inputs"]
                          if probe_sizes[a] < sizes[k_run][a]]
                raise ValidationError(
                    f"padding changes the answers of {bucketed.name}: an input of size "
                    f"{list(probe_sizes)} ({data} data) padded to bucket {list(sizes[k_run])} (on "
                    f"{', '.join(padded)}) does not give eager's answer on the unpadded input within "
                    f"{tol}. The model sees the padding.{hint} "
                    f"{'If it sees the padding otherwise' if hint else 'To fix it'}, {_mask_hint(model)}; or compile "
                    f"one model per exact size without buckets.\n  {_detail(e)}",
                    dict(e.metrics, probe_sizes=list(probe_sizes), bucket=list(sizes[k_run]),
                         data=data)) from None
            record["max_abs_error"] = max(record["max_abs_error"], error)
    _forget_calls(bucketed)
    return record


def _fold_indices(bucketed, probe, probe_sizes) -> list:
    """``probe`` with each input that indexes a bucketed dim (``pos`` into ``x``'s length) folded
    into the probe's length there, so the user's example (``pos=3``) indexes a shorter probe
    (length 2) as eager allows; negative indices count from the end, exempt values stay."""
    plan = getattr(bucketed, "_indices", None)
    out = list(probe)
    for i, _, a, _, _, exempt in (plan.by_axis if plan is not None else ()):
        t, n = out[i], probe_sizes[a]
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.numel() == 0 or n < 1:
            continue
        keep = t == exempt if exempt is not None else torch.zeros_like(t, dtype=torch.bool)
        folded = torch.where(t >= 0, t % n, -((-t - 1) % n) - 1)
        out[i] = torch.where(keep, t, folded)
    return out


def _same_shapes(bucketed, expected, actual, probe_sizes, bucket):
    """A ValidationError where a padded answer's shape is not eager's: an output whose length
    changes with the input but is not the bucketed length (``x[:, 1:]``), which no slicing
    gives back, rather than "the model sees the padding"."""
    for o, (e, a) in enumerate(zip(expected, actual)):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and e.shape != a.shape:
            name = bucketed.output_specs[o].name if o < len(bucketed.output_specs) else str(o)
            sliced = [d for oo, d, _ in bucketed.output_dims if oo == o]
            raise ValidationError(
                f"bucketing cannot give {bucketed.name}'s output '{name}' back: an input of size "
                f"{list(probe_sizes)} run in bucket {list(bucket)} answers {tuple(a.shape)}, eager "
                f"{tuple(e.shape)}. A dim of it changes with the bucketed length without being that "
                f"length (x[:, 1:] has one less; sliced dims: {sliced or 'none'}), so no slicing of "
                "the padded answer is the caller's; check output_dims, or compile one model per exact "
                "size without buckets", {"output": name, "shape": list(a.shape), "eager_shape": list(e.shape)})


def check_dynamic_batch(model, wrapped, example_args, example_kwargs, tol: Tolerance, required: bool = True) -> dict:
    """Run a batch of another size than compiled (so it is split into chunks and the last
    one padded with repeated rows) against eager on the same rows: one row more than compiled,
    or where eager cannot run that, the next count of :func:`batch_counts` it runs. Where eager
    runs none, splitting is unproven: a ``ValidationError`` (``required``, kiln.trace(...,
    dynamic_batch=True), which asked for splitting), else a record ``skipped`` that splits nothing."""
    structure = wrapped.input_structure
    example = flat_example(model, structure, example_args, example_kwargs)
    failed = []
    for rows in sizing.batch_counts(wrapped.batch_size):
        probe = sizing.grown(example, wrapped._batched_in, rows, wrapped.batch_size)
        expected, why = _reference(model, structure, probe)
        if expected is not None:
            break
        failed.append((rows, why))
    else:
        counts = ", ".join(str(r) for r, _ in failed)
        if required:
            raise ValidationError(
                f"dynamic batch cannot be checked for {wrapped.name}: eager PyTorch fails on every other batch "
                f"size tried ({counts} rows; at {failed[0][0]}: {failed[0][1]}), so nothing shows that "
                f"splitting a batch into chunks of the compiled {wrapped.batch_size} gives the model's answers, "
                "and a split call would answer batches the model itself refuses. A model that takes only "
                f"{wrapped.batch_size} rows cannot take a dynamic batch: trace it without dynamic_batch (calls then "
                f"have exactly {wrapped.batch_size} rows), or at each batch size you need; validate=False skips "
                "this check (and validation) and splits at your own risk",
                {"tried": [r for r, _ in failed]})
        return {"rows": failed[0][0], "tried": [r for r, _ in failed],
                "skipped": f"eager failed on {counts} rows: {failed[0][1]}"}
    record = {"rows": rows, "data": list(DATA), "max_abs_error": 0.0}
    if failed:      # eager runs only some counts: a call must be a multiple of this one's step
        record["skipped_rows"] = [f"{r} rows: eager failed: {w}" for r, w in failed]
        record["row_multiple"] = math.gcd(rows, wrapped.batch_size)
    base = probe
    for kind, data in enumerate(DATA):
        if kind:
            probe = synthetic(base, kind, _ranges(wrapped))
            expected, why = _reference(model, structure, probe)
            if expected is None:
                record.setdefault("skipped_data", []).append(f"{data}: eager failed: {why}")
                continue
        actual = wrapped.run_flat(probe)
        try:
            error = tol.compare(expected, actual, [s.name for s in wrapped.output_specs])
        except ValidationError as e:
            shaped = sizing.batch_shaped(wrapped, expected, rows)
            if shaped:
                raise ValidationError(
                    f"dynamic batch cannot give {wrapped.name}'s answers: {shaped}, so no joining of "
                    f"chunks of the compiled batch {wrapped.batch_size} is eager's answer at another batch "
                    "size. Keep the batch dim in the output (squeeze(-1) rather than squeeze(), a per-row "
                    "result rather than one per group of rows), or compile the model at each batch size "
                    f"you need.\n  {_detail(e)}",
                    dict(e.metrics, rows=rows, data=data, batch_shape=shaped)) from None
            raise ValidationError(
                f"dynamic batch changes the answers of {wrapped.name}: a batch of {rows} rows "
                f"({data} data), run as chunks of the compiled batch {wrapped.batch_size} (the last "
                f"padded with repeated rows), does not give eager's answer on those {rows} rows "
                f"within {tol}. Rows of a batch interact in this model (batch statistics, cross-row "
                "reductions), so it cannot take other batch sizes by chunking: compile it at each "
                f"batch size you need.\n  {_detail(e)}", dict(e.metrics, rows=rows, data=data)) from None
        record["max_abs_error"] = max(record["max_abs_error"], error)
    _forget_calls(wrapped)
    return record


def settle_rows(wrapped):
    """Decide, once at trace time, which outputs of a dynamic batch follow its rows: measured
    (:func:`kiln.runtime.synthetic_rows.follows_rows`) on one compiled batch of made-up rows,
    which are never all alike (a caller's zeros were: every output then looked per-row), and
    kept in the wrapper's manifest. The batch check that follows verifies the verdict against
    eager; the runtime never measures on a caller's rows."""
    from kiln.runtime.synthetic_rows import follows_rows, synthetic_chunk
    chunk = synthetic_chunk(wrapped.input_specs, wrapped.index_ranges)
    wrapped.settle_rows(follows_rows(wrapped.inner.run_flat, chunk, wrapped._batched_in, wrapped._batched_out))
    _forget_calls(wrapped)


def check_rows(model, compiled, example_args, example_kwargs, tol: Tolerance) -> dict:
    """What every ``kiln.trace`` records (``row_check`` in the manifest) for ``dynamic_batch()``
    and DataParallel, which split a batch into compiled-size chunks without the eager model:
    :func:`check_dynamic_batch` on a dynamic batch around ``compiled``. A record with
    ``max_abs_error`` and ``follows_rows`` proves splitting gives eager's answers; ``mixes``
    (the check's finding) or ``skipped`` (no answer) leaves the model unsplit."""
    from kiln.runtime.buckets import DynamicBatch
    try:
        wrapped = DynamicBatch(compiled, track=False)
        settle_rows(wrapped)
        record = check_dynamic_batch(model, wrapped, example_args, example_kwargs, tol, required=False)
    except ValidationError as e:
        rows = e.metrics.get("rows")
        if e.metrics.get("batch_shape"):
            return {"mixes": e.metrics["batch_shape"], "batch_shape": True, "rows": rows}
        return {"mixes": f"{rows} rows run as chunks ({e.metrics.get('data')} data) are not eager's answer: "
                         f"{_detail(e)[:300]}", "rows": rows}
    except Exception as e:  # noqa: BLE001 - no batch dim, a probe the compiled model refuses: no proof
        return {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    finally:
        _forget_calls(compiled)
    if "max_abs_error" in record:
        record["follows_rows"] = list(wrapped._follows)
    return record


def _forget_calls(model):
    """The probes are kiln's calls, not the user's: metrics start from zero."""
    stack = [model]
    while stack:
        m = stack.pop()
        metrics = getattr(m, "metrics", None)
        if metrics is not None:
            metrics.reset()
        stack.extend(m.inner_models() if hasattr(m, "inner_models") else [])

