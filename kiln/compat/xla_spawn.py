"""torch_xla's ``xla_multiprocessing.spawn`` (``xmp.spawn(_mp_fn, args=(flags,), nprocs=N)``,
the launch line of torch_xla's example training scripts) on kiln.

``spawn`` starts ``nprocs`` processes of this host through
:func:`torch.multiprocessing.start_processes` and calls ``fn(index, *args)`` in each, with
the environment ``torchrun`` would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port), each pinned
to its share of the host's kiln cores as torchrun-started ranks are
(:func:`kiln.distributed.launch.pin`). So ``xm.get_ordinal()`` and ``xm.xrt_world_size()``
read the rank and world size, ``dist.init_process_group("xla")`` (or
``init_method="xla://"``) joins the ranks, and ``xm.optimizer_step`` averages gradients
over them even where the script makes no process group (:mod:`kiln.compat.xla_model`).

``nprocs=None`` means one process per kiln core, as torch_xla starts one per device; ``1``
runs ``fn(0, *args)`` in this process, as torch_xla does. The start method is ``"fork"``
where the platform has it, not torch_xla's ``"spawn"``: a spawned child re-imports the
script in a fresh interpreter, where ``kiln run-xla``'s ``torch_xla`` alias does not exist;
a forked child inherits it. ``start_method="spawn"`` is honoured when asked for (scripts
that import ``kiln.xla`` directly). A rank that fails raises here with its traceback, after
the others are stopped (PyTorch's ``ProcessRaisedException``).
"""
from __future__ import annotations

import multiprocessing
import os
import socket

import torch.multiprocessing as tmp

from kiln.errors import InputError


def _forking() -> str:
    """``"fork"`` where the platform has it (module doc), else ``"spawn"``."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _count(nprocs) -> int:
    if nprocs is None:
        from kiln.host import cores
        return max(1, len(cores.visible()))
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise InputError(f"xmp.spawn(nprocs={nprocs!r}): expected a positive number of processes, or None "
                         "(one per kiln core)")
    return nprocs


def torchrun_environment(index: int, world: int, port: int) -> dict:
    """The variables ``torchrun --nproc_per_node=world`` gives its rank ``index`` on one host."""
    return dict(RANK=str(index), WORLD_SIZE=str(world), LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _rank(index, fn, args, world, port):
    """A child: the launcher's environment, this rank's cores, then the script's function."""
    os.environ.update(torchrun_environment(index, world, port))
    from kiln.distributed import launch
    from kiln.host import cores
    launch.pin(cores.union(cores.share(index, world)))
    fn(index, *args)


def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method=None):
    """Run ``fn(index, *args)`` in ``nprocs`` ranks (see the module doc); returns PyTorch's
    process context when ``join`` is False, else None once every rank has finished."""
    world = _count(nprocs)
    if world == 1:
        fn(0, *args)
        return None
    from kiln.host import cores
    cores.share(0, world)            # more ranks than cores: the PlacementError here, not in every rank
    start_method = start_method or _forking()
    return tmp.start_processes(_rank, args=(fn, tuple(args), world, free_port()), nprocs=world, join=join,
                               daemon=daemon, start_method=start_method)


class MpModelWrapper:
    """torch_xla's wrapper that shares one model's weights between spawned processes; each
    kiln rank is a process of its own, so it holds the model and ``to(device)`` moves it."""

    def __init__(self, model):
        self._model = model

    def to(self, device):
        return self._model.to(device)


class MpSerialExecutor:
    """torch_xla's helper that runs a function in one process at a time on a host (loading a
    dataset once); here each call runs ``fn()`` holding a lock shared by the ranks."""

    def __init__(self):
        self._lock = multiprocessing.get_context(_forking()).Lock()

    def run(self, fn):
        with self._lock:
            return fn()
