"""Dropout masks drawn ahead on another thread, from a copy of the generator's state, so a
training step's recording does not wait for the Mersenne Twister.

CPU eager draws each dropout mask serially where the operation runs, and so did kiln
(:mod:`kiln.graph.draws`): a 4-layer BERT's lazy-mode forward spent 56 ms of its 78 ms of
recording on its 14 masks (11-29, a slow hour of the 2-core Xeon), while its second core
sat idle through the recording. The draws depend on nothing a
step computes, only on the generator's state and the masks' layouts, and a training step
draws the same layouts in the same order every time. So after each draw this module
predicts the next ones (the sequence of layouts repeats with some period: the last period
again) and a worker thread draws them from a private generator set to the default
generator's state, keeping each mask and the generator state after it.

A prediction is used only when it is provably what a draw here would give: the layout,
dtype and probability asked for are the ones predicted, and the default generator's
state, compared byte for byte, is the one the worker started that mask from. Then the
mask is handed out and the default generator is set to the state after it, exactly where
drawing it here would have left it. Anything else (a seed set, random data drawn between
masks, a new shape) is a miss: the worker is told to stop, the mask is drawn here as
before, and a new prediction starts from there. Same masks and same generator states bit
for bit either way (``tests/test_randomness.py``); ``KILN_DRAW_AHEAD=off`` turns it off,
and a process with one CPU never starts the worker (it would only take turns with the
recording). The worker stays one period ahead of the masks taken, and holds at most
:data:`_MAX_HELD_BYTES` of masks not yet taken (always at least one), so a model with large
masks does not keep a second copy of a whole step's.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading

import torch

from kiln import config

_HISTORY = 4096            # layouts remembered, to find the period
_MAX_PERIOD = 512          # masks in a period at most
_MAX_HELD_BYTES = 256 << 20  # masks drawn ahead and not yet taken, at most (at least one is)
_lock = threading.Lock()
_history: list = []
_job: list = [None]        # the current prediction
_worker: list = [None]     # the thread that draws predictions, started at the first
_queue: list = [queue.SimpleQueue()]
_stats = {"ahead": 0, "here": 0, "wasted": 0}


def enabled() -> bool:
    if (config.get("KILN_DRAW_AHEAD") or "on").lower() in ("off", "0", "false", "no"):
        return False
    if _cpus[0] is None:
        _cpus[0] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return _cpus[0] > 1


_cpus: list = [None]       # CPUs this process may run on, read once


class _Prediction:
    """The worker's draws: the period ``layouts`` over and over, from ``start`` (a generator
    state), staying one period ahead of the masks taken (so the next step's masks are drawn
    while this step records, on the core the recording leaves idle, rather than while the
    step's program runs on every core)."""

    def __init__(self, layouts: list, start: torch.Tensor, draw):
        self.layouts = layouts
        self.start = start
        self.draw = draw
        self.expect = start            # the state the default generator must hold for the next mask
        self.drawn: dict = {}          # position -> (mask, state after it), not yet taken
        self.taken = 0                 # masks handed out
        self.held = 0                  # bytes drawn and not yet handed out
        self.stop = False
        self.done = False
        self.ready = threading.Condition()

    def run(self):
        try:
            gen = torch.Generator()
            gen.set_state(self.start)
            period, at = len(self.layouts), 0
            while True:
                with self.ready:
                    while not self.stop and (at - self.taken >= period
                                             or (at > self.taken and self.held >= _MAX_HELD_BYTES)):
                        self.ready.wait()
                    if self.stop:
                        return
                mask = self.draw(self.layouts[at % period], gen)
                with self.ready:
                    self.drawn[at] = (mask, gen.get_state())
                    self.held += _nbytes(mask)
                    self.ready.notify_all()
                at += 1
        finally:
            with self.ready:
                self.done = True
                self.ready.notify_all()

    def take(self, layout):
        """The next mask if it is ``layout``'s and the default generator is where the worker
        started it; else None (the caller draws)."""
        at = self.taken
        if self.layouts[at % len(self.layouts)] != layout:
            return None
        if not torch.equal(torch.default_generator.get_state(), self.expect):
            return None
        with self.ready:
            while at not in self.drawn and not self.done:
                self.ready.wait()
            got = self.drawn.pop(at, None)
            if got is None:
                return None               # the worker failed; draw here
            self.held -= _nbytes(got[0])
            self.taken += 1
            self.ready.notify_all()       # room for one more
        mask, after = got
        torch.default_generator.set_state(after)
        self.expect = after
        return mask

    def cancel(self):
        with self.ready:
            self.stop = True
            _stats["wasted"] += len(self.drawn)
            self.drawn.clear()
            self.ready.notify_all()


def mask(layout: tuple, draw):
    """The mask ``draw(layout, generator)`` would give on the default generator now, and the
    default generator advanced as that draw would advance it: drawn ahead by the worker
    when it predicted this draw, else drawn here. ``layout`` must be hashable and say all
    the draw depends on (shape, strides, dtype, probability)."""
    if not enabled():
        if _job[0] is not None:
            with _lock:
                if _job[0] is not None:
                    _job[0].cancel()
                    _job[0] = None
        return draw(layout, None)
    with _lock:
        job = _job[0]
        got = job.take(layout) if job is not None else None
        if got is None:
            if job is not None:
                job.cancel()
                _job[0] = job = None
            got = draw(layout, None)
            _stats["here"] += 1
        else:
            _stats["ahead"] += 1
        _history.append(layout)
        if len(_history) > _HISTORY:
            del _history[:len(_history) - _HISTORY]
        if job is None:
            _predict(draw)
        return got


def _nbytes(mask) -> int:
    parts = mask if isinstance(mask, tuple) else (mask,)
    return sum(t.numel() * t.element_size() for t in parts)


def _predict(draw):
    """Start a worker on the last period of the history, if the history has one."""
    following = _period(_history)
    if not following:
        _job[0] = None
        return
    job = _Prediction(following, torch.default_generator.get_state(), draw)
    _job[0] = job
    if _worker[0] is None:
        _worker[0] = threading.Thread(target=_work, args=(_queue[0],), daemon=True, name="kiln-draw-ahead")
        _worker[0].start()
    _queue[0].put(job)


def _work(jobs: queue.SimpleQueue):
    """The worker: predictions one after another (each runs until it is cancelled, and
    stops after its current mask); None ends it. A draw that raises ends only its
    prediction (its masks are then drawn where they are asked for, which raises there)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job.run()
        except Exception:       # noqa: BLE001 - the caller draws it again and sees the error
            pass


def _period(history: list) -> list:
    """The smallest ``p`` whose last two periods of the history are equal: the next draws
    are predicted to be the last ``p`` again."""
    n = len(history)
    for p in range(1, min(_MAX_PERIOD, n // 2) + 1):
        # two single comparisons first: a history that does not repeat costs no slices
        if (history[n - 1] == history[n - 1 - p] and history[n - p] == history[n - 2 * p]
                and history[n - p:] == history[n - 2 * p:n - p]):
            return history[n - p:]
    return []


def stats() -> dict:
    """How many masks were drawn ahead, drawn here, and drawn ahead but not used."""
    return dict(_stats)


def reset():
    """Forget the history and stop the worker (a test, the process's exit)."""
    with _lock:
        job, _job[0] = _job[0], None
        worker, _worker[0] = _worker[0], None
        jobs, _queue[0] = _queue[0], queue.SimpleQueue()
        _history.clear()
    if job is not None:
        job.cancel()
    if worker is not None:
        jobs.put(None)
        if worker is not threading.current_thread():
            worker.join()


def _in_child():
    # the worker did not come with the fork, and its lock and condition may be held
    global _lock
    _lock = threading.Lock()
    _job[0] = _worker[0] = None
    _queue[0] = queue.SimpleQueue()
    _history.clear()


atexit.register(reset)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_child)
