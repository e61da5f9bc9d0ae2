"""Worker threads pinned to a kiln core's CPUs: where a placed model loads and runs.

Engines create their thread pools from the thread that loads them, and threads
inherit their creator's CPU affinity; so loading and running a model on its
worker keeps all of its threads on its core (see :mod:`kiln.host.cores` for
what a core is). This is runtime code: the host layer only describes CPUs.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from concurrent.futures import Future

from kiln.errors import KilnError, PlacementError
from kiln.host.cores import format_cpus

_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()
_workers_lock = threading.Lock()
_exit_hook = False


class Worker:
    """One thread, optionally pinned to CPUs, running submitted calls in order."""

    def __init__(self, cpus=None, name="kiln-worker"):
        self.cpus = tuple(cpus) if cpus else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.native_id = None
        self._closed = False
        started = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(started,), name=name, daemon=True)
        _track(self)
        self.thread.start()
        started.wait()
        if isinstance(self.native_id, BaseException):
            raise PlacementError(f"cannot pin a worker to CPUs {format_cpus(self.cpus)}: "
                                 f"{self.native_id}")

    def _loop(self, started):
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)   # 0: the calling thread on Linux
            self.native_id = threading.get_native_id()
        except (OSError, AttributeError) as e:
            self.native_id = e
            started.set()
            return
        started.set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: B036 - handed to the caller
                fut.set_exception(e)

    def submit(self, fn, *args) -> Future:
        if self._closed:
            raise KilnError("this kiln model was closed; load it again to use it")
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def call(self, fn, *args):
        if threading.get_native_id() == self.native_id:
            return fn(*args)
        return self.submit(fn, *args).result()

    def affinity(self) -> set:
        """The CPUs the worker thread may run on, as the kernel reports them."""
        return set(os.sched_getaffinity(self.native_id))

    def close(self):
        self._closed = True
        self._queue.put(None)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _track(worker: Worker):
    """Remember a live worker; the first one registers the exit hook (nothing happens at import)."""
    global _exit_hook
    with _workers_lock:
        _workers.add(worker)
        if not _exit_hook:
            atexit.register(stop_workers)
            _exit_hook = True


def stop_workers(timeout: float = 5.0):
    """Let every worker finish and exit before the interpreter finalises.

    Daemon threads still running at finalisation are stopped where they
    stand; one stopped inside an engine's C++ frame aborts the process
    ("terminate called without an active exception"), which a test of a
    pipeline saved and loaded in a fresh process hit in 2 of 7 full runs.
    """
    with _workers_lock:
        workers = list(_workers)
    for worker in workers:
        worker.close()
    for worker in workers:
        if worker.thread is not threading.current_thread():
            worker.thread.join(timeout)
