"""Which processes on this host are running kiln models: a registry of heartbeat files.

neuron-ls and neuron-top can ask the driver who holds a device; kiln runs on
plain CPUs, so processes announce themselves instead. The first kiln model a
process loads calls :func:`announce` (the runtime does, through
``kiln.observe.announce_model``; importing kiln or building a model's counters
does not), which starts a daemon thread that, every ``KILN_HEARTBEAT_S`` seconds
(default 1), atomically rewrites ``<run dir>/kiln-<pid>.json`` with the process's
model counters (``kiln.metrics()``), its memory and a timestamp. The file is
removed at exit.

Readers (``kiln ls``, ``kiln monitor``, ``kiln top``) trust an entry only if
its process is alive with the same start time (so a recycled pid is not
mistaken for it) and its heartbeat is recent; anything else, such as the file
of a process killed with SIGKILL, is deleted on sight. So stale entries
never show up, and nothing has to clean up after a crash. Only kiln's own files
are ever read or deleted: a name ``kiln-<pid>.json`` whose content is a heartbeat
of that pid (``--run-dir .`` once deleted every ``*.json`` in the directory, a
project's ``package.json`` included); anything else there is left alone.

The run directory is ``KILN_RUN_DIR``, else ``$XDG_RUNTIME_DIR/kiln``, else
``<tmp>/kiln-<uid>``. ``KILN_REGISTRY=off`` keeps a process out of it.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import re
import sys
import tempfile
import threading
import time

from kiln.observe.metrics import metrics
from kiln import config

_lock = threading.Lock()
_thread: threading.Thread | None = None
_stop = threading.Event()
_path: str | None = None
_NAME = re.compile(r"kiln-([0-9]+)\.json")


def run_dir() -> str:
    d = config.get("KILN_RUN_DIR")
    if not d:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        d = os.path.join(xdg, "kiln") if xdg and os.path.isdir(xdg) else \
            os.path.join(tempfile.gettempdir(), f"kiln-{os.getuid()}")
    return d


def period() -> float:
    try:
        return max(0.05, float(config.get("KILN_HEARTBEAT_S")))
    except ValueError:
        return 1.0


def _enabled() -> bool:
    return config.get("KILN_REGISTRY").lower() not in ("off", "0", "false", "no")


def announce():
    """Start this process's heartbeat (once); called when a model is loaded."""
    global _thread, _path
    if _thread is not None or not _enabled():
        return
    with _lock:
        if _thread is not None:
            return
        d = run_dir()
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError:
            return   # no writable run dir: the process simply does not show up
        _path = os.path.join(d, entry_name(os.getpid()))
        _thread = threading.Thread(target=_beat, name="kiln-heartbeat", daemon=True)
        _thread.start()
        atexit.register(_withdraw)


def _record() -> dict:
    import psutil
    proc = psutil.Process()
    m = metrics()
    return {
        "pid": os.getpid(),
        "create_time": proc.create_time(),
        "cmd": " ".join(sys.argv)[:300] or sys.executable,
        "tag": config.get("KILN_PROCESS_TAG"),
        "heartbeat": time.time(),
        "period": period(),
        "memory_rss_bytes": proc.memory_info().rss,
        "cpu_seconds": round(sum(proc.cpu_times()[:2]), 3),
        "models": m["models"],
        "compile_cache": m["compile_cache"],
    }


def _write(path: str, record: dict):
    tmp = f"{path}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def beat():
    """Write this process's entry now (the heartbeat thread does it every period)."""
    if _path is not None:
        try:
            _write(_path, _record())
        except Exception:  # noqa: BLE001 - observability must never break the model
            pass


def _beat():
    while not _stop.is_set():
        beat()
        _stop.wait(period())


def _withdraw():
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2)   # a beat in flight would re-create the file after the unlink
    if _path is not None:
        try:
            os.unlink(_path)
        except OSError:
            pass


def entry_name(pid: int) -> str:
    """The file name of a process's heartbeat in the run directory."""
    return f"kiln-{pid}.json"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_heartbeat(name: str, entry) -> bool:
    """Whether ``entry`` (the JSON of file ``name``) is a heartbeat kiln wrote: its own
    name and schema, the pid of the name. Anything else is not kiln's, never read or removed."""
    m = _NAME.fullmatch(name)
    return (m is not None and isinstance(entry, dict) and type(entry.get("pid")) is int
            and entry["pid"] == int(m.group(1))
            and all(_number(entry.get(k)) for k in ("create_time", "heartbeat", "period"))
            and entry["period"] > 0 and isinstance(entry.get("models", []), list)
            and all(isinstance(x, dict) for x in entry.get("models", [])))


def _alive(entry: dict) -> bool:
    import psutil
    try:
        proc = psutil.Process(int(entry["pid"]))
        return abs(proc.create_time() - float(entry["create_time"])) < 1.0 and \
            proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def processes(directory: str | None = None, now: float | None = None) -> list[dict]:
    """Live kiln processes on this host, by pid; stale heartbeats are removed (only
    kiln's own: see :func:`_is_heartbeat`; other files in the directory are ignored)."""
    d = directory or run_dir()
    try:
        names = sorted(n for n in os.listdir(d) if _NAME.fullmatch(n))
    except OSError:
        return []
    now = time.time() if now is None else now
    out = []
    for name in names:
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue   # vanished between listdir and open, or not JSON: not ours to judge
        if not _is_heartbeat(name, entry):
            continue   # someone else's file that happens to have the name: left alone
        limit = 3 * float(entry["period"]) + 5.0
        if not _alive(entry) or now - float(entry["heartbeat"]) > limit:
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        out.append(entry)
    return sorted(out, key=lambda e: e["pid"])


def top_level(entry: dict) -> list[dict]:
    """The models a user loaded (bucket variants are folded into their bucketed model)."""
    return [m for m in entry.get("models", []) if m.get("parent") is None]
