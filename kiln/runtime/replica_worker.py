"""One DataParallel replica's process, and the shared-memory transport of its tensors.

The parent (:mod:`kiln.runtime.replicas`) starts a fresh interpreter per kiln core
running :func:`worker_entry`; inputs and outputs travel through parent-owned shared
memory segments, described by a small layout sent over a pipe, so no tensor is pickled.
"""
from __future__ import annotations

import json
import math
import os
import sys
from multiprocessing import connection, resource_tracker, shared_memory

import torch

from kiln.artifact import specs


# -- shared-memory tensor transport ------------------------------------------------------
def layout(tensors):
    """[(offset, shape, dtype name)], total bytes; offsets 64-byte aligned."""
    meta, offset = [], 0
    for t in tensors:
        meta.append((offset, tuple(t.shape), specs.dtype_name(t.dtype)))
        offset += (t.numel() * t.element_size() + 63) // 64 * 64
    return meta, offset


def write(buf, tensors, meta):
    for t, (offset, _, _) in zip(tensors, meta):
        n = t.numel()
        if n:
            torch.frombuffer(buf, dtype=t.dtype, count=n, offset=offset).copy_(t.reshape(-1))


def view(buf, meta):
    out = []
    for offset, shape, dtype in meta:
        dt = specs.dtype_from_name(dtype)
        n = math.prod(shape)
        t = torch.frombuffer(buf, dtype=dt, count=n, offset=offset) if n else torch.empty(0, dtype=dt)
        out.append(t.view(shape))
    return out


class Segment:
    """A parent-owned shared memory segment that grows by replacement."""

    def __init__(self, size):
        self.shm = shared_memory.SharedMemory(create=True, size=max(int(size), 4096))

    def ensure(self, size):
        if size > self.shm.size:
            self.close()
            self.shm = shared_memory.SharedMemory(create=True, size=int(size * 1.5))
        return self.shm

    def close(self):
        try:
            self.shm.close()
            self.shm.unlink()
        except (FileNotFoundError, OSError):
            pass


# -- the worker process ------------------------------------------------------------------------
def attach(name):
    """Map a parent-owned segment; the parent alone unlinks it (Python < 3.13
    would otherwise have this process's resource tracker unlink it at exit)."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:
        pass
    return shm


def worker_entry():
    """``python -c 'from kiln.runtime.replica_worker import worker_entry; worker_entry()' FD CONFIG``.

    A fresh interpreter, not multiprocessing's spawn: spawn re-imports the
    user's ``__main__``, which breaks every script without a main guard."""
    fd, config = int(sys.argv[1]), json.loads(sys.argv[2])
    worker_main(connection.Connection(fd), config["artifact"], tuple(config["cpus"]),
                 config["dynamic_batching"])


def worker_main(conn, artifact_path, cpus, dynamic_batching):
    try:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
        from kiln.runtime.loader import load
        from kiln.runtime.buckets import dynamic_batch
        # the parent wrote this file, in its private directory, from a model it had loaded
        # (and so trusted): its native code is trusted here too
        model = load(artifact_path, threads=len(cpus), trust_native_code=True)
        if dynamic_batching:
            model = dynamic_batch(model)
    except BaseException as e:  # noqa: B036 - reported to the parent, then exit
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    attached: dict = {}

    def segment(name):
        if name not in attached:
            for old in attached.values():
                old.close()
            attached.clear()
            attached[name] = attach(name)
        return attached[name]

    def send_outputs(name, outs):
        meta, size = layout(outs)
        out = attach(name)
        try:
            if size > out.size:
                return ("grow", size)
            write(out.buf, outs, meta)
            return ("ok", meta)
        finally:
            out.close()

    held = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "run":
            _, in_name, in_meta, out_name = msg
            try:
                flat = view(segment(in_name).buf, in_meta)
                model.check(flat)
                with torch.no_grad():
                    held = [o.contiguous() for o in model.run_flat(flat)]
                del flat
            except BaseException as e:  # noqa: B036 - the call's error, not the worker's
                conn.send(("error", type(e).__name__, str(e)))
                continue
        # "run" that fitted, or "resend" after the parent grew the output segment
        reply = send_outputs(msg[-1] if msg[0] == "resend" else out_name, held)
        if reply[0] == "ok":
            held = None
        conn.send(reply)
