"""Profiler timelines: a Chrome-trace / Perfetto JSON of what kiln ran.

    with kiln.profile("trace.json"):
        model(x)

or ``KILN_PROFILE=trace.json`` for a whole process (written at exit; recording
starts when the first model is loaded, not when kiln is imported). Every
call gets a span (model, core, bucket) and inside it a span per partition:
engine partitions in category ``device``, host fallback ops in ``host``, so a
hidden CPU fallback is a visible block on the timeline. Under
``torch.profiler`` the same spans appear as ``record_function`` ranges, so
kiln's work shows up inside PyTorch's own traces.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

from kiln import config

_active = None
_lock = threading.Lock()
_env_read = False
_env_recorder = None      # KILN_PROFILE's recorder, once started


class Recorder:
    def __init__(self, path):
        self.path = os.fspath(path)
        self.events: list = []
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def span(self, name, cat, start, end, args=None):
        ev = {"name": name, "cat": cat, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
              "pid": self.pid, "tid": threading.get_native_id()}
        if args:
            ev["args"] = args
        with self.lock:
            self.events.append(ev)

    def write(self):
        from kiln.atomic import write_atomic
        with self.lock:
            doc = {"traceEvents": list(self.events), "displayTimeUnit": "ms",
                   "otherData": {"producer": "kiln"}}
        data = json.dumps(doc).encode()
        write_atomic(self.path, lambda f: f.write(data))
        return self.path


def active():
    """The recorder in use, or None (the common case: one global read per call)."""
    return _active


def now() -> float:
    return time.perf_counter()


@contextlib.contextmanager
def profile(path):
    """Record kiln's spans while the block runs and write them to ``path``."""
    global _active
    rec = Recorder(path)
    with _lock:
        previous, _active = _active, rec
    try:
        yield rec
    finally:
        with _lock:
            _active = previous
        rec.write()


def start_from_env():
    """Record the whole process to ``KILN_PROFILE`` (once), written at exit; the runtime calls
    it when a model is loaded, as there is nothing to record before."""
    global _active, _env_read, _env_recorder
    if _env_read:
        return
    with _lock:
        if _env_read:
            return
        _env_read = True
        path = config.get("KILN_PROFILE")
        if path and _active is None:
            _active = _env_recorder = Recorder(path)
            atexit.register(_write_at_exit, _active)


def env_path_problem() -> str | None:
    """Why ``KILN_PROFILE`` could not be written, checked now as the write at exit would do
    it (its directory made if missing, a file created there and removed); None when it is
    unset or can be written. For a long-running process (``kiln serve``), which should refuse
    to start rather than lose its timeline at exit."""
    import tempfile
    path = config.get("KILN_PROFILE")
    if not path:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"KILN_PROFILE={path} is a directory; name a file such as {os.path.join(path, 'trace.json')}"
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kiln-profile-check-"):
            pass
    except OSError as e:
        return (f"KILN_PROFILE={path} cannot be written ({e.strerror or e}: {directory}); point it "
                "at a file in a writable directory, or unset it")
    return None


def write_env_profile() -> str | None:
    """Write ``KILN_PROFILE``'s recording now instead of at exit (``kiln serve`` does, so that
    its exit status can tell that the trace was lost); None, or what went wrong, in one line.
    After a success the write at exit still runs (it adds what is recorded later); after a
    failure it does not (the caller reports it, once)."""
    rec = _env_recorder
    if rec is None:
        return None
    try:
        rec.write()
    except OSError as e:
        atexit.unregister(_write_at_exit)
        return f"KILN_PROFILE={rec.path}: the trace was not written: {e.strerror or e}"
    return None


def _write_at_exit(rec):
    """KILN_PROFILE's write at exit: a path that cannot be written is a one-line warning naming
    it and why (it was a traceback from the atexit hook, and the exit status stayed 0)."""
    try:
        rec.write()
    except OSError as e:
        print(f"kiln: warning: KILN_PROFILE={rec.path}: the trace was not written: "
              f"{e.strerror or e}", file=sys.stderr, flush=True)


def torch_profiling() -> bool:
    """Whether torch.profiler is recording (then kiln adds record_function ranges)."""
    try:
        from torch.autograd.profiler import _is_profiler_enabled
        return bool(_is_profiler_enabled)
    except ImportError:
        return False
