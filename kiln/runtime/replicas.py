"""DataParallel: one replica of a compiled model per kiln core, in worker processes.

Threads in one process would serialise on the GIL around every call; worker
processes pinned to their cores run truly in parallel. Each replica is a
spawned process whose CPU affinity is its core's CPUs and whose engines use
one thread per CPU. A batch is scattered along ``dim`` into chunks, chunks are
handed to whichever replica is free, and results are gathered in order.

Tensors cross processes through shared memory, never pickled: every replica
has an input and an output segment (``multiprocessing.shared_memory``, grown
on demand) and only shapes, dtypes and offsets travel over its pipe. Outputs
are copied out of the segment once, since it is reused by the next call.

A replica that dies fails the calls it held with ``WorkerDiedError`` and is
restarted; the child holds the only other end of its socket, so its death is
an end-of-file the parent sees at once and no call waits forever on a dead
worker. ``timeout=`` also bounds a hung one.
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import weakref
from concurrent.futures import Future
from multiprocessing import connection

import torch

from kiln.host import cores
from kiln.artifact import specs
from kiln.errors import InputError, KilnError, PlacementError, WorkerDiedError
from kiln.host import child
from kiln.runtime.replica_worker import Segment, layout, view, write
from kiln.runtime.model import Model

log = logging.getLogger("kiln")
# Not passed on to a worker: it gets its cores as arguments, and the parent profiles.
_CORE_ENV = ("KILN_VISIBLE_CORES", "KILN_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES",
             "KILN_PROFILE")


# -- the parent's view of one replica -----------------------------------------------------------------
class _Replica:
    def __init__(self, index, core, artifact_path, dynamic_batching, timeout, start_timeout):
        self.index, self.core = index, core
        self._args = (artifact_path, core.cpus, dynamic_batching)
        self.timeout, self.start_timeout = timeout, start_timeout
        self.restarts = 0
        self.proc = self.conn = None
        self.inp = Segment(1 << 20)
        self.out = Segment(1 << 20)
        self.start()

    def start(self):
        ours, theirs = socket.socketpair()
        path, cpus, dynamic = self._args
        config = json.dumps({"artifact": path, "cpus": list(cpus), "dynamic_batching": dynamic})
        # the replica owns its core (no core selection inside it) and does not write the
        # parent's KILN_PROFILE file over it at exit
        env = child.environment({k: v for k, v in os.environ.items() if k not in _CORE_ENV})
        self.proc = subprocess.Popen(
            child.python("from kiln.runtime.replica_worker import worker_entry; worker_entry()",
                         theirs.fileno(), config), pass_fds=[theirs.fileno()], env=env)
        theirs.close()   # the child holds the only other end: its death is EOF here
        self.conn = connection.Connection(ours.detach())

    def wait_ready(self):
        msg = self._recv(self.start_timeout, "starting")
        if msg[0] == "failed":
            raise KilnError(f"DataParallel replica {self.index} on {self.core} could not load the "
                            f"model: {msg[1]}")

    def _recv(self, timeout, doing):
        if connection.wait([self.conn], timeout):
            try:
                return self.conn.recv()
            except (EOFError, OSError):
                pass
        else:
            self.kill()
            raise WorkerDiedError(f"DataParallel replica {self.index} on {self.core} did not answer "
                                  f"within {timeout}s while {doing}; it was killed and is restarted")
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        raise WorkerDiedError(f"DataParallel replica {self.index} on {self.core} (pid {self.proc.pid}) "
                              f"died with exit code {code} while {doing}; it is restarted")

    def run(self, flat):
        meta, size = layout(flat)
        shm = self.inp.ensure(size)
        write(shm.buf, flat, meta)
        try:
            self.conn.send(("run", shm.name, meta, self.out.shm.name))
        except OSError:
            self._recv(1, "taking a call")   # raises WorkerDiedError
        msg = self._recv(self.timeout, "running a call")
        if msg[0] == "grow":
            self.conn.send(("resend", self.out.ensure(msg[1]).name))
            msg = self._recv(self.timeout, "returning outputs")
        if msg[0] == "error":
            if msg[1] == "InputError":
                raise InputError(msg[2])
            raise KilnError(f"replica {self.index}: {msg[1]}: {msg[2]}")
        return [t.clone() for t in view(self.out.shm.buf, msg[1])]

    def restart(self):
        self.kill()
        self.restarts += 1
        self.start()
        self.wait_ready()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.conn.send(("stop",))
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.inp.close()
        self.out.close()


# -- DataParallel ------------------------------------------------------------------------------------
def _count(value) -> bool:
    """Whether ``value`` is a whole number of 1 or more (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_settings(device_ids, dim, dynamic_batching, num_workers) -> list | None:
    """DataParallel's settings, checked before any replica starts (each wrong one was a raw
    error at the first call, device_ids=[] a ZeroDivisionError, or was silently read otherwise);
    returns ``device_ids`` as a list (None: every visible core)."""
    if device_ids is not None:
        if isinstance(device_ids, (int, str, bytes)) or not hasattr(device_ids, "__iter__"):
            raise PlacementError(f"DataParallel: device_ids={device_ids!r} is not a list of kiln core numbers; "
                                 f"pass e.g. [0, 1], or None for every visible core")
        device_ids = list(device_ids)
        if not device_ids:
            raise PlacementError(f"DataParallel: device_ids={device_ids!r} names no core, so no replica would run "
                                 f"the calls; pass kiln core numbers such as [0, 1] (this process sees "
                                 f"{len(cores.visible())}), or None for every visible core")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise KilnError(f"DataParallel: dim={dim!r} ({type(dim).__name__}): expected the number of the "
                        "batch dimension to scatter, such as 0")
    if not isinstance(dynamic_batching, bool):
        raise KilnError(f"DataParallel: dynamic_batching (torch_neuronx: set_dynamic_batching) = "
                        f"{dynamic_batching!r} ({type(dynamic_batching).__name__}): expected True or False")
    if num_workers is not None and not _count(num_workers):
        raise PlacementError(f"DataParallel: num_workers={num_workers!r}: expected a number of replica "
                             "processes, 1 or more, or None for one per core")
    return device_ids


class DataParallel(Model):
    """Run ``module`` (a kiln model, or a path to one) on several kiln cores at once.

    ``device_ids``: kiln core numbers (default: all visible cores). ``dim``: the
    batch dim to scatter. ``dynamic_batching``: chunks of any size (dim 0
    only); off, chunks must be the compiled batch size. ``num_workers``:
    replica processes (default one per core; more share cores round-robin).
    ``split_size``: rows per chunk (default: the batch spread evenly over the
    replicas). ``timeout``: seconds a call may take before its replica is
    killed and restarted (default: no limit; a dead replica is always noticed).
    """

    def __init__(self, module, device_ids=None, dim=0, dynamic_batching=True, num_workers=None,
                 split_size=None, timeout=None, start_timeout=300.0):
        super().__init__()
        device_ids = _check_settings(device_ids, dim, dynamic_batching, num_workers)
        if isinstance(module, (str, os.PathLike, bytes)):
            from kiln.runtime.loader import load
            module = load(module)
        if not isinstance(module, Model) or isinstance(module, DataParallel):
            raise KilnError(f"DataParallel takes a kiln model (kiln.trace / kiln.load; kiln.neuronx.DataParallel "
                            f"also takes torch.jit.load's), got {type(module).__name__}")
        if dynamic_batching and dim != 0:    # as Neuron's DataParallel: no dynamic batching off dim 0
            log.warning("DataParallel: dynamic batching splits dim 0 only, so with dim=%d it is off "
                        "(set_dynamic_batching=False / dynamic_batching=False says so): each chunk must "
                        "be the compiled size along dim %d", dim, dim)
            dynamic_batching = False
        self.module = module
        self.dim = dim
        self.dynamic_batching = dynamic_batching
        self.split_size = split_size
        visible = cores.visible()
        ids = list(range(len(visible))) if device_ids is None else list(device_ids)
        self.cores = [cores.get(i) for i in ids]
        n = num_workers or len(self.cores)
        self.manifest = module.manifest
        self.arg_names = getattr(module, "arg_names", None)
        self.input_specs, self.output_specs = module.input_specs, module.output_specs
        self.input_structure, self.output_structure = module.input_structure, module.output_structure
        lead = self.input_specs[0].shape
        self.batch_size = lead[dim] if len(lead) > dim else 1
        # which inputs are split and which outputs gathered: those with the compiled batch on
        # ``dim`` (others, such as a bias every row shares, go whole to every replica)
        from kiln.runtime.buckets import DynamicBatch, with_batch_dim
        self._batched_in = with_batch_dim(self.input_specs, self.batch_size, dim)
        self._batched_out = with_batch_dim(self.output_specs, self.batch_size, dim)
        # which outputs are joined from the chunks: the trace-time proof that splitting along dim 0 gives
        # the model's answers (kiln.runtime.synthetic_rows.proven_rows), never a call's rows. Without it
        # (None; ``_why`` says why) a batch is not split: one of the compiled size runs whole on one replica
        try:
            self._checker = module if isinstance(module, DynamicBatch) else DynamicBatch(module, track=False)
            self._follows, self._why = self._checker._follows, self._checker._why
        except KilnError as e:      # no batch dim to split, or one bucketed already
            self._checker, self._follows, self._why = None, None, str(e)
        if dim != 0:
            self._follows, self._why = None, (f"the trace-time proof is along dim 0, and DataParallel splits "
                                              f"dim {dim}")

        self._dir = tempfile.mkdtemp(prefix="kiln-dp-")
        path = os.path.join(self._dir, "model.kiln")
        with open(path, "wb") as f:
            f.write(module.to_bytes())
        self._tasks: queue.Queue = queue.Queue()
        self._completed, self._count_lock = 0, threading.Lock()
        self._closed = True
        self.replicas: list = []
        try:
            for i in range(n):
                self.replicas.append(_Replica(i, self.cores[i % len(self.cores)], path,
                                              dynamic_batching, timeout, start_timeout))
            for r in self.replicas:   # started together, loading in parallel
                r.wait_ready()
        except BaseException:
            DataParallel._shutdown(self.replicas, self._dir, None)
            raise
        self._closed = False
        self._threads = [threading.Thread(target=self._dispatch, args=(r,), daemon=True,
                                          name=f"kiln-dp-dispatch{r.index}") for r in self.replicas]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, DataParallel._shutdown, self.replicas, self._dir,
                                           self._tasks)
        atexit.register(self._finalizer)

    @property
    def num_workers(self) -> int:
        return len(self.replicas)

    @property
    def split_size(self):
        """Rows per chunk (None: the batch spread evenly over the replicas); checked when set."""
        return self.__dict__.get("_split_size")

    @split_size.setter
    def split_size(self, value):
        if value is not None and not _count(value):
            raise KilnError(f"DataParallel: split_size={value!r} ({type(value).__name__}): expected a "
                            "number of rows per chunk, 1 or more, or None to spread each batch evenly "
                            "over the replicas")
        self.__dict__["_split_size"] = value

    @property
    def worker_pids(self) -> list:
        return [r.proc.pid for r in self.replicas]

    def disable_dynamic_batching(self):
        """Neuron's spelling: chunks must then be exactly the compiled batch size.
        (Replicas accept that either way; only the scattering changes.)"""
        self.dynamic_batching = False
        return self

    # -- scheduling -------------------------------------------------------------------------
    def _dispatch(self, replica):
        while True:
            task = self._tasks.get()
            if task is None:
                self._tasks.put(None)   # let the other dispatchers see it too
                return
            flat, fut = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = replica.run(flat)
            except WorkerDiedError as e:
                fut.set_exception(e)
                try:
                    replica.restart()
                except BaseException as e2:  # noqa: B036 - this replica stays down
                    log.error("DataParallel replica %d could not restart: %s", replica.index, e2)
                    return
                continue
            except BaseException as e:  # noqa: B036 - the call's own error
                fut.set_exception(e)
                continue
            with self._count_lock:
                self._completed += 1
            fut.set_result(result)

    def _chunks(self, flat):
        batched = [b and t.dim() > self.dim for t, b in zip(flat, self._batched_in)]
        sizes = {t.shape[self.dim] for t, b in zip(flat, batched) if b}
        if len(sizes) > 1:
            raise InputError(f"DataParallel: inputs disagree on the batch size along dim {self.dim}: "
                             f"{sorted(sizes)}")
        n = sizes.pop() if sizes else 1
        if n == 0:      # no chunk to scatter, so nothing would ever answer the call
            raise InputError(f"DataParallel: the batch is empty (size 0 along dim {self.dim})")
        if self._follows is None:
            if n == self.batch_size:     # the compiled batch runs whole on one replica, unsplit
                return [list(flat)]
            raise InputError(f"DataParallel: a batch of {n} along dim {self.dim} would be split into chunks, and "
                             f"that is not proven to give the model's answers: {self._why}. Call with the "
                             f"compiled {self.batch_size}, or trace with kiln.trace(..., dynamic_batch=True) "
                             "(torch_neuron: dynamic_batch_size=True), which checks the model against eager; a "
                             "model that mixes rows must be compiled at each batch size you need")
        if self.dynamic_batching:
            self._checker.check(flat)
            # chunks of a multiple of the rows the trace-time check ran at (a model of row pairs
            # takes even counts only): so is the last, since the call's count is one
            step = self._checker._multiple
            split = self.split_size or step * max(1, math.ceil(n / (len(self.replicas) * step)))
            if split % step:
                raise InputError(f"DataParallel: split_size={split}, but this model takes only multiples of "
                                 f"{step} rows (kiln.trace checked it against eager at such a count); set "
                                 f"split_size to a multiple of {step}, or leave it None")
        else:
            split = self.split_size or self.batch_size
            if n % split or split != self.batch_size:
                raise InputError(
                    f"DataParallel without dynamic batching needs batches that split into the "
                    f"compiled batch size {self.batch_size} along dim {self.dim}; got {n}")
        count = math.ceil(n / split)
        pieces = [t.split(split, self.dim) if b else None for t, b in zip(flat, batched)]
        chunks = [[p[k] if p is not None else t for p, t in zip(pieces, flat)] for k in range(count)]
        return chunks

    def _scatter(self, flat) -> Future:
        if self._closed:
            raise KilnError("DataParallel is closed")
        chunks = self._chunks(flat)
        outer: Future = Future()
        results = [None] * len(chunks)
        remaining = [len(chunks)]
        lock = threading.Lock()

        def done(k, fut):
            err = fut.exception()
            with lock:
                if outer.done():
                    return
                if err is not None:
                    outer.set_exception(err)
                    return
                results[k] = fut.result()
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                outer.set_result(self._gather(results))
            except BaseException as e:  # noqa: B036
                outer.set_exception(e)

        for k, chunk in enumerate(chunks):
            fut: Future = Future()
            fut.add_done_callback(lambda f, k=k: done(k, f))
            self._tasks.put((chunk, fut))
        return outer

    def _gather(self, results):
        if len(results) == 1:
            return results[0]
        return [torch.cat([r[o] for r in results], self.dim) if batched else results[0][o]
                for o, batched in enumerate(self._follows)]

    # -- the Model interface --------------------------------------------------------------------
    def flatten(self, args, kwargs):
        return self.module.flatten(args, kwargs)

    def check(self, flat):
        self._chunks(flat)

    def run_flat(self, flat):
        return self._scatter(flat).result()

    def submit(self, *args, **kwargs) -> Future:
        """Scatter a call without waiting; its result comes back on the Future."""
        fut: Future = Future()
        try:
            inner = self._scatter(self.flatten(args, kwargs))
        except KilnError as e:
            fut.set_exception(e)
            return fut

        def decode(f):
            if f.exception() is not None:
                fut.set_exception(f.exception())
            else:
                fut.set_result(specs.decode(self.output_structure, f.result()))
        inner.add_done_callback(decode)
        return fut

    def to_bytes(self) -> bytes:
        return self.module.to_bytes()

    def _place(self, core, worker=None):
        raise KilnError("DataParallel places its replicas itself; choose cores with device_ids=")

    @property
    def calls(self) -> int:
        """Chunks completed by the replicas."""
        return self._completed

    # -- lifetime ------------------------------------------------------------------------------
    def close(self):
        """Stop the replica processes and free their shared memory."""
        if not self.__dict__.get("_closed", True):
            self._closed = True
            self._finalizer()

    @staticmethod
    def _shutdown(replicas, directory, tasks):
        if tasks is not None:
            tasks.put(None)
        for r in replicas:
            r.close()
        shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        where = ", ".join(f"{r.index}: core {r.core.id} CPUs {cores.format_cpus(r.core.cpus)}"
                          for r in self.replicas)
        return f"kiln.DataParallel({self.module.name}; replicas {where})"
