"""A rank that rank 0 started: ``python -m kiln.distributed.rank FD``.

:func:`kiln.distributed.launch.start_ranks` runs this with the read end of a pipe. Down it
comes the rank's configuration (its :class:`~kiln.distributed.launch.RankInfo`, the loopback
port of rank 0's store, the entry's import path and the payload), pickled by rank 0 itself
(never read from a file). The pipe then stays open: when it reaches end-of-file, rank 0 is
gone and this process exits at once, so no rank outlives the process that started it (a
thread watches it; unlike PR_SET_PDEATHSIG it does not fire when the *thread* that started
the ranks ends). The rank pins itself before importing torch, so every thread torch makes
inherits its CPUs; signals it is ready once its entry imports (an entry that fails to import
is an error rank 0 reports with this process's traceback, not a hang at the rendezvous);
joins the world group; runs the entry; and leaves.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading


def _read_config(fd: int) -> dict:
    head = b""
    while len(head) < 8:
        chunk = os.read(fd, 8 - len(head))
        if not chunk:
            raise SystemExit("kiln rank: rank 0 closed the pipe before sending the configuration")
        head += chunk
    size = int.from_bytes(head, "little")
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise SystemExit("kiln rank: the configuration was cut short")
        data += chunk
    return pickle.loads(bytes(data))   # from rank 0, this process's parent, down its own pipe


def _watch_parent(fd: int):
    """Exit when rank 0 closes the pipe (it exited, crashed, or terminated the ranks)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os._exit(70)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m kiln.distributed.rank FD  (started by kiln.distributed.launch."
              "start_ranks)", file=sys.stderr)
        return 2
    fd = int(argv[0])
    cfg = _read_config(fd)
    threading.Thread(target=_watch_parent, args=(fd,), daemon=True, name="kiln-rank-parent").start()
    info = cfg["info"]
    os.sched_setaffinity(0, info.cpus)         # before torch: its threads inherit this
    from datetime import timedelta

    import torch.distributed as dist

    from kiln.distributed import groups, launch, shm_backend
    shm_backend.register()
    launch.pin(info.cpus)
    fn = launch.resolve_entry(cfg["entry"])
    store = dist.TCPStore("127.0.0.1", cfg["port"], info.world, is_master=False,
                          timeout=timedelta(seconds=cfg["timeout"]))
    store.set(launch.READY_KEY.format(info.rank), str(os.getpid()))
    dist.init_process_group(info.backend, store=store, rank=info.rank, world_size=info.world,
                            timeout=timedelta(seconds=cfg["collective_timeout"]))
    groups.register("world", groups.TorchGroup())
    launch.set_current(info)
    try:
        fn(info, cfg["payload"])
    finally:
        world = groups.get("world")
        world.close()
        groups.unregister("world")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
