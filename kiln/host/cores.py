"""kiln cores: the process's CPUs grouped into units a model can own.

A Neuron process owns NeuronCores and places each model on one. kiln does the
same with CPUs: the CPUs this process may run on are grouped into *kiln cores*
(by default one per physical core, hyperthread siblings together), and a model
placed on a core runs on a worker thread pinned to that core's CPUs, with its
engine's thread pool created from that thread, so the pool inherits the pin and
has exactly that many threads.

Which cores a process sees:

``KILN_VISIBLE_CORES``  e.g. ``0-1`` or ``0,2-3``: indices into the host's cores
``KILN_NUM_CORES``      the first N cores
``KILN_CPUS_PER_CORE``  group CPUs N at a time instead of by physical core

Visible cores are renumbered from 0 inside the process, as Neuron does;
``Core.host_index`` keeps the host-wide number. ``kiln.neuron``/``kiln.neuronx``
also honour ``NEURON_RT_VISIBLE_CORES`` and ``NEURON_RT_NUM_CORES``.
"""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

from kiln.errors import KilnError

# Set by the Neuron compatibility modules: they read NEURON_RT_* when KILN_* is unset.
neuron_env = False


class PlacementError(KilnError):
    """A core number or core setting that this process cannot honour."""


@dataclass(frozen=True)
class Core:
    id: int                 # number inside this process (0..visible-1)
    host_index: int         # number among all of the host's cores
    cpus: tuple

    def __str__(self):
        return f"core {self.id} (CPUs {format_cpus(self.cpus)})"


def parse_list(text: str, what: str) -> list:
    """``"0-1,4"`` -> ``[0, 1, 4]``."""
    out: list = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise PlacementError(f"{what}={text!r}: expected core numbers like '0-1' or '0,2-3'") from None
    return out


def format_cpus(cpus) -> str:
    cpus = sorted(cpus)
    runs, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            runs.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(runs)


def process_cpus() -> list:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _siblings(cpu: int):
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as f:
            return tuple(parse_list(f.read().strip(), path))
    except (OSError, PlacementError):
        return (cpu,)


def host_cores() -> list:
    """All cores of this process's CPUs, before KILN_VISIBLE_CORES/KILN_NUM_CORES."""
    cpus = process_cpus()
    per = _env("CPUS_PER_CORE")
    groups: list = []
    if per:
        n = int(per)
        if n < 1:
            raise PlacementError(f"KILN_CPUS_PER_CORE={per}: must be at least 1")
        groups = [tuple(cpus[i:i + n]) for i in range(0, len(cpus), n)]
    else:
        seen: set = set()
        allowed = set(cpus)
        for c in cpus:
            if c in seen:
                continue
            group = tuple(s for s in _siblings(c) if s in allowed) or (c,)
            seen.update(group)
            groups.append(group)
    return [Core(i, i, g) for i, g in enumerate(groups)]


def _env(name):
    value = os.environ.get(f"KILN_{name}")
    if value is None and neuron_env and name in ("VISIBLE_CORES", "NUM_CORES"):
        value = os.environ.get(f"NEURON_RT_{name}")
    return value


def restricted() -> bool:
    """Whether core settings limit this process to some of its CPUs."""
    return bool(_env("VISIBLE_CORES") or _env("NUM_CORES"))


def visible() -> list:
    """The cores this process may use, numbered from 0."""
    cores = host_cores()
    vis, num = _env("VISIBLE_CORES"), _env("NUM_CORES")
    if vis:
        wanted = parse_list(vis, "KILN_VISIBLE_CORES")
        bad = [w for w in wanted if not 0 <= w < len(cores)]
        if bad:
            raise PlacementError(
                f"KILN_VISIBLE_CORES={vis} names core(s) {bad}, but this process has {len(cores)} "
                f"core(s) (0-{len(cores) - 1}) on CPUs {format_cpus(process_cpus())}")
        chosen = [cores[w] for w in dict.fromkeys(wanted)]
    elif num:
        try:
            n = int(num)
        except ValueError:
            raise PlacementError(f"KILN_NUM_CORES={num!r}: expected a number") from None
        if not 1 <= n <= len(cores):
            raise PlacementError(f"KILN_NUM_CORES={num}: this process has {len(cores)} core(s)")
        chosen = cores[:n]
    else:
        chosen = cores
    return [Core(i, c.host_index, c.cpus) for i, c in enumerate(chosen)]


def get(core_id: int) -> Core:
    cores = visible()
    if not isinstance(core_id, int) or not 0 <= core_id < len(cores):
        raise PlacementError(f"no kiln core {core_id!r}: this process sees {len(cores)} core(s): "
                             + "; ".join(str(c) for c in cores))
    return cores[core_id]


def union(cores) -> tuple:
    return tuple(sorted({c for core in cores for c in core.cpus}))


# -- placement context -----------------------------------------------------------
_placement: contextvars.ContextVar = contextvars.ContextVar("kiln_core", default=None)


@contextlib.contextmanager
def cores(core_id: int):
    """Models loaded or traced inside ``with kiln.cores(i):`` are placed on core ``i``."""
    token = _placement.set(get(core_id))
    try:
        yield _placement.get()
    finally:
        _placement.reset(token)


def default_placement():
    """The core a new model goes to: the ``kiln.cores`` context, else None."""
    return _placement.get()


# -- pinned worker thread --------------------------------------------------------------
class Worker:
    """One thread, optionally pinned to CPUs, running submitted calls in order.

    Engines create their thread pools from the thread that loads them, and
    threads inherit their creator's CPU affinity; so loading and running a
    model on its worker keeps all of its threads on its core.
    """

    def __init__(self, cpus=None, name="kiln-worker"):
        self.cpus = tuple(cpus) if cpus else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.native_id = None
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(started,), name=name, daemon=True)
        self._thread.start()
        _workers.add(self)
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


_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()


@atexit.register
def _stop_workers(timeout: float = 5.0):
    """Let every worker finish and exit before the interpreter finalises.

    Daemon threads still running at finalisation are stopped where they
    stand; one stopped inside an engine's C++ frame aborts the process
    ("terminate called without an active exception"), which a test of a
    pipeline saved and loaded in a fresh process hit in 2 of 7 full runs.
    """
    for worker in list(_workers):
        worker.close()
    for worker in list(_workers):
        if worker._thread is not threading.current_thread():
            worker._thread.join(timeout)
