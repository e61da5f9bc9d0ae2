"""Shapes: bucketing and dynamic batch for static-shape compiled graphs.

Engines compile for fixed shapes, and real inputs vary. Two adapters wrap
compiled models and are saved as artifacts that nest them:

* ``Bucketed``: several variants of one model compiled at different sizes of
  some dims (the *axes*, e.g. sequence length). A call runs the smallest variant
  that fits, pads inputs up to it with each input's pad value, and slices the
  outputs back along the dims that follow the axes (inferred from the variants'
  output shapes, or declared).
* ``DynamicBatch``: any batch size on dim 0, split into compile-size chunks,
  the last one padded by repeating its last row (real data, so no NaN from an
  all-padding row), outputs concatenated and trimmed: only for a model proven at
  trace time to answer so (:func:`kiln.runtime.synthetic_rows.proven_rows`).
"""
from __future__ import annotations

import time

import torch

from kiln.artifact import schema, specs
from kiln.artifact.container import POOLED_FORMAT, Artifact, wrapper_manifest
from kiln.errors import ArtifactError, CompilerArgsError, InputError
from kiln.runtime import ort_pool
from kiln.runtime.bucket_meta import FlattenView, IndexPlan, check_variants, shown_specs
from kiln.runtime.model import DEFAULT, CompiledModel, Model
from kiln.runtime.synthetic_rows import proven_rows, row_multiple


class _Wrapper(Model):
    """Shared plumbing of models that wrap others: placement and naming."""

    def _init_common(self, manifest, first):
        self.manifest = manifest
        self.arg_names = first.arg_names
        self.input_structure = first.input_structure
        self.output_structure = first.output_structure
        self.output_specs = first.output_specs

    def flatten(self, args, kwargs):
        return self.inner_models()[0].flatten(args, kwargs)

    def _place(self, core, worker=None):
        from kiln.runtime.workers import Worker
        worker = worker or Worker(core.cpus, name=f"kiln-core{core.id}")
        for m in self.inner_models():
            m._place(core, worker)
        object.__setattr__(self, "core", core)
        if getattr(self, "metrics", None) is not None:
            self.metrics.core = core.id

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.inner_models())


# -- bucketing ------------------------------------------------------------------------
class Bucketed(_Wrapper):
    """Variants of one model compiled at several sizes; see the module docstring."""

    def __init__(self, variants, meta: dict, manifest: dict | None = None):
        super().__init__()
        first = variants[0]
        self.variants = list(variants)
        self.axes = meta["axes"]                 # [{"inputs": [[flat, dim], ...], "sizes": [...]}]
        self.pad_values = meta["pad_values"]     # flat index (str) -> value
        self.output_dims = meta["output_dims"]   # [[output, dim, axis], ...]
        self.variant_sizes = [v["sizes"] for v in meta["variants"]]
        self.compile_seconds = [v.get("compile_seconds") for v in meta["variants"]]
        self._init_common(manifest or {}, first)
        self.input_specs = first.input_specs
        self._bucketed = {(i, d): a for a, ax in enumerate(self.axes) for i, d in ax["inputs"]}
        self._cache: dict = {}
        self.nonfinite = frozenset().union(*(v.nonfinite for v in self.variants))
        # an index range every bucket shares (an embedding's rows) is checked as a compiled model
        # checks it; one that grows with the bucket (an index into a padded dim) against the
        # caller's actual size of that dim (kiln.runtime.bucket_meta)
        self._indices = IndexPlan(self.variants, self.variant_sizes)
        self.index_ranges = self._indices.shared
        self.shown_specs = shown_specs(self.input_specs, self.axes)
        self._flatten_view = FlattenView(self, self.shown_specs, getattr(first, "_plain", None),
                                         getattr(first, "manifest", None) or {})
        from kiln.observe import announce_model
        from kiln.observe.metrics import ModelMetrics
        self.metrics = ModelMetrics(self.name, "bucketed")
        self.metrics.core = first.core.id if first.core is not None else None
        for v in self.variants:   # the variants' own counters are details of this model's
            v.metrics.parent = self.metrics.id
        announce_model(self.metrics)
        # smallest first, so the first variant that fits is the cheapest
        self._order = sorted(range(len(variants)),
                             key=lambda k: (_volume(self.variant_sizes[k]), self.variant_sizes[k]))

    def inner_models(self):
        return self.variants

    def flatten(self, args, kwargs):
        """A compiled model's flattening, whose messages show the bucketed dims' range of
        lengths (``expected (2, 1..64) int64``), not the smallest variant's shape."""
        return CompiledModel.flatten(self._flatten_view, args, kwargs)

    def describe_buckets(self) -> str:
        parts = []
        for a, ax in enumerate(self.axes):
            members = ", ".join(f"{self.input_specs[i].name} dim {d}" for i, d in ax["inputs"])
            parts.append(f"axis {a} ({members}): {sorted(set(ax['sizes']))}")
        return "; ".join(parts)

    def _select(self, flat):
        """(variant index, actual size per axis) for these inputs, or InputError.

        Serving sees the same few shapes again and again: the answer is cached
        per (shapes, dtypes, devices), so a call pays a dict lookup, not a scan."""
        key = tuple((t.shape, t.dtype, t.device.type) for t in flat)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        found = self._scan(flat)
        if len(self._cache) < 1024:
            self._cache[key] = found
        return found

    def _scan(self, flat):
        specs0 = self.input_specs
        if len(flat) != len(specs0):
            raise InputError(f"expected {len(specs0)} input tensors, got {len(flat)}")
        actual = [None] * len(self.axes)
        for i, (t, spec) in enumerate(zip(flat, specs0)):
            if t.dtype != spec.dtype or t.dim() != len(spec.shape):
                raise InputError(f"input '{spec.name}': expected {len(spec.shape)}-d {self.shown_specs[i].describe()}, got "
                                 f"{tuple(t.shape)} {specs.dtype_name(t.dtype)}")
            if t.device.type != "cpu":
                raise InputError(f"input '{spec.name}': expected a CPU tensor, got one on {t.device}")
            for d, size in enumerate(t.shape):
                a = self._bucketed.get((i, d))
                if a is None:
                    if size != spec.shape[d]:
                        raise InputError(f"input '{spec.name}': dim {d} must be {spec.shape[d]} "
                                         f"(it is not bucketed), got {tuple(t.shape)}")
                elif actual[a] is None:
                    actual[a] = (size, spec.name)
                elif actual[a][0] != size:
                    raise InputError(
                        f"input '{spec.name}' dim {d} is {size} but '{actual[a][1]}' has "
                        f"{actual[a][0]} on the same bucketed axis; they must match")
        sizes = [a[0] for a in actual]
        for k in self._order:
            if all(s <= b for s, b in zip(sizes, self.variant_sizes[k])):
                return k, sizes
        for a, s in enumerate(sizes):
            largest = max(ax for ax in self.axes[a]["sizes"])
            if s > largest:
                i, d = self.axes[a]["inputs"][0]
                raise InputError(
                    f"input '{self.input_specs[i].name}' dim {d} is {s}, larger than the largest "
                    f"bucket ({largest}); buckets: {self.describe_buckets()}. Compile a larger "
                    "bucket or split the input")
        raise InputError(f"no bucket fits sizes {sizes}; buckets: {self.describe_buckets()}")

    def check(self, flat):
        k, sizes = self._select(flat)
        self._check_values(flat)
        self._indices.check(flat, k, sizes)

    def run_flat(self, flat):
        k, sizes = self._select(flat)
        target = self.variant_sizes[k]
        self.metrics.record_bucket(target)
        start = time.perf_counter()
        try:
            outs = self._run_variant(k, sizes, target, flat)
        except BaseException:
            self.metrics.record_failure()
            raise
        self.metrics.record_call(time.perf_counter() - start, flat, outs, device=0.0, host=0.0)  # the variant's
        return outs

    def _run_variant(self, k, sizes, target, flat):
        if sizes == target:     # an exact bucket: nothing to pad or slice
            return self.variants[k].run_flat(flat)
        padded = []
        for i, t in enumerate(self._indices.from_caller_end(flat, sizes, target)):
            pads = []
            for d in range(t.dim() - 1, -1, -1):   # F.pad wants the last dim first
                a = self._bucketed.get((i, d))
                pads += [0, (target[a] - sizes[a]) if a is not None else 0]
            if any(pads):
                t = torch.nn.functional.pad(t, pads, value=self.pad_values.get(str(i), 0))
            padded.append(t)
        outs = self.variants[k].run_flat(padded)
        for o, d, a in self.output_dims:
            if sizes[a] != target[a]:
                outs[o] = outs[o].narrow(d, 0, sizes[a]).contiguous()
        return outs

    def to_bytes(self) -> bytes:
        # the variants' common ONNX Runtime weights stored once (kiln.runtime.ort_pool)
        blobs, pooled = ort_pool.serialized({f"variants/{k}.kiln": v for k, v in enumerate(self.variants)})
        manifest = dict(self.manifest, format_version=POOLED_FORMAT) if pooled else self.manifest
        return Artifact(manifest, blobs).to_bytes()

    def __repr__(self):
        return f"kiln.Bucketed({self.name}; {len(self.variants)} variants; {self.describe_buckets()})"


def _volume(sizes):
    v = 1
    for s in sizes:
        v *= s
    return v


def load_bucketed(art, opts, source, core=DEFAULT, worker=None, load_nested=None):
    meta = schema.check_buckets(art.manifest, art.blobs, source)
    worker, core = _shared_worker(core, worker)
    variants = [load_nested(art.nested(v["blob"], f"{source}:{v['blob']}"),
                              opts, f"{source}:{v['blob']}", core=core, worker=worker)
                for v in meta["variants"]]
    check_variants(meta, variants, source)
    m = Bucketed(variants, meta, art.manifest)
    if core not in (None, DEFAULT):
        object.__setattr__(m, "core", core)
    return m


def _shared_worker(core, worker):
    """Variants of one wrapper share one pinned worker rather than one each."""
    from kiln.runtime.model import resolve_placement
    from kiln.runtime.workers import Worker
    if core is DEFAULT:
        core = resolve_placement()
    if core is not None and worker is None:
        worker = Worker(core.cpus, name=f"kiln-core{core.id}")
    return worker, core


# -- dynamic batch ------------------------------------------------------------------------------
class DynamicBatch(_Wrapper):
    """Any batch size on dim 0 for a model compiled at one batch size."""

    def __init__(self, inner: Model, manifest: dict | None = None, track: bool = True):
        super().__init__()
        if isinstance(inner, DynamicBatch):
            inner = inner.inner
        if isinstance(inner, Bucketed) and any(d == 0 for ax in inner.axes for _, d in ax["inputs"]):
            raise CompilerArgsError("the batch dim is bucketed already; dynamic batch is not needed")
        self.inner = inner
        self.input_specs = inner.input_specs
        self.nonfinite = inner.nonfinite
        self.index_ranges = inner.index_ranges
        lead = [s.shape[0] for s in inner.input_specs if len(s.shape)]
        if not lead:
            raise CompilerArgsError("dynamic batch needs inputs with a batch dim (dim 0)")
        self.batch_size = lead[0]
        # inputs split by rows: those with the batch on dim 0 (DataParallel's rule). Outputs with it
        # there may follow the rows (x.mean(0) of 8 features at batch 8 does not): proven at trace time
        self._batched_in = with_batch_dim(inner.input_specs, self.batch_size)
        self._batched_out = with_batch_dim(inner.output_specs, self.batch_size)
        self._init_common(manifest or wrapper_manifest(
            "dynamic_batch", inner.manifest, dynamic_batch={"batch_size": self.batch_size,
                                                            "inner": "inner.kiln"}), inner)
        # which outputs are joined from the chunks, from the trace-time proof; None: not proven, and a
        # call is not split (``_why`` says why), never decided from a call's rows (all alike, they cannot tell)
        self._follows, self._why = proven_rows(self.manifest, inner.manifest, self._batched_out)
        # the caller's calls and bytes, as a bucketed model counts them: the inner model's
        # counters are its chunks (a 7-row call on a 2-row model was 4 calls in kiln.metrics(),
        # kiln top and kiln monitor, and its padded bytes). ``track=False``: a checker only
        # (DataParallel's), which runs nothing
        self.metrics = None
        if track:
            from kiln.observe import announce_model
            from kiln.observe.metrics import ModelMetrics
            self.metrics = ModelMetrics(self.name, "dynamic_batch")
            self.metrics.core = inner.core.id if inner.core is not None else None
            if getattr(inner, "metrics", None) is not None:
                inner.metrics.parent = self.metrics.id
            announce_model(self.metrics)

    def inner_models(self):
        return [self.inner]

    def _batch(self, flat) -> int:
        n = None
        for t, batched, spec in zip(flat, self._batched_in, self.input_specs):
            if not batched:
                continue
            if t.dim() == 0:
                raise InputError(f"input '{spec.name}': expected a batch dim, got a scalar")
            if n is None:
                n, first = t.shape[0], spec.name
            elif t.shape[0] != n:
                if self.batch_size in (n, t.shape[0]):   # one of them may be a table all rows share
                    shared = spec.name if t.shape[0] == self.batch_size else first
                    raise InputError(
                        f"dynamic batch: input '{spec.name}' has {t.shape[0]} rows but '{first}' has {n}: inputs with "
                        f"the compiled batch ({self.batch_size}) on dim 0 are split by rows, as DataParallel splits "
                        f"them. If '{shared}' is shared by every row (a table), it cannot be told from a per-row "
                        "input: compile with its dim 0 unlike the batch, or at each batch size you need")
                raise InputError(f"dynamic batch: input '{spec.name}' has batch {t.shape[0]} but "
                                 f"'{first}' has {n}; all batched inputs must agree")
        return n

    def settle_rows(self, follows):
        """The compiler's verdict (kiln.compiler.api): which outputs follow the rows, kept in the manifest."""
        self._follows, self._why = list(follows), None
        if isinstance(self.manifest.get("dynamic_batch"), dict):
            self.manifest["dynamic_batch"]["follows_rows"] = list(follows)

    def refusal(self, n: int, split: str) -> InputError:
        """The error for a call of ``n`` rows that would be ``split`` with no proof that it may be."""
        return InputError(
            f"{split}: a batch of {n} rows would be split into chunks of the compiled {self.batch_size}, and that "
            f"is not proven to give the model's answers: {self._why}. Call with {self.batch_size} rows, or trace "
            "with kiln.trace(..., dynamic_batch=True) (torch_neuron: dynamic_batch_size=True), which checks the "
            "model against eager; a model that mixes rows must be compiled at each batch size you need")

    @property
    def _multiple(self) -> int:     # read when asked: kiln.trace records its batch check after wrapping
        return row_multiple(self.manifest, self.inner.manifest)

    def _check_multiple(self, n: int):
        """A call of a row count the trace-time check could not run in eager (an odd count for a
        model of row pairs) is refused: eager itself has no answer for it."""
        if n != self.batch_size and n % self._multiple:
            check = self.manifest.get("batch_check") or self.inner.manifest.get("row_check") or {}
            failed = (check.get("skipped_rows") or ["other counts"])[0]
            raise InputError(
                f"dynamic batch: a batch of {n} rows, but this model takes only multiples of {self._multiple} rows "
                f"split into chunks of {self.batch_size}: kiln.trace checked it against eager PyTorch at such a "
                f"count, and eager failed on others ({failed}); call with a multiple of {self._multiple} rows")

    def _chunk(self, flat, start, n):
        out = []
        for t, batched in zip(flat, self._batched_in):
            if batched:
                t = t[start:start + self.batch_size]
                if t.shape[0] < self.batch_size:
                    fill = t[-1:].expand(self.batch_size - t.shape[0], *t.shape[1:])
                    t = torch.cat([t, fill])
            out.append(t)
        return out

    def check(self, flat):
        if len(flat) != len(self.input_specs):
            raise InputError(f"expected {len(self.input_specs)} input tensors, got {len(flat)}")
        # The inner model checks shapes exactly, except a bucketed one: it is probed below.
        exact = not isinstance(self.inner, Bucketed)
        for i, (t, spec, batched) in enumerate(zip(flat, self.input_specs, self._batched_in)):
            want = tuple(spec.shape)
            fits = t.dim() == len(want) and (tuple(t.shape[1:]) == want[1:] if batched
                                             else tuple(t.shape) == want)
            if t.dtype != spec.dtype or t.dim() != len(want) or (exact and not fits):
                dims = self.inner.shown_specs[i].dims if not exact else [str(n) for n in want]
                shown = "(" + ", ".join(["N", *dims[1:]] if batched else dims)
                shown += ",)" if len(want) == 1 else ")"
                # the problem first: a dtype is not a shape (a bool mask for a float32 one)
                what = (f"input '{spec.name}' is {specs.dtype_name(t.dtype)}, but the model was compiled for "
                        f"{specs.dtype_name(spec.dtype)}" if t.dtype != spec.dtype else
                        f"only dim 0 may differ from the compiled shapes (batch {self.batch_size})")
                raise InputError(
                    f"dynamic batch: {what}; input '{spec.name}': expected {shown} "
                    f"{specs.dtype_name(spec.dtype)}{' (any batch size N)' if batched else ''}, "
                    f"got {tuple(t.shape)} {specs.dtype_name(t.dtype)}")
        self._check_values(flat)
        n = self._batch(flat)
        self._check_multiple(n)
        if n == 0:
            self._check_empty(flat)
            return
        probe = [t[:1].expand(self.batch_size, *t.shape[1:]) if b and t.dim() else t
                 for t, b in zip(flat, self._batched_in)]
        try:
            self.inner.check(probe)
        except InputError as e:     # the bucketed model's own words: its sizes, not the batch's
            raise type(e)(f"dynamic batch (compiled batch {self.batch_size}, any size on dim 0): {e}") from None
        if not exact:   # the probe is the first row: indices into a bucketed dim, every row's
            self.inner._indices.check(flat, *self.inner._select(probe))
        if n != self.batch_size and self._follows is None:
            raise self.refusal(n, "dynamic batch")

    def _empty_shapes(self, flat) -> list:
        """The outputs' shapes for these inputs but for dim 0: a bucketed model's bucketed
        dims are the caller's sizes (0 rows at length 5 are (0, 5, ...), not the smallest
        bucket's (0, 4, ...)). InputError where no bucket fits."""
        if not isinstance(self.inner, Bucketed):
            return [list(s.shape) for s in self.inner.output_specs]
        probe = [t.new_zeros((1, *t.shape[1:])).expand(self.batch_size, *t.shape[1:]) if b and t.dim() else t
                 for t, b in zip(flat, self._batched_in)]
        k, sizes = self.inner._select(probe)
        shapes = [list(s.shape) for s in self.inner.variants[k].output_specs]
        for o, d, a in self.inner.output_dims:
            shapes[o][d] = sizes[a]
        return shapes

    def _check_empty(self, flat):
        """A batch of 0 rows has an answer (0 rows of each output) when every output
        follows the batch; inputs must still be on a device the model takes."""
        devices = getattr(self.inner, "_devices", ("cpu",))
        for t, spec in zip(flat, self.input_specs):
            if t.device.type not in devices:
                raise InputError(f"input '{spec.name}': expected a CPU tensor, got one on {t.device}")
        try:
            self._empty_shapes(flat)    # a bucketed model's sizes must fit a bucket, rows or not
        except InputError as e:
            raise type(e)(f"dynamic batch (compiled batch {self.batch_size}, any size on dim 0): {e}") from None
        if self._follows is None:
            raise self.refusal(0, "dynamic batch")
        if not all(self._follows):
            fixed = [s.name for s, f in zip(self.inner.output_specs, self._follows) if not f]
            raise InputError(f"dynamic batch: the batch is empty, and output(s) {', '.join(fixed)} do "
                             "not follow the batch dim, so there is no answer for 0 rows")

    def run_flat(self, flat):
        if self.metrics is None:
            return self._run(flat)
        start = time.perf_counter()
        try:
            outs = self._run(flat)
        except BaseException:
            self.metrics.record_failure()
            raise
        self.metrics.record_call(time.perf_counter() - start, flat, outs, device=0.0, host=0.0)  # the chunks'
        return outs

    def _run(self, flat):
        n = self._batch(flat)
        if n == self.batch_size:
            return self.inner.run_flat(flat)
        if self._follows is None:       # check() refuses such a call; run_flat may come without it
            raise self.refusal(n, "dynamic batch")
        self._check_multiple(n)
        if n == 0:      # every output follows the batch (check): 0 rows of each
            device = next(t.device for t, b in zip(flat, self._batched_in) if b)
            return [torch.empty((0, *shape[1:]), dtype=s.dtype, device=device)
                    for shape, s in zip(self._empty_shapes(flat), self.inner.output_specs)]
        first = self._chunk(flat, 0, n)
        pieces = [self.inner.run_flat(first)]
        pieces += [self.inner.run_flat(self._chunk(flat, s, n)) for s in range(self.batch_size, n, self.batch_size)]
        outs = []
        for o, batched in enumerate(self._follows):
            if batched:
                outs.append(torch.cat([p[o] for p in pieces])[:n])
            else:
                outs.append(pieces[0][o])
        return outs

    def to_bytes(self) -> bytes:
        return Artifact(self.manifest, {"inner.kiln": self.inner.to_bytes()}).to_bytes()

    def __repr__(self):
        return f"kiln.DynamicBatch({self.inner!r}, compiled batch {self.batch_size})"


def with_batch_dim(specs, batch_size, dim=0) -> list:
    """Per tensor: whether it has the compiled batch on ``dim``. Inputs that do are split by rows, others
    (a bias every row shares) go whole to each chunk; an output that does may follow the rows."""
    return [len(s.shape) > dim and s.shape[dim] == batch_size for s in specs]


def load_dynamic_batch(art, opts, source, core=DEFAULT, worker=None, load_nested=None):
    inner = load_nested(art.nested("inner.kiln", f"{source}:inner"), opts,
                          f"{source}:inner", core=core, worker=worker)
    try:
        return DynamicBatch(inner, art.manifest)
    except CompilerArgsError as e:   # the inner model cannot take a dynamic batch
        raise ArtifactError(f"{source}: {e}") from None


def dynamic_batch(model: Model) -> DynamicBatch:
    """Let ``model`` take any batch size on dim 0 (Neuron's ``dynamic_batch``, which also
    takes a model back from ``torch.jit.load``: :mod:`kiln.compat.neuronx`)."""
    if not isinstance(model, Model):
        raise CompilerArgsError(f"dynamic_batch takes a kiln model, got {type(model).__name__}")
    return model if isinstance(model, DynamicBatch) else DynamicBatch(model)
