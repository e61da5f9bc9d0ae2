"""Tensor-parallel ranks running one LLM in lockstep.

Every rank runs the same :class:`~kiln.runtime.scheduler.Scheduler` over its own share of
the graphs and of the KV cache. The graphs' collectives make the ranks meet inside each
call, and the logits each rank sees are the same (gathered over the vocabulary), so the
schedulers stay identical as long as they see the same requests at the same steps. Rank 0
(the *leader*) is the one that hears about requests (the Python API, the HTTP server);
before each step it sends the followers what changed since the last one — requests added,
cancelled, or ended by a listener (a stop string, a failing callback) — and every rank
applies it before stepping. This is SPMD, as NxD's ranks are: nothing but those events
travels between steps, and no rank waits for another except inside the collectives.

What keeps the schedulers identical, and why each rule exists:

* requests added from other threads wait in an inbox until the next step, so no rank
  admits a request the others have not heard of;
* a sampled request without a seed gets one drawn by the leader, so every rank's
  generator draws the same tokens;
* a listener's verdict (``on_token`` returning True, or raising) runs on the leader only,
  so it ends the request at the start of the next step on every rank, instead of at once
  on the leader: the request's tokens are the same, its slot is freed a step later;
* a follower whose graph call fails cannot carry on alone (its peers would wait in a
  collective): it leaves with an error, which the leader's next collective raises.

The events travel over a :class:`Channel`: ``torch.distributed``'s object broadcast over
the ranks' group, or queues when the ranks are threads of one process (tests, and the
compiler's check of a sharded model).
"""
from __future__ import annotations

import itertools
import queue
import threading

import torch

from kiln.errors import OverloadedError
from kiln.runtime.scheduler import Request, Scheduler


def command_group():
    """The gloo group commands travel on (every rank calls this at the same point). Its
    timeout is a year, not gloo's half hour: a follower waits in it for as long as the
    server is idle; a dead rank 0 ends the follower by other means (its parent pipe)."""
    from datetime import timedelta

    import torch.distributed as dist
    return dist.new_group(backend="gloo", timeout=timedelta(days=365))


class ProcessChannel:
    """Rank 0 broadcasts pickled commands to the others over a gloo group (its own group,
    so commands never interleave with the graphs' collectives)."""

    def __init__(self, group=None):
        self.group = group

    def send(self, message):
        import torch.distributed as dist
        dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self):
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class ThreadChannel:
    """The same between threads: one queue per follower."""

    def __init__(self, followers: int):
        self.queues = [queue.Queue() for _ in range(followers)]

    def send(self, message):
        for q in self.queues:
            q.put(message)

    def endpoint(self, follower: int):
        return _Endpoint(self.queues[follower])


class _Endpoint:
    def __init__(self, q):
        self.q = q

    def recv(self):
        return self.q.get()


class LockstepScheduler(Scheduler):
    """A scheduler that keeps its followers' copies in step (module doc). On the leader
    ``channel`` sends; on a follower it is None and :meth:`apply` is fed the leader's
    events by :func:`follow`."""

    def __init__(self, *args, channel=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = channel
        self._ids = itertools.count()
        self._inbox: list = []           # leader: events since the last step
        self._requests: dict = {}        # id -> Request, on every rank
        self._seeds = torch.Generator().manual_seed(torch.seed() & 0x7FFFFFFF)
        self.failure = None              # the first graph call that failed on this rank
        self._ending = False             # ending requests by the leader's word, not a failed call
        self.on_broken = None            # leader: called once the ranks are out of step
        self.explain = None              # leader: error -> the error a request fails with (a failed rank named)

    # -- the leader's side ---------------------------------------------------------------
    def add(self, request: Request) -> Request:
        self.check(request)
        with self.cond:
            if self.closing:
                raise OverloadedError("the scheduler is shutting down")
            if len(self.waiting) + self._pending_adds() >= self.max_queue:
                raise OverloadedError(f"{len(self.waiting)} requests are already waiting (the limit); retry later")
            seed = request.params.seed
            if request.params.do_sample and seed is None:
                seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=self._seeds))
                request.generator = torch.Generator().manual_seed(seed)
            request.tp_id = next(self._ids)
            self._inbox.append(("add", request.tp_id, _spec(request, seed), request))
            self.cond.notify()
        return request

    def cancel(self, request: Request):
        with self.cond:
            if getattr(request, "tp_id", None) is not None:
                self._inbox.append(("end", request.tp_id, "cancelled", None))
            self.cond.notify()

    def has_work(self) -> bool:
        return bool(self._inbox) or super().has_work()

    def _pending_adds(self) -> int:
        return sum(1 for e in self._inbox if e[0] == "add")

    def step(self):
        if self.channel is not None:
            with self.cond:
                events, self._inbox = self._inbox, []
            try:
                self.channel.send(("step", [e[:3] for e in events]))
            except Exception as e:  # noqa: BLE001 - a rank is gone: nothing can run any more
                self.apply(events)
                self.fail_all(e)
                return
            self.apply(events)
        super().step()
        if self.channel is not None and self.failure is not None and not self.closing:
            # a graph call failed here, perhaps before a collective the other ranks are
            # waiting in: the ranks are out of step, and carrying on could pair one rank's
            # collective with another's next one. End everything and stop the ranks.
            self.fail_all(self.failure)
            if self.on_broken is not None:
                self.on_broken(self.failure)

    def fail_all(self, error: BaseException):
        """End every request with ``error`` and refuse new ones: the ranks can no longer
        meet (one died), so waiting would hang."""
        self.closing, self._ending = True, True
        with self.cond:
            waiting, self._inbox = list(self.waiting) + [e[3] for e in self._inbox if e[0] == "add"], []
            self.waiting.clear()
        for request in waiting:
            request.error = error
            self._finish(request, "error")
        for slot, request in enumerate(self.slots):
            if request is not None:
                request.error = error
                self._free(slot, "error")

    # -- every rank ----------------------------------------------------------------------
    def apply(self, events):
        """Requests added and ended since the last step, in the leader's order."""
        for event in events:
            kind, rid, detail = event[:3]
            if kind == "add":
                request = event[3] if len(event) > 3 and event[3] is not None else _request(detail)
                self._requests[rid] = request
                self.waiting.append(request)
            elif kind == "end":
                self._end(rid, detail)

    def _end(self, rid, reason):
        self._ending = True
        try:
            self._end_request(rid, reason)
        finally:
            self._ending = False

    def _end_request(self, rid, reason):
        request = self._requests.get(rid)
        if request is None or request.done:
            return
        if request in self.waiting:
            self.waiting.remove(request)
            self._finish(request, reason)
            return
        for slot, r in enumerate(self.slots):
            if r is request:
                self._free(slot, reason)
                return

    def _finish(self, request, reason):
        self._requests.pop(getattr(request, "tp_id", None), None)
        if reason == "error" and self.explain is not None and request.error is not None:
            request.error = self.explain(request.error)
        if reason == "error" and not self._ending and self.failure is None:
            self.failure = request.error      # a failed graph call is its rank's failure (module doc)
        super()._finish(request, reason)

    def _append(self, slot: int, request: Request, logits, proposed=None):
        """The base's, but a listener's verdict ends the request at the next step (module doc)."""
        token = self._take(request, logits, proposed)
        verdict = None
        if request.on_token is not None:
            try:
                verdict = "stop" if request.on_token(request, token) else None
            except Exception as e:  # noqa: BLE001 - a failing listener ends its own request only
                request.error, verdict = e, "error"
        if token in request.stop_token_ids:
            self._free(slot, "stop")
        elif len(request.tokens) >= request.max_new_tokens:
            self._free(slot, "length")
        elif verdict is not None:
            with self.cond:
                self._inbox.append(("end", request.tp_id, verdict, None))


def _spec(request: Request, seed) -> dict:
    params = request.params if seed == request.params.seed else _with_seed(request.params, seed)
    return {"prompt": list(request.prompt), "max_new_tokens": request.max_new_tokens, "params": params,
            "stop_token_ids": sorted(request.stop_token_ids)}


def _with_seed(params, seed):
    import dataclasses
    return dataclasses.replace(params, seed=seed)


def _request(spec: dict) -> Request:
    return Request(spec["prompt"], spec["max_new_tokens"], spec["params"], tuple(spec["stop_token_ids"]))


def follow(rank, endpoint):
    """A follower's loop: carry out the leader's commands on this rank (``local_scheduler``,
    ``plan``, ``warm_graphs``) until it says ``stop``. A failure ends the loop with the exception (the caller exits
    the process, so the leader's next collective fails instead of waiting)."""
    scheduler = None
    while True:
        command, *args = endpoint.recv()
        if command == "stop":
            return
        if command == "scheduler":
            scheduler = rank.local_scheduler(args[0])
        elif command == "step":
            scheduler.apply(args[0])
            Scheduler.step(scheduler)
            if scheduler.failure is not None:
                raise scheduler.failure
        elif command == "plan":
            rank.plan()
        elif command == "warm":
            rank.warm_graphs()
        elif command == "prefill":
            rank.prefill_logits(args[0])
        else:
            raise RuntimeError(f"internal: unknown tensor-parallel command {command!r}")


def thread_followers(followers: list, channel: ThreadChannel, group, on_failure) -> list:
    """Start ``followers`` (ranks 1.., each what :func:`follow` drives) as threads bound to
    ``group`` (a ThreadGroup). A rank that fails is reported to ``on_failure(rank, error)``
    before the group is aborted (so the owner knows the first cause before rank 0's
    collective fails too), and its thread ends there: the error is the owner's to report,
    not an unhandled exception printed by the thread machinery."""
    from kiln.distributed import groups

    def run(rank):
        with groups.bound(tp=group.rank_view(rank)):
            try:
                follow(followers[rank - 1], channel.endpoint(rank - 1))
            except BaseException as e:  # noqa: BLE001 - handed to the owner, which reports it
                on_failure(rank, e)
                group.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"kiln-tp-rank-{r}", daemon=True)
               for r in range(1, len(followers) + 1)]
    for t in threads:
        t.start()
    return threads
