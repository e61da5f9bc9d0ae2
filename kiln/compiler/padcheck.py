"""Prove at trace time that padding and batching do not change answers.

Bucketing pads an input up to the next compiled size, and dynamic batch splits a
batch into compile-size chunks, padding the last one with repeated rows. Both
are only correct for models that cannot see the padding (masked attention,
per-position and per-row ops). A model that can see it (attention without a
mask, a mean over the sequence, rows normalised against each other) would
answer for the padded input instead of the user's, silently.

So ``kiln.trace`` runs, for every bucket that pads and for dynamic batch, a
*probe*: an input shorter than the compiled size, made from the user's own
example (narrowed, or tiled where it is too short), through the compiled
model, and compares it with eager PyTorch on the same unpadded probe, at the
trace's ``atol``/``rtol``. A difference is a ``ValidationError`` that names the
padded input, the measured error, and what to pass instead. A probe the eager
model itself cannot run (a model with hard-wired sizes) proves nothing; the
check is then recorded as skipped, with the reason, in the manifest.
"""
from __future__ import annotations

import inspect

import torch

from kiln.artifact import specs
from kiln.graph.capture import bind_inputs, call_bound
from kiln.errors import ValidationError
from kiln.graph.validation import compare, quality_gate


def flat_example(model, input_structure, args, kwargs) -> list:
    """An example call as the flat tensors a compiled model takes."""
    named = bind_inputs(model, args, kwargs)
    flat: list = []
    for name, structure in input_structure["dict"]:
        specs.flatten_inputs(structure, named.get(name), name, flat)
    return flat


def eager(model, input_structure, flat) -> list:
    """Flat outputs of the eager model on flat inputs (rebuilt into its arguments)."""
    with torch.no_grad():
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


def _reference(model, structure, probe):
    try:
        return eager(model, structure, probe), None
    except Exception as e:   # the model's own code: any error means "no reference"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


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
    source = flat_example(model, structure, *examples[largest])
    names = [s.name for s in bucketed.output_specs]
    record = {"probes": 0, "max_abs_error": 0.0, "skipped": []}
    seen = set()
    for k in bucketed._order:
        # the shortest input that still lands in bucket k: one past the next smaller size
        probe_sizes = []
        for a, ax in enumerate(bucketed.axes):
            smaller = [s for s in ax["sizes"] if s < sizes[k][a]]
            probe_sizes.append(max(smaller) + 1 if smaller else 1)
        probe_sizes = tuple(probe_sizes)
        if probe_sizes in seen or list(probe_sizes) == list(sizes[k]):
            continue
        seen.add(probe_sizes)
        probe = list(source)
        for a, ax in enumerate(bucketed.axes):
            for i, d in ax["inputs"]:
                probe[i] = _resize(probe[i], d, probe_sizes[a])
        expected, why = _reference(model, structure, probe)
        if expected is None:
            record["skipped"].append({"sizes": list(probe_sizes), "reason": f"eager failed: {why}"})
            continue
        k_run, _ = bucketed._select(probe)
        actual = bucketed.run_flat(probe)
        record["probes"] += 1
        try:
            error = tol.compare(expected, actual, names)
        except ValidationError as e:
            padded = [f"'{bucketed.input_specs[i].name}' dim {d}"
                      for a, ax in enumerate(bucketed.axes) for i, d in ax["inputs"]
                      if probe_sizes[a] < sizes[k_run][a]]
            raise ValidationError(
                f"padding changes the answers of {bucketed.name}: an input of size "
                f"{list(probe_sizes)} padded to bucket {list(sizes[k_run])} (on {', '.join(padded)}) "
                f"does not give eager's answer on the unpadded input within {tol}. "
                f"The model sees the padding. To fix it, {_mask_hint(model)}; or compile one "
                f"model per exact size without buckets.\n  {_detail(e)}",
                dict(e.metrics, probe_sizes=list(probe_sizes), bucket=list(sizes[k_run]))) from None
        record["max_abs_error"] = max(record["max_abs_error"], error)
    _forget_calls(bucketed)
    return record


def check_dynamic_batch(model, wrapped, example_args, example_kwargs, tol: Tolerance) -> dict:
    """Run a batch one row larger than compiled (so it is split into chunks and the last
    one padded with repeated rows) against eager on the same rows."""
    structure = wrapped.input_structure
    example = flat_example(model, structure, example_args, example_kwargs)
    probe = []
    for t, batched in zip(example, wrapped._batched_in):
        if batched:
            extra = t[-1:]
            if extra.dim() > 1 and extra.shape[-1] > 1:   # a row unlike the others
                extra = extra.roll(1, dims=-1)
            t = torch.cat([t, extra])
        probe.append(t)
    rows = wrapped.batch_size + 1
    expected, why = _reference(model, structure, probe)
    if expected is None:
        return {"rows": rows, "skipped": f"eager failed on {rows} rows: {why}"}
    actual = wrapped.run_flat(probe)
    try:
        error = tol.compare(expected, actual, [s.name for s in wrapped.output_specs])
    except ValidationError as e:
        raise ValidationError(
            f"dynamic batch changes the answers of {wrapped.name}: a batch of {rows} rows, run "
            f"as chunks of the compiled batch {wrapped.batch_size} (the last padded with repeated "
            f"rows), does not give eager's answer on those {rows} rows within {tol}. "
            "Rows of a batch interact in this model (batch statistics, cross-row reductions), so "
            "it cannot take other batch sizes by chunking: compile it at each batch size you need.\n"
            f"  {_detail(e)}", dict(e.metrics, rows=rows)) from None
    _forget_calls(wrapped)
    return {"rows": rows, "max_abs_error": error}


def _forget_calls(model):
    """The probes are kiln's calls, not the user's: metrics start from zero."""
    stack = [model]
    while stack:
        m = stack.pop()
        metrics = getattr(m, "metrics", None)
        if metrics is not None:
            metrics.reset()
        stack.extend(m.inner_models() if hasattr(m, "inner_models") else [])

