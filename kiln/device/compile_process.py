"""The device's background compiles, in a process of their own.

A program compiled in the background (:mod:`kiln.device.trace`) used to compile on a
thread of the training process, which made it unsafe to leave on by default:

* ``torch.export`` sets the flag behind ``torch.compiler.is_compiling()`` for the whole
  process, so the training thread, running the program op by op meanwhile, saw it too:
  AdamW then took its compile path (step sizes as one tensor) and recorded another
  program, and Hugging Face models ask the same question.
* A process ending while a compile ran waited for it, and Inductor cannot start its
  worker pool once the interpreter shuts down, so such a compile failed.

Here the capture, the engines' builds and the check against eager run in one child
process (``python -m kiln.device.compile_process DIR``), started at the first background
compile and kept for the next ones, so its imports are paid once (about 2-3 s). What
travels, all in a private temporary directory (mode 0700) made at the first
compile and removed at exit:

* each request as a pickle this process writes and its own child reads: the program's FX
  graph, copies of its inputs, its name and ``kiln.trace`` options, and this process's
  ``KILN_*`` settings at the time (the compile cache, threads), which the child takes on;
* each answer as a ``.kiln`` file the child saves and this process loads with
  ``trust_native_code=True`` (an Inductor library compiled by this process's own child is
  trusted as far as one compiled in-process is), and a JSON line on the child's stdout
  saying how it went (a cache hit, the warnings it raised, or the error).

The child shares the cores with the training loop, which may step on while it compiles:
its threads yield when idle instead of busy-waiting (OpenMP's ``OMP_WAIT_POLICY=PASSIVE``,
unless the user set it, and the engines' own pools: :func:`kiln.runtime.options.yield_threads`).
With them spinning, two threads on the one core the loop left free made a BERT-4L step's
NaN probes and timings 5-10x as long: its partitions took 183 s to compile against 39 s
(11-29, 2 cores, ``benchmarks/train.py --keep-stepping``).

The child compiles one program at a time, as the compile thread did. At exit the child is
killed, not waited for: the compile cache's writes are atomic, so a compile cut short
leaves no entry, and the next run compiles that program again. A child that dies (killed,
out of memory) fails the compile under way with its stderr's last lines; the program
keeps running op by op, and the next compile starts a new child.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

from kiln.host import child


class ChildError(RuntimeError):
    """The compile process failed or died; the message says how."""


class Unpicklable(ChildError):
    """The request cannot be pickled for the child (the caller compiles in-process)."""


class Closed(ChildError):
    """The compile process was stopped by :meth:`CompileProcess.close` (the training process
    is exiting) while a compile waited on it: nothing failed, and nothing is left to run
    the program."""


class CompileProcess:
    """One child process compiling device programs, one request at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        # made at the first compile (programs loaded from it may keep their files open:
        # removed at exit, not before)
        self._dir = None
        self._count = 0
        self._owner = os.getpid()
        self._closed = False
        # at exit, before Python joins the compile thread waiting on the child (threading's
        # exit hooks run last-registered first, and before threads are joined)
        register = getattr(threading, "_register_atexit", atexit.register)
        try:
            register(self.close)
        except RuntimeError:
            # threading refuses once the interpreter is exiting: a compile asked for by a
            # step's last flush as the script ended, on the compile thread, which Python
            # joins. Nothing would stop a child started now or remove its directory (one
            # left in the temporary folder per such run): none is started.
            self._closed = True

    def compile(self, gm, examples, name: str, options: dict) -> dict:
        """Compile ``gm`` on ``examples`` in the child: ``{"path", "hit", "warnings"}`` on
        success (the ``.kiln`` file to load), ``{"error", "kiln_error"}`` when kiln refused
        the graph; raises :class:`ChildError` when the child itself failed."""
        with self._lock:
            if self._closed:       # asked for after the exit hook ran: no child that nothing would stop
                raise Closed("the process is exiting")
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="kiln-device-compile-")
            proc = self._start()
            self._count += 1
            request = os.path.join(self._dir, f"request-{self._count}.pkl")
            # kiln's settings as they are now (the cache, threads...), not as at the child's start
            settings = {k: v for k, v in os.environ.items() if k.startswith("KILN_")}
            try:
                with open(request, "wb") as f:
                    pickle.dump((gm, list(examples), name, dict(options), settings), f,
                                protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                _remove(request)
                raise Unpicklable(f"{type(e).__name__}: {e}") from e
            try:
                proc.stdin.write(f"{self._count}\n".encode())
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = b""
            finally:
                _remove(request)
            if not line:
                if self._closed:
                    raise Closed("the process is exiting")
                why = _tail(self._log())
                self._stop()
                raise ChildError(f"the compile process ended ({why})")
            try:
                return json.loads(line)
            except ValueError:
                self._stop()
                raise ChildError(f"the compile process answered {line[:200]!r}") from None

    def _start(self):
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        env = child.environment()
        # it shares the cores with a training loop that may step on: its OpenMP threads
        # sleep when idle instead of spinning (read once, at start; a user's setting stands)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with open(self._log(), "wb") as log:
            self._proc = subprocess.Popen(child.module("kiln.device.compile_process", self._dir),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        return self._proc

    def _log(self) -> str:
        return os.path.join(self._dir, "child.log")

    def _stop(self):
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:          # a request the dead child never read: nothing to flush to
                    pass

    def close(self):
        """Kill the child (a compile under way is abandoned) and remove its files; in the
        process that started it only. A forked copy of that process runs this too as it
        exits (multiprocessing's fork children run threading's exit hooks: a DataLoader's
        workers, OpenVINO's telemetry, which forks at ``import openvino``), and killed the
        compile process and removed its directory from under the parent, whose next compile
        failed (a bf16 step's Inductor upgrade: "No such file or directory: request-2.pkl")."""
        if os.getpid() != self._owner:
            return
        self._closed = True      # a compile waiting on the child now ends quietly (Closed)
        self._stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _remove(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _tail(path, lines: int = 8) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read()[-4000:].decode(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "it printed nothing"


_SHARED: list = []
_SHARED_LOCK = threading.Lock()


def shared() -> CompileProcess:
    """The process's one compile process (started at its first request)."""
    with _SHARED_LOCK:
        if not _SHARED or _SHARED[0]._owner != os.getpid():    # a forked copy starts its own
            _SHARED[:] = [CompileProcess()]
        return _SHARED[0]


def _serve(directory: str) -> int:
    """The child: compile each request named on stdin, answer on stdout."""
    # answers go to the pipe on a descriptor of their own; anything else written to stdout,
    # by Python or by an engine's native code, goes to the log with stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from kiln.compiler.api import trace
    from kiln.errors import KilnError
    from kiln.runtime.options import yield_threads
    yield_threads()          # the engines' threads too (see _start)
    for line in sys.stdin.buffer:
        n = int(line)
        with open(os.path.join(directory, f"request-{n}.pkl"), "rb") as f:
            gm, examples, name, options, settings = pickle.load(f)      # written by our parent
        for key in [k for k in os.environ if k.startswith("KILN_") and k not in settings]:
            del os.environ[key]
        os.environ.update(settings)
        path = os.path.join(directory, f"program-{n}.kiln")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                compiled = trace(gm, tuple(examples), name=name, quiet=True, **options)
                compiled.save(path)
                answer = {"path": path, "hit": bool(compiled.manifest.get("cache", {}).get("hit"))}
            except KilnError as e:
                answer = {"error": str(e), "kiln_error": True}
            except Exception as e:  # noqa: BLE001 - torch failing on the graph: reported, never a crash
                answer = {"error": f"{type(e).__name__}: {e}", "kiln_error": False}
        answer["warnings"] = [[w.category.__name__, str(w.message)] for w in caught]
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1]))
