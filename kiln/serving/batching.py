"""Dynamic batching for served models: queue requests, merge them, split results back.

``kiln serve`` (``kiln/serve.py``) hands every checked request to its model's
:class:`Batcher`. The batcher owns the model's instances (copies of the model,
one per kiln core with ``--instances N``) and a bounded queue:

* **Admission.** A request joins the queue unless the queue already holds
  ``max_queue`` requests; then it fails at once with :class:`Overloaded`
  (HTTP 503), so an overloaded server answers quickly instead of piling up work.
* **Collection.** When an instance is free, the oldest waiting request opens a
  batch. Requests that can share its batch (see *merging* below) join it until
  the batch holds ``max_batch_size`` rows or the oldest request has waited
  ``max_queue_delay`` (0 with batching off). Requests that cannot join stay
  queued, in order, for the next free instance.
* **Execution.** The merged inputs run on the free instance in a worker thread
  (``loop.run_in_executor``); the outputs are split back per request. If a
  merged batch fails, its requests are retried one by one, so one bad request
  fails alone.
* **Timeouts.** A request that times out is dropped from the queue (if still
  queued) and its result discarded (if running).

Merging. Requests are concatenated along dim 0, the batch dim, which every
input and output of a batchable model has: a ``DynamicBatch`` model (any batch
size) or a ``Bucketed`` one bucketed on dim 0 of every input (up to its largest
batch bucket). With a bucketed batch dim, ``n`` waiting rows can run either
trimmed to the largest batch bucket they fill (no padding rows; the rest waits
for the next free instance) or padded up to the next bucket. The batcher
chooses by measurement: it keeps the observed latency of every (group, batch
bucket) it has run and takes whichever costs less per real row; a bucket not
yet measured is tried once, so the choice follows this machine's numbers.
Other models run each request alone. Non-batch dims that vary
(bucketed axes such as the sequence length) are handled by *bucket grouping*:
only requests that fall in the same bucket of every such axis are merged; they
are padded to the longest request of the group with each input's pad value
(``pad_values`` at compile time, default 0), the model pads the rest of the way
to its bucket exactly as it does for a single call, and each request's outputs
are sliced back to its own length along the output dims that follow the axis.
This is correct for the same models bucketing is correct for: padding must not
change the unpadded part of the result (masked attention, per-position ops),
and rows of a batch must not interact (no batch norm in training mode, no
cross-row reductions, no activation scale per batch).

The server does not assume it: :func:`check_merging` runs a model on merged
batches of distinct synthetic rows, padded as this module pads them, and
compares every row with that row run alone; a model that fails it is never
merged (:meth:`Batcher.disable`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import math
import time
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError


class Overloaded(KilnError):
    """The model's queue is full; the client should retry later (HTTP 503)."""


class Unavailable(KilnError):
    """The model is not ready, or the server is shutting down (HTTP 503)."""


class RequestTimeout(KilnError):
    """The request did not finish within its timeout (HTTP 504)."""


# -- what a model lets us merge ---------------------------------------------------------------
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
    from kiln.runtime.buckets import Bucketed, DynamicBatch
    n_in, n_out = len(model.input_specs), len(model.output_specs)
    if isinstance(model, DynamicBatch):
        inner = layout_of(model.inner)
        lay = Layout([set(s) for s in inner.input_var], [set(s) for s in inner.output_var],
                     list(model._batched_in), list(model._batched_out), None, inner.axes, inner.mixed)
        for i, b in enumerate(model._batched_in):
            if b:
                lay.input_var[i].add(0)
        for o, b in enumerate(model._batched_out):
            if b:
                lay.output_var[o].add(0)
        return lay
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


# -- merging and splitting ---------------------------------------------------------------------
def _pad_to(t: torch.Tensor, dims: dict, value) -> torch.Tensor:
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
        parts = [_pad_to(r.flat[i], grow, value) if grow else r.flat[i] for r in requests]
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
_MERGE_TOL = {torch.float16: (1e-3, 1e-2), torch.bfloat16: (1e-2, 2e-2)}
_MERGE_TOL_DEFAULT = (1e-5, 1e-4)


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


def _synthetic_row(spec, i, layout: Layout, lengths, gen) -> torch.Tensor:
    """One row (batch 1) of flat input ``i``: random floats, or 0/1 for ints and bools (valid
    ids and masks), the first entry 1 (no all-masked row); bucketed axes at ``lengths``."""
    shape = [1] + [int(n) for n in spec.shape[1:]]
    for a, ax in enumerate(layout.axes):
        for ii, d in ax.inputs:
            if ii == i:
                shape[d] = lengths[a]
    dtype = spec.dtype
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(0, 2, shape, generator=gen).to(dtype)
        if t.numel():
            t.view(-1)[0] = 1
    return t


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
    atol, rtol = _MERGE_TOL.get(alone.dtype, _MERGE_TOL_DEFAULT)
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


MERGE_CHECK_ROWS = 8     # rows of a merged batch compared with the row alone (plus the last one)


def check_merging(model, layout: Layout, max_rows: int, seed: int = 0) -> MergeCheck:
    """Prove on synthetic inputs that the batcher's merging does not change ``model``'s answers.

    Builds ``max_rows`` distinct one-row requests (random floats, 0/1 ints; rows of a bucketed
    axis at different lengths within one bucket), merges them exactly as the batcher does
    (concatenated on dim 0, padded to the group's longest, and by the model to its batch bucket
    or chunk), and compares the rows' outputs (the first ``MERGE_CHECK_ROWS`` and the last, which
    a chunked batch pads with) with each row run alone. Rows of a model that normalises across
    the batch, or sees its padding, differ: such a model must not be merged."""
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    specs = list(model.input_specs)
    spans = [_axis_lengths(ax) for ax in layout.axes]
    rows = []
    for r in range(max_rows):
        lengths = [hi - r % (hi - lo + 1) for lo, hi in spans]    # the longest first, then shorter
        rows.append([_synthetic_row(s, i, layout, lengths, gen) for i, s in enumerate(specs)])
    names = [s.name for s in model.output_specs]
    result = MergeCheck(True, [])
    alone: dict = {}
    for n in _merge_sizes(layout, max_rows):
        reqs = []
        for flat in rows[:n]:
            sizes = layout.sizes(flat)
            reqs.append(Request(flat, 1, sizes, layout.key(sizes), None, 0.0))
        shown = reqs if n <= 2 * MERGE_CHECK_ROWS else reqs[:MERGE_CHECK_ROWS]
        case = f"{n} rows" + "".join(
            f", lengths {' '.join(str(r.sizes[a]) for r in shown)}{' ...' if len(shown) < n else ''}"
            for a in range(len(layout.axes)))
        result.cases.append(case)
        try:
            flat, targets = merge(reqs, layout)
            merged = split(model.run_flat(flat), reqs, layout, targets)
        except Exception as e:  # noqa: BLE001 - a batch the model cannot run is not mergeable
            result.safe, result.case = False, case
            result.error = f"the merged batch of {case} failed: {type(e).__name__}: {e}"
            break
        for r in sorted(set(range(min(n, MERGE_CHECK_ROWS))) | {n - 1}):
            if r not in alone:
                try:
                    alone[r] = model.run_flat(rows[r])
                except Exception as e:  # noqa: BLE001 - the model's own failure: nothing proven
                    result.safe = False
                    result.error = f"a synthetic row alone failed: {type(e).__name__}: {e}"
                    break
            for o, (m, a) in enumerate(zip(merged[r], alone[r])):
                diff, allowed, tol = _row_diff(m, a)
                result.max_diff = max(result.max_diff, diff)
                if diff > allowed and result.safe:
                    result.safe = False
                    result.output, result.case, result.row, result.tolerance = names[o], case, r, tol
        if not result.safe:
            break
    result.seconds = time.perf_counter() - started
    return result


# -- the batcher ---------------------------------------------------------------------------------
class Request:
    __slots__ = ("flat", "rows", "sizes", "key", "future", "arrival")

    def __init__(self, flat, rows, sizes, key, future, arrival):
        self.flat, self.rows, self.sizes, self.key = flat, rows, sizes, key
        self.future, self.arrival = future, arrival


class Batcher:
    """One served model's queue, collector and instances; see the module docstring.

    ``observe(kind, value)`` receives ``queue_seconds`` (per request),
    ``inference_seconds`` and ``batch_size`` (rows, per executed batch) and
    ``queue_depth``; the server feeds them to Prometheus.
    """

    def __init__(self, name: str, instances: list, layout: Layout, *, max_batch_size: int = 8,
                 max_queue_delay_ms: float = 5.0, max_queue: int = 128, observe=None, log=None):
        if not instances:
            raise ValueError("a batcher needs at least one model instance")
        self.name = name
        self.instances = list(instances)
        self.layout = layout
        self.batching = layout.batchable and max_batch_size > 1
        # why requests are not merged (None while they are)
        self.off_reason = (None if self.batching else
                           "turned off (max_batch_size 1)" if layout.batchable else
                           "the model's inputs and outputs do not all have a variable batch dim (dim 0)")
        limit = layout.max_rows if layout.max_rows is not None else max_batch_size
        self.max_batch_size = max(1, min(max_batch_size, limit)) if self.batching else 1
        self.delay = max(0.0, max_queue_delay_ms) / 1e3 if self.batching else 0.0
        self.max_queue = max(1, int(max_queue))
        self._observe = observe or (lambda kind, value: None)
        self._log = log or (lambda *a, **k: None)
        self._pending: collections.deque = collections.deque()
        self._free: asyncio.Queue | None = None
        self._wake: asyncio.Event | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.instances), thread_name_prefix=f"kiln-serve-{name}")
        self._task = None
        self._running: set = set()
        self._closing = False
        self._flush = False
        self.depth = 0
        self._cost: dict = {}    # (group key, batch bucket) -> smoothed seconds per run

    def disable(self, reason: str):
        """Run every request alone from now on (call before :meth:`start`)."""
        self.batching, self.off_reason = False, reason
        self.max_batch_size, self.delay = 1, 0.0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self):
        """Start collecting (call from the event loop)."""
        self._free = asyncio.Queue()
        for k in range(len(self.instances)):
            self._free.put_nowait(k)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._collect(), name=f"batcher-{self.name}")

    def flush(self):
        """Stop waiting for batches to fill: run what is queued as soon as instances are free."""
        self._flush = True
        if self._wake is not None:
            self._wake.set()

    async def close(self):
        """Finish every queued and running request, then stop."""
        self._closing = True
        self.flush()
        if self._task is not None:
            await self._task
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)

    # -- requests -----------------------------------------------------------------------------
    async def submit(self, flat, rows: int, timeout: float | None = None):
        """Queue checked flat inputs (``rows`` along dim 0) and return their flat outputs."""
        if self._closing or self._task is None:
            raise Unavailable(f"model '{self.name}' is not accepting requests (shutting down)")
        if self.depth >= self.max_queue:
            raise Overloaded(f"model '{self.name}' is overloaded: {self.depth} requests queued "
                             f"(max_queue {self.max_queue}); retry later")
        loop = asyncio.get_running_loop()
        sizes = self.layout.sizes(flat) if self.batching else ()
        req = Request(flat, rows, sizes, self.layout.key(sizes), loop.create_future(), loop.time())
        self._pending.append(req)
        self.depth += 1
        self._observe("queue_depth", self.depth)
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(req.future), timeout)
        except asyncio.TimeoutError:
            req.future.cancel()     # dropped from the queue, or its result discarded
            raise RequestTimeout(f"model '{self.name}': request timed out after "
                                 f"{timeout * 1e3:.0f} ms") from None

    def _drop_dead(self):
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
            self.depth -= 1

    async def _wait(self, timeout=None):
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _gather(self):
        """The next batch (oldest request first), or None when closing with nothing queued."""
        loop = asyncio.get_running_loop()
        while True:
            self._drop_dead()
            if not self._pending:
                if self._closing:
                    return None
                await self._wait()
                continue
            head = self._pending[0]
            if not self.batching or head.rows >= self.max_batch_size or self._flush:
                break
            deadline = head.arrival + self.delay
            rows = sum(r.rows for r in self._pending if r.key == head.key and not r.future.done())
            now = loop.time()
            if rows >= self.max_batch_size or now >= deadline:
                break
            await self._wait(deadline - now)     # then look again: new arrivals, timeouts
        head = self._pending[0]
        limit = self.max_batch_size
        if self.batching:
            # no padding rows: trim the batch to a size the model runs exactly (the rest
            # stays queued, first in line for the next free instance)
            rows = sum(r.rows for r in self._pending if r.key == head.key and not r.future.done())
            key = head.key
            limit = max(head.rows, self.layout.choose(min(rows, self.max_batch_size),
                                                      lambda b: self._cost.get((key, b))))
        batch, keep, rows = [], collections.deque(), 0
        for r in self._pending:
            if r.future.done():
                self.depth -= 1
            elif (not batch) or (self.batching and r.key == head.key and rows + r.rows <= limit):
                batch.append(r)
                rows += r.rows
                self.depth -= 1
            else:
                keep.append(r)
        self._pending = keep
        self._observe("queue_depth", self.depth)
        return batch

    async def _collect(self):
        loop = asyncio.get_running_loop()
        while True:
            idx = await self._free.get()
            batch = await self._gather()
            if batch is None:
                self._free.put_nowait(idx)
                return
            now = loop.time()
            for r in batch:
                self._observe("queue_seconds", now - r.arrival)
            task = loop.create_task(self._execute(idx, batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _execute(self, idx, batch):
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executor, self._run, idx, batch)
        except BaseException as e:  # noqa: B036 - the executor itself failed; every request gets it
            results = [e] * len(batch)
        finally:
            self._free.put_nowait(idx)
        for r, res in zip(batch, results):
            if r.future.done():
                continue
            if isinstance(res, BaseException):
                r.future.set_exception(res)
            else:
                r.future.set_result(res)

    def _run(self, idx, batch):
        """Worker thread: run a batch on instance ``idx``; a result or exception per request."""
        model = self.instances[idx]
        rows = sum(r.rows for r in batch)
        start = time.perf_counter()
        try:
            if len(batch) == 1:
                results = [model.run_flat(batch[0].flat)]
            else:
                flat, targets = merge(batch, self.layout)
                results = split(model.run_flat(flat), batch, self.layout, targets)
        except Exception as e:  # noqa: BLE001 - reported per request below
            if len(batch) == 1:
                results = [e]
            else:
                self._log("warning", "batch_failed", model=self.name, requests=len(batch),
                          error=f"{type(e).__name__}: {e}", action="retrying one by one")
                results = []
                for r in batch:
                    try:
                        results.append(model.run_flat(r.flat))
                    except Exception as e1:  # noqa: BLE001
                        results.append(e1)
        elapsed = time.perf_counter() - start
        if self.batching and all(not isinstance(r, BaseException) for r in results):
            k = (batch[0].key, self.layout.bucket_rows(rows))
            prev = self._cost.get(k)
            self._cost[k] = elapsed if prev is None else 0.8 * prev + 0.2 * elapsed
        self._observe("inference_seconds", elapsed)
        self._observe("batch_size", rows)
        return results
