"""Continuous batching: requests join and leave the decode batch between steps.

The KV cache (:class:`kiln.runtime.kv.KVCache`) has ``B`` rows. Each row is a *slot*: a
request owns one slot from its prefill to its last token, and the slot is free for the
next request as soon as it ends. Decode graphs are compiled for some batch sizes up to
``B`` (by default 1 and ``B``); the running requests are kept in the first slots, so a
step runs the smallest graph that covers them, on views of the cache's first rows: one
stream alone does not pay for ``B`` rows. One :meth:`Scheduler.step`:

1. drops cancelled requests (a client that went away) and frees their slots, then moves
   requests from the last occupied slots into the freed ones (their valid positions
   only), so the occupied slots are the first ones;
2. admits waiting requests into free slots: each is prefilled alone, through the
   batch-1 prefill graph of the smallest context bucket that fits, its first token
   chosen (and handed to its listener), then its keys and values written into its slot. While other requests are decoding,
   at most ``prefills_per_step`` are admitted per step, so a burst of new prompts
   delays the running streams by one prefill each, not by all of them;
   with *chunked prefill* (a chunk graph: ``width`` new tokens of one row against its
   cache), only the prompt's first ``width`` tokens go through the prefill graph and the
   rest one chunk per step, so a long prompt delays the running streams by a chunk at a
   time, and prompts longer than the largest context bucket run (up to the cache). With a
   chunk graph, a prompt that shares a prefix of at least one chunk with what a row of
   the cache holds (a running request, or a finished one whose row is not yet
   overwritten: a shared system prompt) starts from a copy of those positions
   (*prefix reuse*; ``prefix_reuse=False`` turns it off);
3. runs one decode step for every occupied slot at once (rows of the graph beyond them
   get an empty cache and attend only to themselves, so they cannot produce NaN; a row
   still prefilling rides along and its output is dropped), and appends each request's
   next token. With speculative decoding (``speculative=``, built by
   ``LLM.scheduler(draft=...)``) a drafter's proposals for every running row are checked
   in one verify call instead, each row keeping its own number of them
   (:mod:`kiln.runtime.spec_step`).

Why a request's tokens are exactly those it gets alone: every row of both graphs is a
function of its own inputs only. Attention is masked per row (its own valid slots),
and a matrix product reduces each row of its left operand on its own, in the same
order whatever the other rows hold. Sampling draws from the request's own generator.
``tests/test_llm_scheduler.py`` checks token equality for concurrent requests of
different lengths against each one run alone. The exception is prefix reuse: the shared
positions' keys were computed by another request's graph call, whose shape (context
bucket, chunk) may differ from the one this request would have used, so they can differ
in the last bits, as a prompt padded into another context bucket does;
``tests/test_llm_chunked.py`` checks Hugging Face's greedy tokens with reuse.

The memory budget is the cache: ``B`` slots of ``S`` positions. A request whose prompt
plus ``max_new_tokens`` does not fit in a slot is refused when added
(:class:`~kiln.errors.InputError`), and when ``max_queue`` requests already wait,
:meth:`Scheduler.add` raises :class:`~kiln.errors.OverloadedError` at once (the
server's 429) rather than queueing without bound.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kiln.errors import InputError, OverloadedError
from kiln.runtime import sampling, value_checks
from kiln.runtime.kv import KVCache


@dataclass(eq=False)
class Request:
    """One generation. ``on_token(request, token) -> bool`` is called from the scheduler's
    thread after each new token (returning True ends the request: a stop string matched);
    ``on_finish(request)`` once it has ended, whatever the reason."""
    prompt: list
    max_new_tokens: int
    params: sampling.SamplingParams = field(default_factory=sampling.SamplingParams)
    stop_token_ids: tuple = ()
    on_token: Callable | None = None
    on_finish: Callable | None = None
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None       # "stop", "length", "cancelled" or "error"
    error: BaseException | None = None
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    token_times: list = field(default_factory=list)
    prefilled: int = 0                     # prompt tokens whose keys and values are in the cache
    logprobs: int | None = None            # None: off; n >= 0: each token's logprob and the top n
    token_logprobs: list = field(default_factory=list)   # per token: (logprob, [(id, logprob)])
    draft_proposed: int = 0                # speculative decoding: tokens a drafter proposed for it
    draft_accepted: int = 0                # ... and those the target kept (kiln.runtime.spec_step)

    def __post_init__(self):
        self.prompt = value_checks.token_ids(self.prompt)
        self.stop_token_ids = frozenset(int(t) for t in self.stop_token_ids)
        self.generator = self.params.generator()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is still to go through the chunk graph (chunked prefill)."""
        return self.prefilled < len(self.prompt)

    def history(self):
        """``[1, N]`` ids seen so far, for the repetition penalty (None when it is off)."""
        if self.params.repetition_penalty == 1.0:
            return None
        return torch.tensor([self.prompt + self.tokens])


class Scheduler:
    """Continuous batching over a prefill and a decode graph (module doc).

    ``prefill_for(width)``: the batch-1 prefill callable for a prompt ``width`` tokens
    long (raising InputError when none fits); ``decode``: ``{rows: decode step}``, the
    largest for all ``B`` rows (or one step, for ``B`` rows); ``cache_shape``:
    ``[L, B, H_kv, S, D]``."""

    def __init__(self, prefill_for, decode, cache_shape, *, max_queue: int = 1 << 30,
                 prefills_per_step: int = 1, max_context: int | None = None, chunk=None,
                 prefix_reuse: bool = True, windows=None, speculative=None):
        self.prefill_for = prefill_for
        # a kiln.runtime.spec_step.SpeculativeStep: a drafter's proposals checked in one verify
        # call per step, in place of the decode step (its cache has no smaller windows)
        self.speculative = speculative
        if speculative is not None and windows:
            raise ValueError("speculative decoding runs over the whole cache: give no windows")
        self.chunk = chunk            # (width, step) for chunked prefill, or None
        self.prefix_reuse = prefix_reuse and chunk is not None
        self.decode = dict(sorted(decode.items())) if isinstance(decode, dict) else {cache_shape[1]: decode}
        if max(self.decode) != cache_shape[1]:
            raise ValueError(f"the largest decode graph has {max(self.decode)} rows; the cache has {cache_shape[1]}")
        # window -> (decode steps by rows, chunk step or None): the graphs for a cache laid
        # out for fewer positions (sequence-length buckets; kiln.runtime.kv)
        self.graphs = {cache_shape[3]: (self.decode, None if chunk is None else chunk[1])}
        for window, (steps, chunk_step) in (windows or {}).items():
            if sorted(steps) != sorted(self.decode):
                raise ValueError(f"window {window} has decode graphs for {sorted(steps)} rows; the full "
                                 f"cache has {sorted(self.decode)}")
            self.graphs[int(window)] = (dict(sorted(steps.items())), chunk_step)
        self.cache = KVCache(tuple(cache_shape), windows=self.graphs)
        self._step_inputs: dict = {}    # rows -> a decode step's (tokens, positions) buffers
        self.window_steps: dict = {}  # window -> decode steps run in it
        self.slots: list = [None] * cache_shape[1]
        self.waiting: collections.deque = collections.deque()
        self.max_queue, self.prefills_per_step, self.max_context = max_queue, prefills_per_step, max_context
        self.cond = threading.Condition()
        self.closing, self.thread = False, None    # the background thread (start)
        self.steps, self.step_started = 0, None    # steps run; perf_counter() when the thread's began
        self.rows_run: dict = {}      # decode graph rows -> steps run with it
        self.moves = 0                # requests moved to a lower slot
        self.prefill_chunks = 0       # chunks run by chunked prefill
        self.reused_positions = 0     # prompt positions copied from a shared prefix
        self.draft_proposed = 0       # speculative decoding: proposals verified, all requests
        self.draft_accepted = 0       # ... and kept

    # -- requests --------------------------------------------------------------------------
    def check(self, request: Request):
        """Refuse (InputError) a request that can never run, before it waits for a slot."""
        n = len(request.prompt)
        if n == 0:
            raise InputError("the prompt needs at least one token")
        if self.max_context is not None and n > self.max_context and self.chunk is None:
            raise InputError(f"a prompt of {n} tokens is longer than the largest context bucket "
                             f"({self.max_context}); compile with a larger context bucket, or with "
                             "prefill_chunk= to prefill long prompts in pieces")
        if request.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1; got {request.max_new_tokens}")
        if n + request.max_new_tokens > self.cache.capacity:
            raise InputError(f"{n} prompt tokens + {request.max_new_tokens} new ones exceed the compiled "
                             f"cache of {self.cache.capacity} positions")

    def add(self, request: Request) -> Request:
        self.check(request)
        with self.cond:
            if self.closing:
                raise OverloadedError("the scheduler is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise OverloadedError(f"{len(self.waiting)} requests are already waiting (the limit); "
                                      "retry later")
            self.waiting.append(request)
            self.cond.notify()
        return request

    def cancel(self, request: Request):
        """End ``request`` at the next step (its slot is freed then); a no-op once it is done."""
        request.cancelled = True
        with self.cond:
            self.cond.notify()

    # -- state ---------------------------------------------------------------------------
    @property
    def active(self) -> list:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def usage(self) -> dict:
        """Slots and cache positions in use, for metrics."""
        used = sum(len(r.prompt) + len(r.tokens) for r in self.active)
        return {"slots_used": len(self.active), "slots": len(self.slots), "waiting": len(self.waiting),
                "positions_used": used, "positions": len(self.slots) * self.cache.capacity}

    # -- the loop ------------------------------------------------------------------------
    def run(self):
        """Step until every added request has ended (the caller's thread)."""
        while self.has_work():
            self.step()

    def step(self):
        self._drop_cancelled()
        self._compact()
        self.cache.fit(max([self._needs(r) for r in self.active], default=0))
        self._admit()
        self._continue_prefills()
        if any(r is not None and not r.prefilling for r in self.slots):
            if self.speculative is not None:
                self.speculative.step(self)
            else:
                self._decode()
        self.steps += 1

    def _needs(self, request: Request) -> int:
        """Cache positions ``request`` needs laid out for its next graph call."""
        if request.prefilling:     # and one more: the decode it rides along in writes there
            return min(len(request.prompt), request.prefilled + self.chunk[0]) + 1
        return len(request.prompt) + len(request.tokens)

    def _drop_cancelled(self):
        with self.cond:
            gone = [r for r in self.waiting if r.cancelled]
            for r in gone:
                self.waiting.remove(r)
        for r in gone:
            self._finish(r, "cancelled")
        for slot, r in enumerate(self.slots):
            if r is not None and r.cancelled:
                self._free(slot, "cancelled")

    def _compact(self):
        """Move the requests in the last occupied slots into free ones before them."""
        while True:
            free = [s for s, r in enumerate(self.slots) if r is None]
            used = [s for s, r in enumerate(self.slots) if r is not None]
            if not free or not used or free[0] > used[-1]:
                return
            src, dst = used[-1], free[0]
            self.cache.move(src, dst)
            self.slots[dst], self.slots[src] = self.slots[src], None
            self.moves += 1

    def _admit(self):
        limit = self.prefills_per_step if self.active else len(self.slots)
        for _ in range(limit):
            free = [s for s, r in enumerate(self.slots) if r is None]
            with self.cond:
                if not free or not self.waiting:
                    return
                request = self.waiting.popleft()
            self._prefill(free[0], request)

    def _prefill(self, slot: int, request: Request):
        """The prompt through a prefill graph; with chunked prefill, its first chunk only
        (the rest goes one chunk per step, :meth:`_continue_prefills`)."""
        if self.prefix_reuse and self._reuse_prefix(slot, request):
            return
        n = len(request.prompt) if self.chunk is None else min(len(request.prompt), self.chunk[0])
        ids = torch.tensor([request.prompt[:n]])
        try:
            with torch.no_grad():
                logits, new_k, new_v = self.prefill_for(n)(ids, torch.arange(n).unsqueeze(0), torch.tensor([n - 1]))
        except Exception as e:  # noqa: BLE001 - this request's failure is its own
            request.error = e
            self._finish(request, "error")
            return
        self.cache.reset(slot)
        # one position more: this step's decode writes there, riding along too (_prefill_chunk)
        self.cache.fit(min(n + 1, self.cache.capacity), shrink=False)
        self.slots[slot], request.prefilled = request, n
        if request.prefilling:
            self.cache.write_slot(slot, new_k[:, 0, :, :n], new_v[:, 0, :, :n], request.prompt[:n])
            return
        # The first token goes to its listener before the prompt's keys and values are
        # written into the cache, which no one needs before the next step (SmolLM2, 128
        # tokens: 6 MB, ~0.9 ms of a ~50 ms time to the first token). A request that ended
        # at that token still leaves its prompt in the row, freed, for prefix reuse.
        self._append(slot, request, logits[0, -1:])
        self.cache.write_slot(slot, new_k[:, 0, :, :n], new_v[:, 0, :, :n], request.prompt[:n])
        if self.slots[slot] is not request:
            self.cache.reset(slot)

    def _reuse_prefix(self, slot: int, request: Request) -> bool:
        """Start ``request`` from the longest prefix of its prompt some row of the cache holds
        (a running request's, or a finished one's whose row is not yet overwritten), when
        that saves at least one chunk; the rest is prefilled by chunks. Its first token
        needs its last prompt token's logits, so that token is always computed."""
        row, n = self.cache.longest_prefix(request.prompt)
        n = min(n, len(request.prompt) - 1)
        if n < self.chunk[0]:
            return False
        self.cache.copy_prefix(row, slot, n)
        self.cache.fit(n + 1, shrink=False)     # it may ride along in this step's decode (_prefill_chunk)
        self.slots[slot], request.prefilled = request, n
        self.reused_positions += n
        return True

    def _continue_prefills(self):
        """Chunked prefill: the next chunk of a prompt still prefilling, for up to
        ``prefills_per_step`` chunks while other requests decode (each chunk delays them by
        one chunk, not by the whole prompt), for all of them when none does."""
        if self.chunk is None:
            return
        budget = self.prefills_per_step if any(r is not None and not r.prefilling for r in self.slots) else None
        done = 0
        while budget is None or done < budget:
            pending = [(s, r) for s, r in enumerate(self.slots) if r is not None and r.prefilling]
            if not pending:
                return
            self._prefill_chunk(*pending[0])
            done += 1

    def _prefill_chunk(self, slot: int, request: Request):
        """``width`` prompt tokens through the chunk graph against the row's cache; the last
        chunk is padded on the right, after every real token, so no real token sees it."""
        width, start = self.chunk[0], request.prefilled
        real = min(width, len(request.prompt) - start)
        # one more position: this step's decode, ridden along, writes there; a row filling its window
        # had that key written (in place, clamped to the last slot) over its last prompt token's
        self.cache.fit(min(start + real + 1, self.cache.capacity), shrink=False)
        step = self.graphs[self.cache.window][1]
        ids = torch.tensor([request.prompt[start:start + real] + [0] * (width - real)])
        try:
            with torch.no_grad():
                logits, new_k, new_v = step(ids, torch.arange(start, start + width).unsqueeze(0),
                                            *self.cache.row_inputs(slot))
        except Exception as e:  # noqa: BLE001 - this request's failure is its own
            request.error = e
            self._free(slot, "error")
            return
        self.cache.write_slot(slot, new_k[:, 0, :, :real], new_v[:, 0, :, :real], request.prompt[start:start + real])
        request.prefilled += real
        self.prefill_chunks += 1
        if not request.prefilling:
            self._append(slot, request, logits[0, real - 1:real])

    def _decode(self):
        used = max(s for s, r in enumerate(self.slots) if r is not None) + 1
        rows = next(b for b in self.decode if b >= used)
        # a row still prefilling rides along: its token and new keys are ignored
        running = [(slot, r) for slot, r in enumerate(self.slots[:rows]) if r is not None and not r.prefilling]
        # the step's tokens and positions go in buffers kept per row count: the same memory at
        # every step, which an engine keeps bound (kiln.engines.onnxruntime.OrtRunner)
        tokens, positions = self._step_inputs.get(rows) or self._step_inputs.setdefault(
            rows, (torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(rows, 1, dtype=torch.int64)))
        tokens.zero_()
        for slot, r in running:
            tokens[slot, 0] = r.tokens[-1]
        positions.copy_(self.cache.lengths[:rows].unsqueeze(1))
        window = self.cache.window
        try:
            with torch.no_grad():
                logits, new_k, new_v = self.graphs[window][0][rows](tokens, positions, *self.cache.inputs(rows))
        except Exception as e:  # noqa: BLE001 - every running request failed; the next ones may not
            for slot, r in running:
                r.error = e
                self._free(slot, "error")
            return
        self.cache.parked(rows)
        written = self.cache.written_by(self.graphs[window][0][rows])
        for slot, r in running:
            if written:
                self.cache.wrote_slot(slot, r.tokens[-1])
            else:
                self.cache.write_slot(slot, new_k[:, slot, :, :1], new_v[:, slot, :, :1], r.tokens[-1:])
            self._append(slot, r, logits[slot, -1:])
        self.rows_run[rows] = self.rows_run.get(rows, 0) + 1
        self.window_steps[window] = self.window_steps.get(window, 0) + 1

    def _append(self, slot: int, request: Request, logits, proposed=None):
        token = self._take(request, logits, proposed)
        stop = token in request.stop_token_ids
        try:
            if request.on_token is not None and request.on_token(request, token):
                stop = True
        except Exception as e:  # noqa: BLE001 - a failing listener ends its own request only
            request.error = e
            self._free(slot, "error")
            return
        if stop:
            self._free(slot, "stop")
        elif len(request.tokens) >= request.max_new_tokens:
            self._free(slot, "length")

    def _take(self, request: Request, logits, proposed=None) -> int:
        """The next token of ``request`` chosen from ``logits`` and recorded with what comes
        with it (its time, a kept draft proposal, its log-probabilities), before anyone hears
        of it. Every scheduler's ``_append`` starts here, so a subclass that decides
        differently what ends a request (:class:`kiln.runtime.lockstep.LockstepScheduler`)
        still records all of it."""
        token = int(sampling.choose(logits, request.params, request.history(), request.generator)[0])
        request.tokens.append(token)
        request.token_times.append(time.perf_counter())
        if proposed is not None and token == proposed:
            # a draft's proposal kept: counted before the listener hears of the token, which
            # may end the request and report its usage from another thread
            request.draft_accepted += 1
            self.draft_accepted += 1
        if request.logprobs is not None:
            request.token_logprobs.append(sampling.logprobs(logits, token, request.logprobs))
        return token

    # what a step of another module (kiln.runtime.spec_step) runs the scheduler with
    def decode_step(self):  # one decode step for every running row (module doc, step 3)
        self._decode()

    def append_token(self, slot: int, request: Request, logits, proposed=None) -> int:
        """Choose ``request``'s next token from ``logits`` (``[1, V]``, its own row), record
        it (and its logprobs), tell its listener, end the request when it should; the token.
        ``proposed``: the draft's proposal for this place, counted as accepted when chosen."""
        self._append(slot, request, logits, proposed)
        return request.tokens[-1]

    def free(self, slot: int, reason: str):
        """End the request in ``slot`` with ``reason``, freeing the slot."""
        self._free(slot, reason)

    def _free(self, slot: int, reason: str):
        request, self.slots[slot] = self.slots[slot], None
        self.cache.reset(slot)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: str):
        if request.finish_reason is None:
            request.finish_reason = reason
            if request.on_finish is not None:
                request.on_finish(request)

    # -- background thread (the server) ------------------------------------------------------
    def start(self, name: str = "kiln-llm-scheduler"):
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            with self.cond:
                while not self.has_work() and not self.closing:
                    self.cond.wait()
                if self.closing and not self.has_work():
                    return
            self.step_started = time.perf_counter()    # a server's /health names a step that never ends
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the thread serves on
                logging.getLogger("kiln").exception("kiln LLM scheduler: a step failed; its requests end with it")
                for slot, r in enumerate(self.slots):
                    if r is not None:
                        r.error = r.error or e
                        self._free(slot, "error")
            self.step_started = None

    def close(self, timeout: float | None = None):
        """Finish what was added, then stop the thread; later adds are refused."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout)


def generate(prefill, decode, prompts: list, max_new_tokens: int, cache_shape, *, params=None,
             eos_token_ids=(), max_context=None, chunk=None, windows=None) -> list:
    """The new tokens of each prompt, every prompt a request through one :class:`Scheduler`
    run on the caller's thread. ``prefill``: a step callable for any width (the eager
    module), or ``prefill_for(width)`` when ``max_context`` is given (compiled buckets);
    ``decode``: as for :class:`Scheduler`."""
    prefill_for = prefill if max_context is not None else (lambda width: prefill)
    scheduler = Scheduler(prefill_for, decode, cache_shape, max_context=max_context, chunk=chunk, windows=windows)
    return run_all(scheduler, prompts, max_new_tokens, params, eos_token_ids)


def run_all(scheduler: Scheduler, prompts: list, max_new_tokens: int, params=None, eos_token_ids=()) -> list:
    """Every prompt a request through ``scheduler``, run on the caller's thread until all
    end; their new tokens, or the first request's error."""
    params = params or sampling.SamplingParams()
    requests = [Request(p, max_new_tokens, params, eos_token_ids) for p in prompts]
    for r in requests:
        scheduler.check(r)
    for r in requests:
        scheduler.add(r)
    scheduler.run()
    for r in requests:
        if r.error is not None:
            raise r.error
    return [r.tokens for r in requests]


def greedy(prefill, decode, prompts: list, max_new_tokens: int, cache_shape) -> list:
    """Greedy continuation of each prompt, ``max_new_tokens`` long (no stop tokens)."""
    return generate(prefill, decode, prompts, max_new_tokens, cache_shape)
