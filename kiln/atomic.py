"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Used for artifacts, cache entries, keys and profiles. Temp files carry the host and
pid so a later write can remove those of dead writers (see :func:`write_atomic`).
"""
from __future__ import annotations

import errno
import os
import re
import socket
import tempfile


def write_atomic(path: str, writer):
    """Call ``writer(file)`` on a temp file beside ``path``, fsync, then rename over ``path``
    (and fsync the directory, so the rename survives a power cut as well as a kill).

    A process killed mid-write leaves its temp file behind; temp names carry the host and
    pid, so the next write into the directory removes the files of this host's dead
    writers (never a live one's, nor another host's on a shared filesystem)."""
    if os.path.isdir(path):     # else os.replace's error, naming the temp file instead (until 12-03)
        raise IsADirectoryError(errno.EISDIR, f"{path} is a directory; give the path of a file to write "
                                f"(e.g. {os.path.join(path, 'model.kiln')})", path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    sweep_temps(directory)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def temp_prefix() -> str:
    return f".kiln-{socket.gethostname()}-{os.getpid()}-"


_TEMP = re.compile(r"^\.kiln-(?P<host>.*)-(?P<pid>\d+)-[^-]*\.tmp$")


def sweep_temps(directory: str) -> int:
    """Remove temp files left in ``directory`` by killed writers of this host; returns how many."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    host, removed = socket.gethostname(), 0
    for name in names:
        m = _TEMP.match(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's live process
        return True
    return True


def _fsync_dir(directory: str):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
