"""What a loaded model lets the batcher merge: which dims vary, which is the batch dim.

The batcher merges requests along dim 0, the batch dim, which every input and
output of a batchable model has: a ``DynamicBatch`` model (any batch size) or a
``Bucketed`` one bucketed on dim 0 of every input (up to its largest batch
bucket). Other varying dims (a bucketed sequence length) become :class:`Axis`
objects: requests in the same bucket of every axis may share a batch. The
:class:`Layout` is read once from the model's own metadata at load
(:func:`layout_of`), so the server never guesses a model's shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.buckets import Bucketed, DynamicBatch


@dataclass
class Axis:
    """A varying non-batch axis (a bucketed dim such as the sequence length)."""
    inputs: list                 # [(flat input index, dim)]
    outputs: list                # [(output index, dim)] that follow the axis
    sizes: list                  # the bucket sizes, ascending
    pads: dict                   # flat input index -> pad value

    def bucket(self, size: int) -> int:
        for s in self.sizes:
            if size <= s:
                return s
        return size


@dataclass
class Layout:
    """Which dims of a model's inputs and outputs vary, and how requests may be merged."""
    input_var: list              # per flat input: set of variable dims
    output_var: list             # per output: set of variable dims
    batch_inputs: list           # per flat input: dim 0 is the batch dim
    batch_outputs: list          # per output: dim 0 is the batch dim
    max_rows: int | None = None  # largest batch the model takes (None: any)
    axes: list = field(default_factory=list)   # varying non-batch axes
    mixed: bool = False          # an axis mixes dim 0 with other dims: never merge
    batch_sizes: list | None = None  # a bucketed batch dim: the compiled batch sizes

    @property
    def batchable(self) -> bool:
        return (not self.mixed and bool(self.batch_inputs) and all(self.batch_inputs)
                and all(self.batch_outputs) and bool(self.batch_outputs))

    def fit(self, rows: int) -> int:
        """The most rows, up to ``rows``, that a bucketed batch dim runs without padding rows
        (its largest bucket that fits). Dynamic batch pads its last chunk whatever we do."""
        if self.batch_sizes:
            fits = [s for s in self.batch_sizes if s <= rows]
            return fits[-1] if fits else rows
        return rows

    def bucket_rows(self, rows: int) -> int:
        """The batch size the model really computes for ``rows`` rows (its bucket)."""
        if self.batch_sizes:
            return next((s for s in self.batch_sizes if s >= rows), rows)
        return rows

    def choose(self, rows: int, cost) -> int:
        """How many of ``rows`` waiting rows to run now: trimmed to a filled bucket, or all of
        them padded to the next bucket, whichever ``cost(bucket)`` (seconds, or None when not
        measured yet; unmeasured is tried) makes cheaper per real row."""
        down, up = self.fit(rows), self.bucket_rows(rows)
        if not self.batch_sizes or down == rows or up == rows or down > rows:
            return down
        c_up, c_down = cost(up), cost(down)
        if c_up is None:
            return rows
        if c_down is None:
            return down
        return rows if c_up / rows < c_down / down else down

    def sizes(self, flat) -> tuple:
        """The request's size on every varying non-batch axis."""
        return tuple(flat[ax.inputs[0][0]].shape[ax.inputs[0][1]] for ax in self.axes)

    def key(self, sizes) -> tuple:
        """Requests with the same key may share a batch: the same bucket on every axis."""
        return tuple(ax.bucket(s) for ax, s in zip(self.axes, sizes))


def layout_of(model) -> Layout:
    """The :class:`Layout` of a loaded kiln model (CompiledModel, Bucketed, DynamicBatch;
    any other kind is treated as fixed-shape)."""
    if isinstance(model, DynamicBatch):
        return _dynamic_batch_layout(model)
    n_in, n_out = len(model.input_specs), len(model.output_specs)
    lay = Layout([set() for _ in range(n_in)], [set() for _ in range(n_out)],
                 [False] * n_in, [False] * n_out)
    if not isinstance(model, Bucketed):
        return lay
    for a, ax in enumerate(model.axes):
        members = [(int(i), int(d)) for i, d in ax["inputs"]]
        outs = [(int(o), int(d)) for o, d, aa in model.output_dims if aa == a]
        for i, d in members:
            lay.input_var[i].add(d)
        for o, d in outs:
            lay.output_var[o].add(d)
        if all(d == 0 for _, d in members):
            # a bucketed batch dim: variable batch up to the largest bucket
            for i, _ in members:
                lay.batch_inputs[i] = True
            for o, d in outs:
                if d == 0:
                    lay.batch_outputs[o] = True
            lay.max_rows = max(ax["sizes"])
            lay.batch_sizes = sorted(set(ax["sizes"]))
        else:
            if any(d == 0 for _, d in members) or any(d == 0 for _, d in outs):
                lay.mixed = True
            pads = {i: model.pad_values.get(str(i), 0) for i, _ in members}
            lay.axes.append(Axis(members, outs, sorted(set(ax["sizes"])), pads))
    return lay


def _dynamic_batch_layout(model) -> Layout:
    """A ``DynamicBatch`` model: its inner model's layout, plus dim 0 of every input and output
    whose compiled dim 0 is the compiled batch size (as ``DynamicBatch`` itself decides)."""
    inner = layout_of(model.inner)
    batched_in = [len(s.shape) > 0 and s.shape[0] == model.batch_size for s in model.inner.input_specs]
    batched_out = [len(s.shape) > 0 and s.shape[0] == model.batch_size for s in model.inner.output_specs]
    lay = Layout([set(s) for s in inner.input_var], [set(s) for s in inner.output_var],
                 batched_in, batched_out, None, inner.axes, inner.mixed)
    for i, b in enumerate(batched_in):
        if b:
            lay.input_var[i].add(0)
    for o, b in enumerate(batched_out):
        if b:
            lay.output_var[o].add(0)
    return lay
