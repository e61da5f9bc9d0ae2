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
``Core.host_index`` keeps the host-wide number.

Neuron's names, ``NEURON_RT_VISIBLE_CORES`` and ``NEURON_RT_NUM_CORES``, apply
(when the ``KILN_*`` names are unset) to what is placed inside a call through
``kiln.neuron``/``kiln.neuronx`` (they enter :func:`neuron_names`), or to the
whole process once it calls :func:`honour_neuron_env`. Importing those modules
changes nothing: a library that imports them must not move another's models.

The worker thread a placed model runs on is runtime code: :mod:`kiln.runtime.workers`.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

from kiln.errors import PlacementError
from kiln import config

__all__ = ["Core", "PlacementError", "available_cpus", "cores", "default_placement", "format_cpus",
           "get", "honour_neuron_env", "host_cores", "neuron_names", "parse_list", "process_cpus",
           "restricted", "share", "union", "visible"]

# Process-wide: NEURON_RT_* apply everywhere. Off unless the user turns it on (honour_neuron_env).
neuron_env = False
# Per call: NEURON_RT_* apply to what is placed inside ``with neuron_names():`` (kiln.neuron* calls).
_neuron_scope: contextvars.ContextVar = contextvars.ContextVar("kiln_neuron_names", default=False)


def honour_neuron_env(on: bool = True):
    """Read ``NEURON_RT_VISIBLE_CORES``/``NEURON_RT_NUM_CORES`` for every placement in this
    process (``KILN_*`` still win), as a script written for Neuron expects; for example when
    it loads its models with ``torch.jit.load`` rather than tracing them through ``kiln.neuronx``."""
    global neuron_env
    neuron_env = bool(on)


@contextlib.contextmanager
def neuron_names():
    """Placements inside the block read Neuron's core variables too: ``kiln.neuronx.trace``
    and the other Neuron spellings run in it, so their models land where Neuron's would."""
    token = _neuron_scope.set(True)
    try:
        yield
    finally:
        _neuron_scope.reset(token)


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


def available_cpus() -> int:
    """How many CPUs this process may run on: its affinity, which a container or ``taskset``
    narrows, not the host's CPU count (engine thread pools sized to that would oversubscribe)."""
    return len(process_cpus())


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
        try:
            n = int(per)
        except ValueError:
            raise PlacementError(f"KILN_CPUS_PER_CORE={per!r}: expected a number of CPUs") from None
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
    return _setting(name)[1]


def _setting(name) -> tuple:
    """``(variable, value)`` of a core setting: kiln's name, else Neuron's where it applies;
    errors name the variable the user set."""
    value = config.get(f"KILN_{name}")
    if value is None and (neuron_env or _neuron_scope.get()) and name in ("VISIBLE_CORES", "NUM_CORES"):
        value = config.get(f"NEURON_RT_{name}")
        if value is not None:
            return f"NEURON_RT_{name}", value
    return f"KILN_{name}", value


def restricted() -> bool:
    """Whether core settings limit this process to some of its CPUs."""
    return bool(_env("VISIBLE_CORES") or _env("NUM_CORES"))


def visible() -> list:
    """The cores this process may use, numbered from 0."""
    cores = host_cores()
    (vis_name, vis), (num_name, num) = _setting("VISIBLE_CORES"), _setting("NUM_CORES")
    if vis:
        wanted = parse_list(vis, vis_name)
        bad = [w for w in wanted if not 0 <= w < len(cores)]
        if bad:
            raise PlacementError(
                f"{vis_name}={vis} names core(s) {bad}, but this process has {len(cores)} "
                f"core(s) (0-{len(cores) - 1}) on CPUs {format_cpus(process_cpus())}")
        chosen = [cores[w] for w in dict.fromkeys(wanted)]
    elif num:
        try:
            n = int(num)
        except ValueError:
            raise PlacementError(f"{num_name}={num!r}: expected a number") from None
        if not 1 <= n <= len(cores):
            raise PlacementError(f"{num_name}={num}: this process has {len(cores)} core(s)")
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


def share(index: int, count: int, ids=None) -> list:
    """The kiln cores that worker ``index`` of ``count`` owns when ``count`` workers split
    this process's visible cores (or the cores numbered ``ids``) among themselves: contiguous
    blocks in core order, the first ``len % count`` blocks one core larger, never shared.
    With one worker per core this is DataParallel's placement (worker ``i`` on core ``i``).
    Refuses more workers than cores, naming both numbers."""
    pool = visible() if ids is None else [get(i) for i in ids]
    if count > len(pool):
        raise PlacementError(
            f"{count} ranks/workers need at least {count} kiln cores, but only {len(pool)} "
            f"are available ({'; '.join(str(c) for c in pool)}); use at most {len(pool)}, or make "
            "more cores visible (KILN_VISIBLE_CORES / KILN_NUM_CORES / KILN_CPUS_PER_CORE=1 "
            "for hyperthreads)")
    if not 0 <= index < count:
        raise PlacementError(f"worker {index} of {count}: expected 0..{count - 1}")
    per, extra = divmod(len(pool), count)
    start = index * per + min(index, extra)
    return pool[start:start + per + (1 if index < extra else 0)]


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
