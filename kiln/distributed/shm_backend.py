"""``torch.distributed`` backend ``"kiln_shm"``: gloo, with same-host all-reduces in shared memory.

kiln's own collectives (``torch.ops.kiln.all_reduce`` through
:class:`kiln.distributed.groups.TorchGroup`) already take the shared-memory path; this backend
gives it to code that calls ``dist.all_reduce`` itself::

    kiln.distributed.shm_backend.register()      # init_from_env / start_ranks call it
    dist.init_process_group("kiln_shm")           # or dist.new_group(backend="kiln_shm")

Every other collective, and an all-reduce the shared memory cannot take (several tensors, a
reduction other than sum/max/min, non-CPU tensors, ranks on several hosts), is gloo's. The
choice is :func:`kiln.distributed.shm.setup`'s (``KILN_DIST_SHM``), made while the group is
created, over the group's store.
"""
from __future__ import annotations

import pickle
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from kiln.distributed import shm
from kiln.distributed.groups import NamedProcessGroup

__all__ = ["NAME", "ShmProcessGroup", "register"]

NAME = "kiln_shm"
_LOCK = threading.Lock()
# gloo's methods this group hands over unchanged (its functional collectives reach gloo
# through the registered CPU backend)
_DELEGATED = ("broadcast", "allgather", "_allgather_base", "allgather_coalesced", "reduce_scatter",
              "_reduce_scatter_base", "allreduce_coalesced", "barrier", "alltoall_base", "alltoall",
              "send", "recv", "recv_anysource", "reduce", "gather", "scatter", "monitored_barrier")


def _reduction(opts):
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min")):
        if opts.reduceOp == op:
            return name
    return None


class ShmProcessGroup(NamedProcessGroup, dist.ProcessGroup):
    """A gloo process group whose all-reduce of one CPU tensor goes through shared memory."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._store, self._round = store, 0
        self.fast, self.choice = shm.setup(rank, size, self._gather, self._bcast, self._gloo_all_reduce,
                                           "gloo")

    # the exchange the setup needs, over the group's own store (the group is not usable yet)
    def _gather(self, obj):
        self._round += 1
        self._store.set(f"kiln_shm/{self._round}/{self.rank()}", pickle.dumps(obj))
        return [pickle.loads(self._store.get(f"kiln_shm/{self._round}/{r}")) for r in range(self.size())]

    def _bcast(self, obj):
        self._round += 1
        key = f"kiln_shm/{self._round}"
        if self.rank() == 0:
            self._store.set(key, pickle.dumps(obj))
        return pickle.loads(self._store.get(key))

    def _gloo_all_reduce(self, x):
        self._gloo.allreduce([x.clone()]).wait()

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        op = _reduction(opts)
        if self.fast is not None and op and len(tensors) == 1 and self.fast.supports(tensors[0]):
            from kiln.distributed.groups import CollectiveError
            t = tensors[0]
            try:
                if t.is_contiguous():
                    self.fast.all_reduce(t, op, out=t)
                else:
                    t.copy_(self.fast.all_reduce(t, op))
            except shm.CollectiveAbort as e:
                raise CollectiveError(str(e)) from None
            future = torch.futures.Future()
            future.set_result(tensors)
            return _create_work_from_future(future)
        return self._gloo.allreduce(tensors, opts)

    def getBackendName(self):
        return NAME

    def shutdown(self):
        if self.fast is not None:
            self.fast.close()
            self.fast = None


def _delegate(name):
    def method(self, *args, **kwargs):
        return getattr(self._gloo, name)(*args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"gloo's {name}"
    return method


for _name in _DELEGATED:
    setattr(ShmProcessGroup, _name, _delegate(_name))


def _create(store, rank, size, timeout):
    return ShmProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Make ``"kiln_shm"`` a ``torch.distributed`` backend (once per process)."""
    with _LOCK:
        if NAME not in dist.Backend.backend_list:
            dist.Backend.register_backend(NAME, _create, devices=["cpu"])
