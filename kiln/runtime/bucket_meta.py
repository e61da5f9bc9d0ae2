"""What a bucketed model knows of its variants: the checks that its metadata describes
them as loaded, and which index ranges follow a bucketed axis.

An input that indexes into a bucketed dim (``lin(x)[arange(B), pos]`` with ``x``'s dim 1
bucketed) has a range that grows with the bucket: ``-8 <= pos < 8`` in the 8 variant. Eager
on the caller's unpadded input (length 5) accepts ``-5 <= pos < 5``; the padded variant
would answer ``pos=6`` with a padding row and ``pos=-1`` with the last padding row, and pass
``pos=9`` to the engine (ONNX Runtime's raw ``GatherND`` error). So such a range is checked
against the actual length of the dim it indexes, and a negative index is taken from the
end of the caller's length before padding.
"""
from __future__ import annotations

import torch

from kiln.artifact import schema, specs
from kiln.runtime import value_checks


class IndexPlan:
    """The index ranges of a bucketed model's inputs: ``shared`` (the same in every variant:
    an embedding's rows), ``by_axis`` (``(position, name, axis, from_end, operator, exempt)``:
    the range is the axis' size in every variant, so it is the caller's actual size) and
    ``own`` (per variant, ranges that follow neither: checked at the chosen variant's own
    size, so no engine meets an index past it)."""

    def __init__(self, variants, variant_sizes):
        per = [list(v.index_ranges) for v in variants]
        self.shared = [r for r in per[0] if all(r in p for p in per)]
        self.by_axis: list = []
        self.own: list = [[] for _ in variants]
        rest = [[r for r in p if r not in self.shared] for p in per]
        positions = sorted({r[0] for p in rest for r in p})
        for i in positions:
            entries = [next((r for r in p if r[0] == i), None) for p in rest]
            axis = _following_axis(entries, variant_sizes)
            if axis is not None:
                r = entries[0]
                self.by_axis.append((i, r[1], axis, r[2] < 0, r[4], r[5]))
            else:
                for k, r in enumerate(entries):
                    if r is not None:
                        self.own[k].append(r)
        self.from_end = [r for r in self.by_axis if r[3]]

    def check(self, flat, k, sizes):
        """IndexRangeError where an index that follows an axis is out of the caller's actual
        size, or one that follows none out of variant ``k``'s own range."""
        if self.by_axis:
            value_checks.check_ranges(flat, [(i, name, -sizes[a] if neg else 0, sizes[a], what, exempt)
                                             for i, name, a, neg, what, exempt in self.by_axis])
        if self.own[k]:
            value_checks.check_ranges(flat, self.own[k])

    def from_caller_end(self, flat, sizes, target):
        """``flat`` with negative indices into a padded axis counted from the caller's end
        (``-1``: the last real position, not the last padding one)."""
        out = None
        for i, _, a, _, _, exempt in self.from_end:
            t = flat[i]
            if sizes[a] == target[a] or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            neg = t < 0 if exempt is None else (t < 0) & (t != exempt)
            if bool(neg.any()):
                out = list(flat) if out is None else out
                out[i] = torch.where(neg, t + sizes[a], t)
        return flat if out is None else out


def _following_axis(entries, variant_sizes):
    """The axis whose size is the range of ``entries`` (one per variant) in every variant."""
    if any(r is None for r in entries):
        return None
    for a in range(len(variant_sizes[0])):
        if all(r[3] == sizes[a] and r[2] in (0, -r[3]) and (r[2] < 0) == (entries[0][2] < 0)
               for r, sizes in zip(entries, variant_sizes)):
            return a
    return None


def check_variants(meta, variants, source):
    """The bucket metadata must describe the variants as loaded: a call pads inputs to a
    variant's sizes and runs it unchecked, and slices its outputs."""
    fail = schema.Fail(source)
    first = variants[0]
    axis_of = {}
    for a, ax in enumerate(meta["axes"]):
        for i, d in ax["inputs"]:
            if i >= len(first.input_specs) or d >= len(first.input_specs[i].shape):
                fail(f"buckets.axes[{a}].inputs", f"names input {i} dim {d}, which the model lacks")
            axis_of[(i, d)] = a
    for k, v in enumerate(variants):
        p = f"buckets.variants[{k}]"
        if (v.input_structure != first.input_structure or v.output_structure != first.output_structure
                or len(v.input_specs) != len(first.input_specs)
                or len(v.output_specs) != len(first.output_specs)):
            fail(p, "has other inputs or outputs than the first variant")
        for i, (s, s0) in enumerate(zip(v.input_specs, first.input_specs)):
            if s.dtype != s0.dtype or len(s.shape) != len(s0.shape):
                fail(p, f"takes {s.name} as {s.describe()}, the first variant {s0.describe()}")
            for d, size in enumerate(s.shape):
                a = axis_of.get((i, d))
                want = meta["variants"][k]["sizes"][a] if a is not None else s0.shape[d]
                if size != want:
                    fail(p, f"takes {s.name} as {s.describe()}, but dim {d} should be {want}")
        for s, s0 in zip(v.output_specs, first.output_specs):
            if s.dtype != s0.dtype or len(s.shape) != len(s0.shape):
                fail(p, f"gives {s.name} as {s.describe()}, the first variant {s0.describe()}")
    for j, (o, d, a) in enumerate(meta["output_dims"]):
        if o >= len(first.output_specs) or d >= len(first.output_specs[o].shape):
            fail(f"buckets.output_dims[{j}]", f"names output {o} dim {d}, which the model lacks")
        for k, v in enumerate(variants):
            if v.output_specs[o].shape[d] < meta["variants"][k]["sizes"][a]:
                fail(f"buckets.output_dims[{j}]", f"slices output {o} dim {d} of variant {k} "
                     f"({v.output_specs[o].describe()}) to {meta['variants'][k]['sizes'][a]}")
    for key in meta["pad_values"]:
        if int(key) >= len(first.input_specs):
            fail(f"buckets.pad_values[{key!r}]", "names an input the model lacks")


class ShownSpec:
    """An input as a bucketed model takes it, for messages: a bucketed dim shows the range of
    lengths it takes (``(2, 1..64) int64``), not the smallest variant's size."""

    def __init__(self, spec, ranges: dict):
        self.name, self.shape, self.dtype = spec.name, tuple(spec.shape), spec.dtype
        self.dims = [f"1..{ranges[d]}" if d in ranges else str(n) for d, n in enumerate(self.shape)]

    def describe(self, dims=None):
        dims = self.dims if dims is None else dims
        return f"({', '.join(dims)}{',' if len(dims) == 1 else ''}) {specs.dtype_name(self.dtype)}"


def shown_specs(input_specs, axes) -> list:
    """:class:`ShownSpec` per input of a bucketed model with these ``axes``."""
    largest = {}
    for ax in axes:
        for i, d in ax["inputs"]:
            largest.setdefault(i, {})[d] = max(ax["sizes"])
    return [ShownSpec(s, largest.get(i, {})) for i, s in enumerate(input_specs)]


class FlattenView:
    """What :meth:`CompiledModel.flatten` reads of its model, with :class:`ShownSpec` inputs
    so that its messages describe a bucketed model's inputs."""

    __slots__ = ("name", "arg_names", "input_structure", "input_specs", "_plain", "_positional", "manifest")

    def __init__(self, model, shown: list, plain, variant_manifest: dict):
        self.name, self.arg_names, self.input_structure = model.name, model.arg_names, model.input_structure
        self.input_specs, self._plain = shown, plain
        self._positional = (variant_manifest.get("inputs") or {}).get("positional")
        if self._positional is not None and self._positional < len(self.arg_names):
            self._plain = None
        # the defaults the trace left out, which a call may give explicitly (every variant's are the same)
        self.manifest = {"omitted_defaults": variant_manifest.get("omitted_defaults") or {}}
