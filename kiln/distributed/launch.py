"""Where the ranks run: one process per rank, pinned to its own kiln cores.

Two ways in:

* :func:`init_from_env`, in a process ``torchrun`` started (one host: ``--standalone``;
  several: ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT``): reads torchrun's
  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, pins the process to its share
  of the host's visible kiln cores, joins the default process group (NCCL when every local
  rank has a GPU, else gloo) and binds kiln's ``"world"`` collective group.
  (``backend="kiln_shm"``: gloo with same-host all-reduces in shared memory for
  ``dist.all_reduce`` too; see :mod:`kiln.distributed.shm_backend`.)
* :func:`start_ranks`, in a process that should *become* rank 0 of a one-host world (``kiln
  serve`` of a tensor-parallel artifact): starts ranks 1..N-1 as child processes
  (``python -m kiln.distributed.rank``), each pinned to its cores, meets them over loopback
  on a free port, and has them call an entry function by its import path. The returned
  :class:`Ranks` watches the children: a child that exits with an error is reported to an
  ``on_failure`` callback at once (a server fails its in-flight requests instead of hanging
  in a collective), and the children exit when rank 0 dies (they watch a pipe from it).

Cores are split as :func:`kiln.host.cores.share` says (the placement DataParallel uses: with
one rank per core, rank ``i`` owns core ``i``); ranks never share a core, and more ranks than
cores is a :class:`~kiln.errors.PlacementError`. Each rank's intra-op threads equal its CPUs.
"""
from __future__ import annotations

import collections
import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from kiln import config
from kiln.errors import KilnError
from kiln.host import cores as kcores
from kiln.host import child as child_python

__all__ = ["RankInfo", "RankStartError", "Ranks", "current", "init_from_env", "pin", "resolve_entry",
           "start_ranks"]

log = logging.getLogger("kiln")
# not passed to a child rank: it is given its CPUs explicitly
CORE_ENV = ("KILN_VISIBLE_CORES", "KILN_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES",
            "KILN_PROFILE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_NUM_THREADS")
READY_KEY = "kiln/ready/{}"


class RankStartError(KilnError):
    """A rank could not start (the message carries its error output's tail)."""


@dataclass(frozen=True)
class RankInfo:
    """Where this rank runs. ``cores``: kiln core ids (this host's numbering before pinning);
    ``cpus``: the CPUs it is pinned to."""
    rank: int
    world: int
    local_rank: int
    local_world: int
    cores: tuple = ()
    cpus: tuple = ()
    backend: str = "gloo"


_current: RankInfo | None = None


def current() -> RankInfo | None:
    """This process's rank, once :func:`init_from_env` or :func:`start_ranks` (or the child
    entry) has set it up."""
    return _current


def set_current(info: RankInfo | None) -> None:
    global _current
    _current = info


# -- pinning ----------------------------------------------------------------------------------------
def pin(cpus, threads: bool = True) -> None:
    """Pin every thread of this process to ``cpus`` (``os.sched_setaffinity`` moves only the
    calling thread on Linux, and a pool made before would keep its old CPUs), then size
    torch's intra-op pool to them when ``threads``."""
    cpus = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:   # a thread that ended meanwhile
            pass
        except OSError as e:
            raise kcores.PlacementError(f"cannot pin this process to CPUs {kcores.format_cpus(cpus)}: "
                                        f"{e}") from None
    if threads:
        import torch
        torch.set_num_threads(len(cpus))


def _env_int(name: str) -> int:
    value = config.get(name)
    if value is None:
        raise KilnError(f"{name} is not set: init_from_env is for processes torchrun starts "
                        "(torchrun --standalone --nproc_per_node=N script.py); to start ranks "
                        "from this process, use kiln.distributed.launch.start_ranks")
    try:
        return int(value)
    except ValueError:
        raise KilnError(f"{name}={value!r}: expected a number") from None


def _choose_backend(backend, local_rank, local_world):
    import torch
    if backend is not None:
        return backend
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        return "nccl"
    return "gloo"


def init_from_env(backend: str | None = None, timeout: float = 1800.0) -> RankInfo:
    """Set up this torchrun-started process as its rank (see the module doc). Safe to call
    again, and in a process whose default group is already initialised (it is joined, not
    made twice; its backend is reported)."""
    import torch.distributed as dist
    from kiln.distributed import groups, shm_backend
    shm_backend.register()       # dist.new_group(backend="kiln_shm") works in every rank
    if _current is not None and dist.is_initialized():
        return _current
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    local_world = int(config.get("LOCAL_WORLD_SIZE") or world)
    mine = kcores.share(local_rank, local_world)
    cpus = kcores.union(mine)
    pin(cpus)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise KilnError(f"the default process group is rank {dist.get_rank()} of "
                            f"{dist.get_world_size()}, but torchrun says rank {rank} of {world}")
        backend = str(dist.get_backend())
    else:
        backend = _choose_backend(backend, local_rank, local_world)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    if not isinstance(groups.is_bound("world") and groups.get("world"), groups.TorchGroup):
        groups.register("world", groups.TorchGroup())
    info = RankInfo(rank, world, local_rank, local_world, tuple(c.host_index for c in mine), cpus, backend)
    set_current(info)
    return info


# -- entries by import path ------------------------------------------------------------------------
def resolve_entry(entry: str):
    """``"package.module:function"`` -> the function (imported, never unpickled)."""
    if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
        raise KilnError(f"entry {entry!r}: expected 'package.module:function'")
    module, name = entry.split(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise KilnError(f"entry {entry!r}: {module} has no {name}")
    if not callable(obj):
        raise KilnError(f"entry {entry!r} is not callable")
    return obj


# -- rank 0 starting the others ---------------------------------------------------------------------
@dataclass
class _Child:
    rank: int
    proc: subprocess.Popen
    pipe: int                                  # write end the child watches; closed = rank 0 gone
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    drain: threading.Thread | None = None

    def stderr_tail(self, wait: float = 2.0) -> str:
        if self.drain is not None:
            self.drain.join(wait)
        return "".join(self.tail)


def _drain(child: _Child, echo: bool):
    for raw in iter(child.proc.stderr.readline, b""):
        line = raw.decode("utf-8", "replace")
        child.tail.append(line)
        if echo:
            try:
                sys.stderr.write(f"[rank {child.rank}] {line}")
            except (OSError, ValueError):
                pass
    child.proc.stderr.close()


def _spawn(rank, cfg, echo):
    r, w = os.pipe()
    env = child_python.environment({k: v for k, v in os.environ.items() if k not in CORE_ENV})
    env["OMP_NUM_THREADS"] = str(len(cfg["info"].cpus))
    try:
        proc = subprocess.Popen(child_python.module("kiln.distributed.rank", r), pass_fds=[r],
                                env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        os.close(r)
    data = pickle.dumps(cfg)
    child = _Child(rank, proc, w)
    child.drain = threading.Thread(target=_drain, args=(child, echo), daemon=True,
                                   name=f"kiln-rank{rank}-stderr")
    child.drain.start()
    try:
        os.write(w, len(data).to_bytes(8, "little"))
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    except OSError:
        pass     # the child died at start; its exit code and output tell why
    return child


def start_ranks(world: int, entry: str, payload=None, *, cores=None, timeout: float = 300.0,
                collective_timeout: float = 1800.0, backend: str = "gloo", on_failure=None,
                pin_self: bool = True, echo_stderr: bool = True) -> "Ranks":
    """Make this process rank 0 of ``world`` ranks on this host (see the module doc).

    ``entry``: ``"package.module:function"``, called in each child as ``function(info,
    payload)`` with its :class:`RankInfo` (rank 0 calls it itself, if it wants to, with
    :meth:`Ranks.call_entry`). ``payload``: a small picklable value, sent to each child down
    a pipe (never through a file or the command line). ``cores``: kiln core ids to split
    among the ranks (default: every visible core). ``timeout``: seconds for the children to
    start; ``collective_timeout``: gloo's limit on one collective. ``on_failure(rank,
    returncode, stderr_tail)``: called from a watchdog thread when a child exits with an
    error before :meth:`Ranks.terminate`."""
    import torch.distributed as dist
    from kiln.distributed import groups, shm_backend
    shm_backend.register()
    if world < 1:
        raise KilnError(f"start_ranks: world={world}; expected at least 1")
    if dist.is_initialized():
        raise KilnError("start_ranks: this process is already in a torch.distributed world; "
                        "destroy_process_group() first, or use init_from_env under torchrun")
    resolve_entry(entry)          # a bad entry fails here, before any process starts
    shares = [kcores.share(r, world, cores) for r in range(world)]
    try:
        pickle.dumps(payload)
    except Exception as e:
        raise KilnError(f"start_ranks: the payload cannot be pickled ({e}); pass plain data") from None
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    infos = [RankInfo(r, world, r, world, tuple(c.host_index for c in s), kcores.union(s), backend)
             for r, s in enumerate(shares)]
    children = []
    before = (kcores.process_cpus(), _threads())
    try:
        for r in range(1, world):
            cfg = {"info": infos[r], "port": store.port, "entry": entry, "payload": payload,
                   "timeout": timeout, "collective_timeout": collective_timeout}
            children.append(_spawn(r, cfg, echo_stderr))
        if pin_self:
            pin(infos[0].cpus)
        _await_ready(store, children, timeout)
        _join(backend, store, world, timeout, collective_timeout)
    except BaseException:
        _kill(children)
        if pin_self:
            _unpin(before)
        raise
    groups.register("world", groups.TorchGroup())
    set_current(infos[0])
    return Ranks(infos[0], children, entry, payload, on_failure, store, before)


def _threads():
    import torch
    return torch.get_num_threads()


def _unpin(before):
    import torch
    cpus, threads = before
    if set(kcores.process_cpus()) != set(cpus):
        pin(cpus, threads=False)
    torch.set_num_threads(threads)


def _join(backend, store, world, timeout, collective_timeout):
    """Rank 0 joins the world. A child that dies after signalling ready but before joining
    would leave gloo's connect retrying for the whole collective timeout; joining under the
    start timeout and raising the limit afterwards bounds that."""
    import torch.distributed as dist
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    first = min(timeout, collective_timeout) if set_timeout is not None else collective_timeout
    dist.init_process_group(backend, store=store, rank=0, world_size=world,
                            timeout=timedelta(seconds=first))
    if first != collective_timeout:
        set_timeout(timedelta(seconds=collective_timeout))


def _await_ready(store, children, timeout):
    keys = [READY_KEY.format(c.rank) for c in children]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        for c in children:
            code = c.proc.poll()
            if code is not None:
                raise RankStartError(f"rank {c.rank} (pid {c.proc.pid}) exited with code {code} while "
                                     f"starting; its last output:\n{c.stderr_tail()}")
        if time.monotonic() > deadline:
            late = [c.rank for c in children if not store.check([READY_KEY.format(c.rank)])]
            raise RankStartError(f"rank(s) {late} did not start within {timeout:g}s")
        time.sleep(0.01)


def _kill(children, grace: float = 3.0):
    for c in children:
        try:
            os.close(c.pipe)          # the child's watcher sees rank 0 leave
        except OSError:
            pass
        if c.proc.poll() is None:
            c.proc.terminate()
    end = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


class Ranks:
    """Rank 0's handle on the ranks it started."""

    def __init__(self, info, children, entry, payload, on_failure, store, before):
        self.rank_info = info
        self._before = before          # (CPUs, torch threads) this process had
        self.entry, self.payload = entry, payload
        self.on_failure = on_failure
        self.failures: list = []          # (rank, returncode, stderr tail) of children that failed
        self._children = children
        self._store = store
        self._stopping = False
        self._watchers = [threading.Thread(target=self._watch, args=(c,), daemon=True,
                                           name=f"kiln-rank{c.rank}-watchdog") for c in children]
        for t in self._watchers:
            t.start()

    @property
    def pids(self) -> dict:
        return {c.rank: c.proc.pid for c in self._children}

    def kill(self):
        """SIGKILL the children now, a stopped (SIGSTOP) one included, which would keep a
        SIGTERM pending until continued; :meth:`terminate` still reaps them afterwards."""
        for c in self._children:
            if c.proc.poll() is None:
                c.proc.kill()

    def _watch(self, child):
        code = child.proc.wait()
        if code == 0 or self._stopping:
            return
        try:
            from kiln.distributed import groups
            world = groups.get("world")
            if getattr(world, "fast", None) is not None:
                world.fast.abort()     # a rank waiting in shared memory stops now
        except KilnError:
            pass
        tail = child.stderr_tail()
        self.failures.append((child.rank, code, tail))
        log.error("rank %d (pid %d) exited with code %s; its last output:\n%s", child.rank,
                  child.proc.pid, code, tail)
        if self.on_failure is not None:
            try:
                self.on_failure(child.rank, code, tail)
            except Exception:
                log.exception("on_failure callback for rank %d raised", child.rank)

    def call_entry(self):
        """Run the entry in rank 0 too, as the children do (symmetric programs)."""
        return resolve_entry(self.entry)(self.rank_info, self.payload)

    def alive(self) -> bool:
        """Whether every child rank is still running."""
        return all(c.proc.poll() is None for c in self._children)

    def wait(self, timeout: float | None = None) -> dict:
        """Wait for the children to finish; their exit codes by rank. A child that failed is a
        :class:`KilnError` naming it, with the tail of its error output."""
        end = None if timeout is None else time.monotonic() + timeout
        for c in self._children:
            try:
                c.proc.wait(None if end is None else max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise KilnError(f"rank {c.rank} still running after {timeout:g}s") from None
        codes = {c.rank: c.proc.returncode for c in self._children}
        bad = [c for c in self._children if c.proc.returncode != 0]
        if bad:
            c = bad[0]
            raise KilnError(f"rank {c.rank} exited with code {c.proc.returncode}; its last output:\n"
                            f"{c.stderr_tail()}")
        return codes

    def terminate(self, grace: float = 3.0):
        """Stop the children (SIGTERM, then SIGKILL after ``grace`` seconds), reap them, leave
        this process's world group, and give this process back the CPUs it had before."""
        import torch.distributed as dist
        from kiln.distributed import groups
        self._stopping = True
        _kill(self._children, grace)
        for t in self._watchers:
            t.join(grace)
        try:
            world = groups.get("world")
            if isinstance(world, groups.TorchGroup):
                world.close()
        except KilnError:
            pass
        groups.unregister("world")
        if dist.is_initialized():
            dist.destroy_process_group()
        _unpin(self._before)
        set_current(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.terminate()
