"""Collective groups by symbolic name.

A compiled graph that communicates names its group symbolically (``"tp"``), never by a
process-local handle, so the same artifact runs wherever a group of that name and size
is bound: the tensor-parallel group of ``torch.distributed`` ranks at run time, or a
:class:`ThreadGroup` (one thread per rank, in one process) when the compiler checks a
sharded model against eager without starting processes.

Lookup order: the calling thread's binding (:func:`bound`, used by thread groups, whose
ranks are threads), then the process-wide one (:func:`register`).
"""
from __future__ import annotations

import contextlib
import threading

from kiln.errors import KilnError

_process: dict = {}
_local = threading.local()


class CollectiveError(KilnError, RuntimeError):
    """A collective could not run: no group of that name, or a peer failed."""


def register(name: str, group) -> None:
    """Bind ``name`` for the whole process (``group``: a :class:`TorchGroup` or anything
    with ``rank``, ``size``, ``all_reduce``, ``all_gather``, ``reduce_scatter``)."""
    _process[name] = group


def unregister(name: str) -> None:
    _process.pop(name, None)


def names() -> list:
    """The names bound process-wide."""
    return list(_process)


def clear() -> None:
    _process.clear()


@contextlib.contextmanager
def registered(name: str, group):
    """``name`` bound process-wide to ``group`` inside the block, then as it was before
    (the compiler binds a stand-in while it checks one rank's graphs)."""
    previous = _process.get(name)
    register(name, group)
    try:
        yield group
    finally:
        if previous is not None:
            register(name, previous)
        else:
            unregister(name)


@contextlib.contextmanager
def bound(**groups):
    """Bind names for the calling thread only, inside the block."""
    previous = dict(getattr(_local, "groups", {}))
    _local.groups = {**previous, **groups}
    try:
        yield
    finally:
        _local.groups = previous


def get(name: str):
    group = getattr(_local, "groups", {}).get(name) or _process.get(name)
    if group is None:
        raise CollectiveError(
            f"no collective group named {name!r} in this process: a tensor-parallel graph runs "
            "only inside its ranks (kiln starts them for a tensor-parallel artifact; in a script, "
            "call kiln.neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel "
            "after torch.distributed.init_process_group)")
    return group


def is_bound(name: str) -> bool:
    return bool(getattr(_local, "groups", {}).get(name) or _process.get(name))


class NamedProcessGroup:
    """A Python ``torch.distributed.ProcessGroup`` keeps its own name and description
    (device meshes ask for them); kiln's two Python backends (``kiln_shm``, ``"xla"``) share this."""

    def setGroupName(self, name) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")


class TorchGroup:
    """A ``torch.distributed`` process group (None: the default, world) under kiln's
    collective interface; out-of-place, so the operators stay functional.

    ``shm``: whether all-reduces of CPU tensors between ranks on one host go through
    shared memory (:mod:`kiln.distributed.shm`) instead of gloo's loopback TCP: ``"auto"``
    (default, ``KILN_DIST_SHM``) uses it when the group's first all-reduce measures it
    faster on this machine, ``"on"`` whenever the ranks share a host, ``"off"`` never.
    The choice is made collectively at that first all-reduce (every rank calls it), so
    making a TorchGroup on some ranks only is still safe."""

    def __init__(self, pg=None, shm: str | None = None):
        import torch.distributed as dist
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.ranks = list(dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD))
        self.shm_mode = shm
        self.fast = None        # the ShmAllReduce in use, once chosen
        self._chosen = False
        self.choice = None      # why: the measurement or rule that chose

    def all_reduce(self, x, op: str = "sum"):
        import torch.distributed as dist
        if not self._chosen:
            self._choose()
        if self.fast is not None and self.fast.supports(x):
            from kiln.distributed.shm import CollectiveAbort
            try:
                return self.fast.all_reduce(x, op)
            except CollectiveAbort as e:
                raise CollectiveError(str(e)) from None
        out = x.clone()
        dist.all_reduce(out, op=_OPS[op](), group=self.pg)
        return out

    def _choose(self):
        from kiln.distributed import shm
        self._chosen = True
        self.fast, self.choice = shm.for_group(self, self.shm_mode)

    def close(self):
        """Release the shared-memory segment (the process group stays)."""
        if self.fast is not None:
            self.fast.close()
            self.fast = None

    def all_gather(self, x, dim: int):
        """Concatenated along ``dim``. With the shared-memory path, as an all-reduce of a
        zero buffer holding this rank's part at its place (adding zeros is exact): a
        decode step's vocabulary-sharded logits took 1-2 ms through gloo, ~50 µs so."""
        import torch
        import torch.distributed as dist
        if not self._chosen:
            self._choose()
        if self.fast is not None and self.fast.supports(x):
            shape = list(x.shape)
            part = shape[dim]
            shape[dim] = part * self.size
            full = x.new_zeros(shape)
            full.narrow(dim, self.rank * part, part).copy_(x)
            return self.all_reduce(full)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x, dim: int):
        import torch
        import torch.distributed as dist
        parts = [p.contiguous() for p in torch.chunk(x, self.size, dim=dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.pg)
        return out

    def __repr__(self):
        return f"TorchGroup(rank {self.rank} of {self.size}, ranks {self.ranks})"


def _op_table():
    import torch.distributed as dist
    return {"sum": lambda: dist.ReduceOp.SUM, "max": lambda: dist.ReduceOp.MAX,
            "min": lambda: dist.ReduceOp.MIN}


class _Ops(dict):
    def __missing__(self, key):
        table = _op_table()
        if key not in table:
            raise CollectiveError(f"unknown reduction {key!r}: kiln's collectives take sum, max or min")
        return table[key]


_OPS = _Ops()


class ThreadGroup:
    """``size`` ranks as threads of this process: each thread calls :meth:`rank_view`'s
    collectives, which meet at a barrier. The compiler uses it to run every rank of a
    sharded graph side by side and compare with eager, without processes."""

    def __init__(self, size: int, timeout: float = 600.0):
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size)
        self._slots: list = [None] * size

    def rank_view(self, rank: int) -> "_ThreadRank":
        return _ThreadRank(self, rank)

    def _exchange(self, rank, value):
        self._slots[rank] = value
        try:
            self._barrier.wait(self.timeout)
            values = list(self._slots)
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveError("a rank of the in-process thread group failed; the collective was "
                                  "abandoned") from None
        return values

    def abort(self):
        self._barrier.abort()


class _ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size
        self.ranks = list(range(group.size))

    def all_reduce(self, x, op: str = "sum"):
        import torch
        values = self.group._exchange(self.rank, x)
        if op == "sum":
            out = values[0].clone()
            for v in values[1:]:
                out = out + v
            return out
        stacked = torch.stack(values)
        if op == "max":
            return stacked.amax(0)
        if op == "min":
            return stacked.amin(0)
        raise CollectiveError(f"unknown reduction {op!r}: kiln's collectives take sum, max or min")

    def all_gather(self, x, dim: int):
        import torch
        return torch.cat(self.group._exchange(self.rank, x), dim=dim)

    def reduce_scatter(self, x, dim: int):
        import torch
        values = self.group._exchange(self.rank, x)
        total = values[0].clone()
        for v in values[1:]:
            total = total + v
        return torch.chunk(total, self.size, dim=dim)[self.rank].contiguous()


class SoloGroup:
    """Stands in for a group of ``size`` ranks in one thread, every rank holding the same
    tensor: all-reduce returns the input, all-gather repeats it, reduce-scatter takes this
    rank's chunk. The compiler binds it while it checks one rank's graph against the same
    graph run eagerly: both sides see the same stand-in, so the check covers the engines'
    partitions; the ranks together are checked with a :class:`ThreadGroup`."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank
        self.ranks = list(range(size))

    def all_reduce(self, x, op: str = "sum"):
        return x.clone()

    def all_gather(self, x, dim: int):
        import torch
        return torch.cat([x] * self.size, dim=dim)

    def reduce_scatter(self, x, dim: int):
        import torch
        return torch.chunk(x, self.size, dim=dim)[self.rank].contiguous()
