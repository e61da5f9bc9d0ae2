"""Dynamic batching for served models: queue requests, merge them, split results back.

``kiln serve`` hands every checked request to its model's :class:`Batcher`. The
batcher owns the model's instances (copies of the model, one per kiln core with
``--instances N``) and a bounded queue:

* **Admission.** A request joins the queue unless the queue already holds
  ``max_queue`` requests; then it fails at once with
  :class:`~kiln.errors.OverloadedError` (HTTP 503), so an overloaded server
  answers quickly instead of piling up work.
* **Collection.** When an instance is free, the oldest waiting request opens a
  batch. Requests that can share its batch (the same bucket group, see
  :mod:`kiln.serving.layout`) join it until the batch holds ``max_batch_size``
  rows or the oldest request has waited ``max_queue_delay`` (0 with batching
  off). Requests that cannot join stay queued, in order, for the next free
  instance.
* **Execution.** The merged inputs (:func:`kiln.serving.merging.merge`) run on
  the free instance in a worker thread (``loop.run_in_executor``); the outputs
  are split back per request. If a merged batch fails, its requests are retried
  one by one, so one bad request fails alone.
* **Timeouts.** A request that times out (or whose caller is cancelled) is
  dropped from the queue at once, freeing its place and lowering the queue
  depth (if still queued), or its result is discarded (if running).
* **Admission as a whole.** A caller that splits one request into several
  batches (``/v1/embeddings``) calls :meth:`Batcher.admit` once and submits
  them with ``admitted=True``: the request is refused whole or not at all, never
  for the number of its own batches.

With a bucketed batch dim, ``n`` waiting rows can run either trimmed to the
largest batch bucket they fill (no padding rows; the rest waits for the next
free instance) or padded up to the next bucket. The batcher chooses by
measurement: it keeps the observed latency of every (group, batch bucket) it
has run and takes whichever costs less per real row; a bucket not yet measured
is tried once, so the choice follows this machine's numbers.

Before a model's requests are merged the server proves that merging keeps every
answer (:func:`kiln.serving.merging.check_merging`); a model that fails is
never merged (:meth:`Batcher.disable`).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time

from kiln.errors import ModelUnavailableError, OverloadedError, RequestTimeoutError
from kiln.serving.layout import Layout
from kiln.serving.merging import Request, merge, split


def duration(seconds: float) -> str:
    """``seconds`` in a unit that shows it (``1 µs``, ``200 ms``, ``30 s``)."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.4g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds:.4g} s"


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

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran (only a started batcher has anything to close)."""
        return self._task is not None

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
    def admit(self, queue_limit: bool = True):
        """Refuse at once a request the model cannot queue now: shutting down
        (:class:`ModelUnavailableError`) or, with ``queue_limit``, a full queue
        (:class:`OverloadedError`)."""
        if self._closing or self._task is None:
            raise ModelUnavailableError(f"model '{self.name}' is not accepting requests (shutting down)")
        if queue_limit and self.depth >= self.max_queue:
            raise OverloadedError(f"model '{self.name}' is overloaded: {self.depth} requests queued "
                                  f"(max_queue {self.max_queue}); retry later")

    async def submit(self, flat, rows: int, timeout: float | None = None, admitted: bool = False):
        """Queue checked flat inputs (``rows`` along dim 0) and return their flat outputs.
        ``admitted``: part of a request that :meth:`admit` already let in (the queue's
        limit is not checked again; shutting down still is)."""
        self.admit(queue_limit=not admitted)
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
            self._discard(req)
            self._count_timeout()
            raise RequestTimeoutError(f"model '{self.name}': request timed out after "
                                      f"{duration(timeout)}") from None
        except asyncio.CancelledError:      # its caller gave up: nobody waits for the answer
            self._discard(req)
            raise

    def _count_timeout(self):
        """A 504: counted in the model's own metrics too (``calls_timed_out``; kiln monitor's
        ``timed_out`` and ``error_summary.timeout``), on its first instance."""
        counters = getattr(self.instances[0], "metrics", None)
        if counters is not None:
            counters.record_timeout()

    def _discard(self, req):
        """A request nobody waits for: out of the queue now (its place freed, the depth
        reported), or, already in a batch, its result discarded."""
        req.future.cancel()
        for k, r in enumerate(self._pending):
            if r is req:
                del self._pending[k]
                self.depth -= 1
                self._observe("queue_depth", self.depth)
                self._wake.set()        # the collector may be waiting on this request's deadline
                return

    def _drop_dead(self):
        dropped = False
        while self._pending and self._pending[0].future.done():
            self._pending.popleft()
            self.depth -= 1
            dropped = True
        if dropped:
            self._observe("queue_depth", self.depth)

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
