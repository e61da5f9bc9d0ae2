"""One served LLM: the loaded artifact, its tokenizer, its continuous-batching scheduler
running in a thread of its own, and the bridge from that thread to the event loop.

A request becomes a :class:`Generation`: the scheduler's
:class:`~kiln.runtime.scheduler.Request` plus a :class:`~kiln.runtime.text.TextStream`
(detokenization and stop strings, run on the scheduler's thread right after each token)
and an ``asyncio.Queue`` of events the HTTP handler reads: ``("text", delta)`` as text
becomes safe to show, then ``("end", finish_reason)``. The handler cancels the
generation when its client goes away, which frees the KV-cache slot at the next step.

With logprobs, each event carries the entries of the tokens whose text it brings, each
placed by the same stream: where its text starts in the answer, and the bytes it adds to
the answer's UTF-8 (:func:`answer_bytes`). Tokens a stop string removed have no entry.

The served model reports to the server's Prometheus registry: time to first token,
inter-token latency, prompt and generated tokens, requests by finish reason, and, read
at scrape time, KV-cache use, slots in use, queue depth and tokens per second over the
last 10 seconds.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time

from kiln.errors import InputError
from kiln.runtime.loader import load as load_artifact
from kiln.runtime.scheduler import Request
from kiln.runtime.text import TextStream, Tokenizer
from kiln.serving.logs import log

RATE_WINDOW_S = 10.0


def answer_bytes(tokenizer: Tokenizer, tokens: list, pieces: list) -> list:
    """The bytes each of ``tokens`` adds to the answer, ``pieces`` being their text in it
    (``TextStream``'s): the tokens' own bytes where the vocabulary spells bytes and they add
    up to the pieces' UTF-8 (a character split over tokens then has its real bytes in each),
    else the pieces' UTF-8. Either way they join to the answer's UTF-8; a special token's
    are empty."""
    own = [tokenizer.token_bytes(t) for t in tokens]
    own = [p.encode() if b is None else b for b, p in zip(own, pieces)]
    if b"".join(own) == "".join(pieces).encode():
        return own
    return [p.encode() for p in pieces]


class Generation:
    """A request in flight, as the HTTP handler sees it (module doc). ``index``: its choice
    in an ``n > 1`` request, whose generations share one ``events`` queue; each event is
    ``(index, kind, value, logprobs)``, ``logprobs`` being ``[(token, logprob, [(id,
    logprob)], offset, bytes)]`` of the tokens whose text the event brings (empty unless the
    request asked): ``offset`` where the token's text starts in the answer, ``bytes`` what
    it adds to the answer's UTF-8 (:func:`answer_bytes`)."""

    def __init__(self, served: "ServedLLM", prompt: list, max_tokens: int, params, stop: tuple, stop_ids: tuple,
                 *, logprobs: int | None = None, index: int = 0, events: asyncio.Queue | None = None):
        self.served, self.index = served, index
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue() if events is None else events
        self.text = TextStream(served.tokenizer, stop)
        self.request = Request(prompt, max_tokens, params, stop_ids, on_token=self._on_token,
                               on_finish=self._on_finish, logprobs=logprobs)
        self._unsent: list = []         # (k, token, logprob, top) of tokens whose text has not been sent yet
        self._seen = 0                  # tokens passed to _on_token so far

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.request.tokens)

    def draft_counts(self):
        """(accepted, proposed) draft tokens when the model decodes speculatively (``--draft``;
        both 0 for a request the drafter proposed nothing for), else None."""
        if getattr(self.served.scheduler, "speculative", None) is None:
            return None
        return int(getattr(self.request, "draft_accepted", 0)), int(getattr(self.request, "draft_proposed", 0))

    def _emit(self, kind: str, value, final: bool = False):
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, value, self._entries(final)))

    def _entries(self, final: bool) -> list:
        """The logprob entries of the tokens whose text has been shown (all of them once the
        answer is final), less those a stop string removed."""
        text, ready = self.text, 0
        while ready < len(self._unsent) and (final or text.shown(self._unsent[ready][0])):
            ready += 1
        batch, self._unsent = [e for e in self._unsent[:ready] if not text.removed(e[0])], self._unsent[ready:]
        if not batch:
            return []
        end = len(text.text)
        starts = [text.start(e[0]) for e in batch]
        ends = starts[1:] + [end if final else min(text.whole[batch[-1][0]], end)]
        if final:           # what is left (half a character at the end) is the last token's with text
            special = self.served.tokenizer.special_ids
            j = max((i for i, e in enumerate(batch) if e[1] not in special), default=len(batch) - 1)
            ends[j:] = [end] * (len(batch) - j)
            starts[j + 1:] = ends[j + 1:]
        pieces = [text.text[a:max(a, b)] for a, b in zip(starts, ends)]
        raw = answer_bytes(self.served.tokenizer, [e[1] for e in batch], pieces)
        return [(t, lp, top, offset, b) for (_, t, lp, top), offset, b in zip(batch, starts, raw)]

    def _on_token(self, request, token) -> bool:        # the scheduler's thread
        self.served.observe_token(request)
        k, self._seen = self._seen, self._seen + 1      # this token's place in request.tokens
        if request.logprobs is not None and k < len(request.token_logprobs):
            self._unsent.append((k, int(token), *request.token_logprobs[k]))
        delta = self.text.push(token)
        if delta:
            self._emit("text", delta)
        return self.text.stopped

    def _on_finish(self, request):                      # the scheduler's thread
        tail = self.text.finish() if request.finish_reason in ("length", "stop") else ""
        if tail:
            self._emit("text", tail, final=True)
        self.served.observe_finish(request)
        self._emit("end", request.finish_reason, final=True)

    def cancel(self):
        self.served.scheduler.cancel(self.request)


class ServedLLM:
    """An LLM artifact behind the OpenAI routes; the server's lifecycle calls ``load``
    (loading thread), ``start`` (event loop) and ``close``."""
    kind = "llm"
    batcher = None          # the Open Inference Protocol's routes answer that this is an LLM

    def __init__(self, name: str, source, config, metrics):
        self.name, self.source, self.config, self.metrics = name, source, config, metrics
        self.ready, self.state, self.error = False, "LOADING", None
        self.llm = self.tokenizer = self.scheduler = None
        self.stop_token_ids: tuple = ()
        self.on_fatal = None            # set by the server: stop serving (a tensor-parallel rank died)
        self.created = int(time.time())
        self._times: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._stall_logged = None       # the stalled step already logged (its start time)

    # -- lifecycle -----------------------------------------------------------------------
    def load(self) -> float:
        started = time.perf_counter()
        if self.config.instances > 1:
            log("warning", "instances_ignored", model=self.name,
                reason="an LLM runs as one continuous-batching scheduler (its batch is its "
                       "concurrency); --instances applies to the other models")
        self.llm = self.source if not isinstance(self.source, str) else load_artifact(self.source,
                                                                                       threads=self.config.threads)
        if hasattr(self.llm, "on_failure"):        # tensor parallel: its other ranks start now
            self.llm.on_failure.append(self._rank_failed)
            self.llm.start()
        if self.llm.tokenizer_files:
            self.tokenizer = Tokenizer(self.llm.tokenizer_files)
        eos = list(self.llm.meta["eos_token_ids"])
        if self.tokenizer is not None and self.tokenizer.token_id("eos_token") is not None:
            eos.append(self.tokenizer.token_id("eos_token"))
        self.stop_token_ids = tuple(sorted(set(eos)))
        self.warm_up()
        self.scheduler = self.llm.scheduler(max_queue=self.config.max_queue, **self._speculation())
        if self.scheduler.speculative is not None:
            calls = self.scheduler.speculative.warm(self.llm.meta["cache_shape"])
            log("info", "speculative_decoding", model=self.name, step=repr(self.scheduler.speculative),
                warm_calls=calls)
        self._register_metrics()
        return time.perf_counter() - started

    def _speculation(self) -> dict:
        """The scheduler's speculative-decoding options from ``--draft`` (none without one)."""
        drafts = self.config.drafts or {}
        draft = drafts.get(self.name, drafts.get("*"))
        if draft is None:
            return {}
        if hasattr(self.llm, "on_failure"):
            raise InputError(f"model '{self.name}': speculative decoding (--draft) does not run tensor-parallel "
                             "LLMs yet")
        if draft != "ngram":
            draft = load_artifact(draft, threads=self.config.threads)
        return {"draft": draft, "prompt_lookup_max": self.config.prompt_lookup_max,
                "prompt_lookup_min": self.config.prompt_lookup_min}

    def warm_up(self):
        """One short generation per context bucket (and one through the chunk graph), then
        one call of every decode and chunk graph, so no request pays for a first call."""
        t0 = time.perf_counter()
        room = self.llm.meta["cache_shape"][3] - 1
        widths = list(self.llm.prefill)
        if self.llm.chunk is not None:              # a prompt one token past a chunk: the chunk graph
            widths.append(min(self.llm.meta["prefill_chunk"] + 1, room))
        for width in widths:
            self.llm.generate([[0] * min(width, room)], 1 if width >= room else 2, stop_at_eos=False)
        calls = len(widths) + self.llm.warm_graphs()
        log("info", "instance_warmed_up", model=self.name, calls=calls,
            seconds=round(time.perf_counter() - t0, 3))

    def start(self):
        self.scheduler.start(name=f"kiln-llm-{self.name}")
        self.ready, self.state = True, "READY"
        self.metrics.ready.labels(self.name).set(1)
        log("info", "model_ready", model=self.name, kind="llm", batch_size=self.llm.batch_size,
            context_buckets=list(self.llm.prefill), cache_positions=self.scheduler.cache.capacity,
            max_queue=self.config.max_queue, tokenizer=self.tokenizer is not None)

    def stalled(self) -> float | None:
        """Seconds the scheduler has been in its current step, when more than the server's
        ``stall_timeout_s`` (else None): a rank that stopped answering holds the step in a
        collective until the collective timeout (30 minutes), and a decode step takes
        milliseconds, so a load balancer should stop sending requests long before. Logged
        once per stalled step."""
        started, limit = getattr(self.scheduler, "step_started", None), self.config.stall_timeout_s
        seconds = None if started is None or not limit else time.perf_counter() - started
        if seconds is None or seconds < limit:
            return None
        if self._stall_logged != started:
            self._stall_logged = started
            log("error", "llm_stalled", model=self.name, seconds=round(seconds, 1), step=self.scheduler.steps,
                tensor_parallel=hasattr(self.llm, "on_failure"))
        return seconds

    def _rank_failed(self, rank, returncode, tail):
        """A tensor-parallel rank died: its requests fail (their collectives raise), and the
        server shuts down, since this model can no longer answer."""
        self.ready, self.state = False, "UNAVAILABLE"
        self.error = (f"tensor-parallel rank {rank} exited with code {returncode}" if returncode is not None
                      else f"tensor-parallel {tail}")      # rank 0's own failed step (tail says what)
        self.metrics.ready.labels(self.name).set(0)
        log("error", "rank_failed", model=self.name, rank=rank, returncode=returncode, output=tail[-2000:])
        if self.on_fatal is not None:
            self.on_fatal()

    async def close(self, timeout: float | None = None):
        """Finish what was queued and stop, waiting up to ``timeout`` seconds for the
        scheduler (the server's drain timeout). A tensor-parallel model whose scheduler is
        still in a step by then has a rank that does not answer (a stalled process): its ranks
        are stopped, so that the step fails and shutdown ends, instead of waiting out the
        collective timeout."""
        loop = asyncio.get_running_loop()
        thread = self.scheduler.thread if self.scheduler is not None else None
        if thread is not None:
            await loop.run_in_executor(None, self.scheduler.close, timeout)
            if thread.is_alive() and hasattr(self.llm, "stop_ranks"):
                why = f"still in a step {timeout:g} s after the server began to stop: a rank does not answer"
                log("error", "llm_stuck", model=self.name, seconds=timeout)
                await loop.run_in_executor(None, self.llm.stop_ranks, why)
                await loop.run_in_executor(None, self.scheduler.close, 30.0)
        if hasattr(self.llm, "on_failure"):
            await loop.run_in_executor(None, self.llm.close)

    # -- requests ------------------------------------------------------------------------
    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError(f"model '{self.name}' was compiled without a tokenizer; the OpenAI routes "
                             "need one (compile_llm(..., tokenizer=...))")
        return self.tokenizer

    def submit(self, prompt: list, max_tokens: int | None, params, stop: tuple, stop_ids: tuple,
               **options) -> Generation:
        """Queue a generation; InputError for one that can never run, OverloadedError when
        the queue is full. ``max_tokens=None``: as many as the cache has room for.
        ``stop``: strings; ``stop_ids``: token ids (the model's end of sequence among them
        unless the request ignores it); ``options``: :class:`Generation`'s keywords."""
        self.require_tokenizer()
        if max_tokens is None:
            max_tokens = max(1, self.scheduler.cache.capacity - len(prompt))
        gen = Generation(self, prompt, max_tokens, params, stop, stop_ids, **options)
        self.scheduler.add(gen.request)
        self.metrics.llm_prompt_tokens.labels(self.name).inc(len(prompt))
        return gen

    # -- metrics -------------------------------------------------------------------------
    def observe_token(self, request):
        m, times = self.metrics, request.token_times
        if len(times) == 1:
            m.llm_ttft.labels(self.name).observe(times[0] - request.arrived)
        else:
            m.llm_itl.labels(self.name).observe(times[-1] - times[-2])
        m.llm_generated_tokens.labels(self.name).inc()
        with self._lock:
            self._times.append(times[-1])

    def observe_finish(self, request):
        self.metrics.llm_finished.labels(self.name, request.finish_reason).inc()
        if request.error is not None:
            log("error", "generation_failed", model=self.name, error=f"{type(request.error).__name__}: "
                                                                     f"{request.error}")

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._times and self._times[0] < now - RATE_WINDOW_S:
                self._times.popleft()
            return len(self._times) / RATE_WINDOW_S

    def _register_metrics(self):
        m, s = self.metrics, self.scheduler
        def kv_usage():
            u = s.usage()
            return u["positions_used"] / max(1, u["positions"])
        m.llm_kv_usage.labels(self.name).set_function(kv_usage)
        m.llm_slots_used.labels(self.name).set_function(lambda: s.usage()["slots_used"])
        m.queue_depth.labels(self.name).set_function(lambda: len(s.waiting))
        m.llm_tokens_per_second.labels(self.name).set_function(self.tokens_per_second)
        if s.speculative is not None:
            proposed, accepted, ratio = _draft_metrics(m)
            proposed.labels(self.name).set_function(lambda: s.draft_proposed)
            accepted.labels(self.name).set_function(lambda: s.draft_accepted)
            ratio.labels(self.name).set_function(lambda: s.draft_accepted / max(1, s.draft_proposed))


def _draft_metrics(m) -> tuple:
    """Speculative decoding's gauges in the server's registry, made by the first served LLM
    that decodes speculatively: draft tokens proposed, accepted, and their ratio."""
    if not hasattr(m, "llm_draft_acceptance"):
        from prometheus_client import Gauge
        r = m.registry
        m.llm_draft_proposed = Gauge("kiln_llm_draft_tokens_proposed", "Speculative decoding: draft tokens "
                                     "proposed for verification, all generations", ["model"], registry=r)
        m.llm_draft_accepted = Gauge("kiln_llm_draft_tokens_accepted", "Speculative decoding: draft tokens "
                                     "the target kept", ["model"], registry=r)
        m.llm_draft_acceptance = Gauge("kiln_llm_draft_acceptance_ratio", "Speculative decoding: accepted / "
                                       "proposed draft tokens so far", ["model"], registry=r)
    return m.llm_draft_proposed, m.llm_draft_accepted, m.llm_draft_acceptance
