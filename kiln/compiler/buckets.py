"""Bucket planning: one compiled variant per bucket size, assembled into a ``Bucketed`` model.

Engines compile for fixed shapes. The compile side here builds an example input per
bucket (narrowing or padding the user's example), compiles each through the driver's
``trace_one``, and infers which input and output dims follow the buckets, so the
runtime adapter (:class:`kiln.runtime.buckets.Bucketed`) can pad and slice. Whether
padding changes answers is proved afterwards by :mod:`kiln.compiler.padcheck`.
"""
from __future__ import annotations

import itertools
import numbers
import re
import time

import torch

from kiln.artifact.container import wrapper_manifest
from kiln.errors import CompilerArgsError, KilnError
from kiln.runtime.buckets import Bucketed


def bucket_examples(model, example_inputs, example_kwargs, buckets, pad_values):
    """The example inputs to compile, one per bucket: ``buckets`` is a list of
    example inputs, or ``{input: {dim: [sizes]}}`` applied to the example.

    Inputs with the same size as a named input on the same dim are resized with
    it (``attention_mask`` follows ``input_ids``); pass them explicitly to
    override that."""
    if isinstance(buckets, (list, tuple)):
        if not buckets:
            raise CompilerArgsError("buckets=[] names no example inputs")
        return [(b, None) if not isinstance(b, dict) else (None, b) for b in buckets]
    if not isinstance(buckets, dict):
        raise CompilerArgsError("buckets must be {input name: {dim: [sizes]}} or a list of example inputs")
    from kiln.graph.capture import bind_inputs
    named = bind_inputs(model, example_inputs, example_kwargs)
    axes: list = []   # [(members [(name, dim)], sizes)]
    followers: list = []   # [(input, dim, the named input, size)]: taken to follow by their size
    for name, dims in buckets.items():
        if name not in named or not isinstance(named[name], torch.Tensor):
            raise CompilerArgsError(f"buckets names input {name!r}, but the tensor inputs are "
                                    f"{', '.join(k for k, v in named.items() if isinstance(v, torch.Tensor))}")
        if not isinstance(dims, dict):
            raise CompilerArgsError(f"buckets[{name!r}] must be {{dim: [sizes]}}, got {dims!r}")
        for dim, sizes in dims.items():
            t = named[name]
            if not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
                raise CompilerArgsError(f"buckets[{name!r}]: {t.dim()}-d input has no dim {dim!r}")
            dim %= t.dim()
            if not isinstance(sizes, (list, tuple, set, range)) or not all(
                    isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sizes):
                raise CompilerArgsError(f"buckets[{name!r}][{dim}] must be a list of sizes (integers), got "
                                        f"{sizes!r}")
            sizes = sorted({int(s) for s in sizes})
            if not sizes or sizes[0] < 1:
                raise CompilerArgsError(f"buckets[{name!r}][{dim}]: sizes must be positive, got {sizes}")
            if len(sizes) == 1:     # one variant: no size to choose, no other to tell the axis by
                raise CompilerArgsError(
                    f"buckets[{name!r}][{dim}] has one size ({sizes[0]}); a bucketed dim needs at least two. "
                    f"For one static shape, trace without buckets on an example of that size (calls must "
                    f"then be exactly it), or add a smaller size to pad shorter inputs up to {sizes[0]}")
            existing = next((ax for ax in axes if (name, dim) in ax[0]), None)
            if existing is not None:
                if existing[1] != sizes:
                    raise CompilerArgsError(
                        f"buckets: {name!r} dim {dim} follows another input's sizes "
                        f"{existing[1]}; give both the same sizes")
                continue
            members = [(name, dim)] + [
                (other, dim) for other, v in named.items()
                if other != name and other not in buckets and isinstance(v, torch.Tensor)
                and v.dim() > dim and v.shape[dim] == t.shape[dim]]
            axes.append((members, sizes))
            followers += [(other, d, name, int(t.shape[dim])) for other, d in members[1:]]
    pad_values = pad_values or {}
    unknown = [n for n in pad_values if re.split(r"[.\[]", str(n))[0] not in named]
    if unknown:     # before compiling a variant; assemble checks the flat names
        raise CompilerArgsError(f"pad_values names {', '.join(map(repr, unknown))}, which the model does not "
                                f"take; its inputs are {', '.join(named)}")
    examples = _Examples()
    examples.original = (None, named)     # the padding check's source: never a pad value
    examples.labels = []
    examples.followers = followers
    examples.spec = {name: {d: sorted({int(x) for x in sz}) for d, sz in dims.items()} for name, dims in buckets.items()}
    for combo in itertools.product(*(sizes for _, sizes in axes)):
        resized = dict(named)
        label = []
        for (members, _), size in zip(axes, combo):
            for name, dim in members:
                if resized[name].shape[dim] != size:
                    how = "narrowed" if size < resized[name].shape[dim] else "padded"
                    label.append(f"'{name}' dim {dim} {how} from {resized[name].shape[dim]} to {size}")
                resized[name] = _resize(resized[name], dim, size, pad_values.get(name, 0))
        examples.append((None, resized))
        examples.labels.append(", ".join(label) or "the example as given")
    return examples


class _Examples(list):
    """The bucket examples, with the user's own example (``original``, as ``(args, kwargs)``)."""

    original = None
    labels = None       # per example: how it was resized from the user's
    followers = ()      # inputs resized only because their size matched a named one's


def _resize(t, dim, size, pad_value):
    n = t.shape[dim]
    if size <= n:
        return t.narrow(dim, 0, size).contiguous()
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, size - n]
    return torch.nn.functional.pad(t, pads, value=pad_value)


def trace_buckets(model, examples, pad_values, output_dims, trace_one):
    """Compile one variant per bucket example (:func:`bucket_examples`) and return the
    ``Bucketed`` model."""
    variants, seconds = [], []
    labels = getattr(examples, "labels", None)
    for n, (args, kwargs) in enumerate(examples):
        started = time.perf_counter()
        try:
            variants.append(trace_one(model, args, kwargs, label=f"bucket {n + 1}/{len(examples)}"))
        except KilnError:
            raise
        except Exception as e:      # the model's own error, on an example kiln resized?
            if not labels or _eager_runs(model, kwargs):
                raise
            hint = _follower_hint(examples, labels[n])
            raise CompilerArgsError(
                f"the model fails on the example resized to bucket {n + 1}/{len(examples)} ({labels[n]}; "
                "other inputs kept as given): "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. {hint}"
                f"{'Otherwise, every' if hint else 'Every'} input "
                "that depends on the bucketed length (a position, an index into that dim) must be "
                "valid at every bucket size: give such inputs as bucket examples of their own "
                "(buckets=[example1, example2, ...], one per size), or leave out the sizes they "
                "do not fit") from e
        seconds.append(round(time.perf_counter() - started, 3))
    return assemble(variants, seconds, pad_values, output_dims)


def _follower_hint(examples, label) -> str:
    """Where inputs were resized only because a dim's size matched the bucketed one's (``w``'s 8
    features beside ``x``'s length 8), that they were, and how to keep them as given."""
    resized = [f for f in getattr(examples, "followers", ()) or () if f"'{f[0]}' dim {f[1]} " in label]
    if not resized:
        return ""
    taken = "; ".join(f"'{o}' dim {d} (size {n}) was taken to follow '{name}' dim {d}'s bucketed axis because "
                      "its size matched, and resized with it" for o, d, name, n in resized)
    keep = dict(getattr(examples, "spec", None) or {})
    for o, *_ in resized:
        keep.setdefault(o, {})
    return (f"{taken[0].upper()}{taken[1:]}. If it does not follow that axis (a feature dim of the same size), "
            f"keep it as given by naming it with no dims: buckets={keep!r}. ")


def _eager_runs(model, named) -> bool:
    """Whether eager PyTorch runs ``model`` on the bound inputs ``named``."""
    from kiln.graph.capture import call_bound, eval_mode
    try:
        with torch.no_grad(), eval_mode(model):
            call_bound(model, named)
    except Exception:   # noqa: BLE001 - the model's own code: any error is the answer
        return False
    return True


def assemble(variants, seconds, pad_values=None, output_dims=None) -> Bucketed:
    """Infer the axes and output dims from compiled variants and build the model."""
    first = variants[0]
    for v in variants[1:]:
        if v.input_structure != first.input_structure or v.output_structure != first.output_structure:
            raise CompilerArgsError("bucket examples must have the same inputs and outputs; "
                                    f"{v.name} differs in structure between buckets")
        for a, b in zip(v.input_specs + v.output_specs, first.input_specs + first.output_specs):
            if a.dtype != b.dtype or len(a.shape) != len(b.shape):
                raise CompilerArgsError(f"bucket examples differ in dtype or rank of {a.name}: "
                                        f"{a.describe()} vs {b.describe()}")
    axes: list = []
    for i, spec in enumerate(first.input_specs):
        for d in range(len(spec.shape)):
            seq = [v.input_specs[i].shape[d] for v in variants]
            if len(set(seq)) > 1:
                ax = next((ax for ax in axes if ax["sizes"] == seq), None)
                if ax is None:
                    axes.append({"inputs": [[i, d]], "sizes": seq})
                else:
                    ax["inputs"].append([i, d])
    if not axes:
        raise CompilerArgsError("the bucket examples all have the same shapes; give different sizes")
    sizes = [tuple(seq[k] for seq in (ax["sizes"] for ax in axes)) for k in range(len(variants))]
    if len(set(sizes)) != len(sizes):
        raise CompilerArgsError(f"two buckets have the same sizes {sizes}")
    out_dims = _output_dims(first, variants, axes, output_dims)
    flat_pads, used = {}, set()
    for i, spec in enumerate(first.input_specs):
        for name, value in (pad_values or {}).items():
            if spec.name == name or spec.name.startswith((f"{name}.", f"{name}[")):
                flat_pads[str(i)] = value
                used.add(name)
    unknown = [name for name in (pad_values or {}) if name not in used]
    if unknown:     # a misspelt name would pad that input with 0, silently
        raise CompilerArgsError(
            f"pad_values names {', '.join(map(repr, unknown))}, which the model does not take as "
            f"tensor inputs; its inputs are {', '.join(s.name for s in first.input_specs)}")
    meta = {"axes": axes, "pad_values": flat_pads, "output_dims": out_dims,
            "variants": [{"blob": f"variants/{k}.kiln", "sizes": list(sizes[k]),
                          "compile_seconds": seconds[k]} for k in range(len(variants))]}
    manifest = wrapper_manifest("bucketed", first.manifest, buckets=meta)
    return Bucketed(variants, meta, manifest)


def _output_dims(first, variants, axes, declared):
    """[[output, dim, axis]]: declared as {output name: {dim: input name or (name, dim)}},
    else inferred: an output dim whose size follows an axis in every variant."""
    out: list = []
    names = [s.name for s in first.output_specs]
    declared = declared or {}
    for o, spec in enumerate(first.output_specs):
        decl = declared.get(spec.name, declared.get(o))
        for d in range(len(spec.shape)):
            seq = [v.output_specs[o].shape[d] for v in variants]
            if decl and d in decl:
                if decl[d] is None:       # declared: depends on the buckets, never sliced
                    continue
                a = _axis_of(decl[d], first, axes)
                if any(n < ax_size for n, ax_size in zip(seq, axes[a]["sizes"])):
                    raise CompilerArgsError(
                        f"output_dims maps output '{spec.name}' dim {d} to {decl[d]!r}, but that dim is "
                        f"shorter than the bucket in some variants (sizes {seq} for buckets "
                        f"{axes[a]['sizes']}): it does not have the bucketed length (x[:, 1:] has one "
                        "less), so it cannot be sliced back to the caller's length. Only an output dim "
                        "whose size is the bucketed length can follow it; declare it {dim: None} to "
                        "leave it unsliced, or compile one model per exact size")
                out.append([o, d, a])
                continue
            if len(set(seq)) == 1:
                continue
            a = next((a for a, ax in enumerate(axes) if ax["sizes"] == seq), None)
            if a is None:
                raise CompilerArgsError(
                    f"output '{spec.name}' dim {d} changes with the buckets ({seq}) but follows no "
                    f"bucketed input dim; declare it with output_dims={{{spec.name!r}: {{{d}: "
                    "'<input name>'}}, or {dim: None} to leave it unsliced")
            out.append([o, d, a])
    del names
    return out


def _axis_of(ref, first, axes):
    name, dim = (ref, None) if isinstance(ref, str) else ref
    for a, ax in enumerate(axes):
        for i, d in ax["inputs"]:
            if first.input_specs[i].name == name and (dim is None or dim == d):
                return a
    raise CompilerArgsError(f"output_dims refers to {ref!r}, which is not a bucketed input dim")
