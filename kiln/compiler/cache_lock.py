"""One compile per key across processes and machines: the compile cache's locks.

``locks/<key>.lock`` under the cache root holds a JSON record of its holder (a random
token, the time, host, pid, the pid's start time and pid namespace). A local directory
takes it with an exclusive create; an object store, which has no such primitive everywhere,
with a token written, waited on and read back (the last writer wins, everyone agrees). The
holder refreshes it every LOCK_REFRESH_SECONDS and removes it when done, whatever else
failed. A waiter says whom it waits for (a warning, and the live progress line on a
terminal) and breaks the lock when it is not refreshed for LOCK_STALE_SECONDS, or at once
when the holder ran on this host, in this pid namespace, and is gone. (The pid's start time
tells a reused pid; without /proc, a pid reused by a live process makes a waiter wait for the
stale timeout, no worse than before.)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid

from kiln.progress import Progress

log = logging.getLogger("kiln")

LOCK_STALE_SECONDS = 60.0  # a lock not refreshed for this long belongs to a dead process
LOCK_REFRESH_SECONDS = 10.0


class CompileLocks:
    """The lock methods of :class:`kiln.compiler.cache.Cache` (which provides ``fs``, ``local``,
    ``failures``, ``broken``, ``unusable``, ``count``, ``_path``, ``_remove`` and ``_rm``)."""

    stale_seconds = LOCK_STALE_SECONDS

    @contextlib.contextmanager
    def lock(self, key, wait_for=None, poll=0.25, progress=None):
        """Hold the compile lock of ``key``; while another process holds it, poll
        ``wait_for()`` (e.g. "is the entry there now?") and return its result early. A wait
        shows on ``progress`` (the compile's own line, quiet when the compile is).

        Local directories use an exclusive create; object stores, which have no
        such primitive everywhere, write a random token, wait, and read it back:
        the last writer wins and everyone agrees who that was. A holder refreshes
        its lock and removes it when done, whatever failed meanwhile; a lock not refreshed for
        stale_seconds is broken, and so at once is one whose holder ran on this host
        (and pid namespace) and is gone."""
        path = self._path("locks", f"{key}.lock")
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        held, result = self._acquire(path, token, key, wait_for, poll, progress)
        if not held:
            yield result
            return
        stop = threading.Event()
        refresher = threading.Thread(target=self._refresh, args=(path, token, stop), daemon=True)
        refresher.start()
        try:
            yield None
        finally:
            stop.set()
            refresher.join()
            self._release(path, token)

    def _acquire(self, path, token, key, wait_for, poll, progress=None):
        """(True, None) once the lock is ours, else (False, what ``wait_for()`` found, or None
        when there is no lock to be had and the caller compiles anyway, as without a cache)."""
        waited = False
        with contextlib.ExitStack() as waiting:
            while not self.broken:
                try:
                    self.fs.makedirs(self._path("locks"), exist_ok=True)
                    if self._try_lock(path, token):
                        return True, None
                except self.failures as e:
                    self.unusable("locking", e, "this graph compiles without the lock")
                    break
                if self._break_if_stale(path):
                    continue
                if not waited:      # the first wait: say whom for, and show it going on
                    waited = True
                    self.count("lock_waits")
                    what = f"waiting for another process compiling this graph ({_who(self._holder(path))})"
                    log.warning("kiln cache: %s, entry %s", what, key[:16])
                    waiting.enter_context((progress or Progress()).phase(what))
                result = wait_for() if wait_for else None
                if result is not None:
                    return False, result
                time.sleep(poll)
        return False, None

    def _lock_body(self, token):
        pid = os.getpid()
        return json.dumps({"token": token, "time": time.time(), "host": os.uname().nodename, "pid": pid,
                           "start": _proc_stat(pid)[1], "pidns": _pidns()}).encode()

    def _try_lock(self, path, token) -> bool:
        if self.local:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(self._lock_body(token))
            except OSError:          # a full disk: no empty lock left for others to wait on
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            return True
        if self.fs.exists(path):
            return False
        with self.fs.open(path, "wb") as f:
            f.write(self._lock_body(token))
        time.sleep(0.5)   # let concurrent writers land, then see who won
        return self._holder(path).get("token") == token

    def _holder(self, path) -> dict:
        """The lock's record (token, time, host, pid, ...); {} when absent or unreadable."""
        try:
            with self.fs.open(path, "rb") as f:
                holder = json.loads(f.read())
            return holder if isinstance(holder, dict) else {}
        except (ValueError, FileNotFoundError):
            return {}
        except self.failures as e:
            self.unusable("reading", e)
            return {}

    def _release(self, path, token):
        if self._holder(path).get("token") == token:      # not a lock taken after ours was broken
            error = self._remove(path)
            if error is not None:
                log.warning("kiln cache: could not remove the compile lock %s (%s); other processes "
                            "wait up to %.0f s for it", path, error, self.stale_seconds)

    def _refresh(self, path, token, stop):
        while not stop.wait(LOCK_REFRESH_SECONDS):
            try:
                if self.local:
                    os.utime(path)
                else:
                    with self.fs.open(path, "wb") as f:
                        f.write(self._lock_body(token))
            except self.failures:   # a store that went away: the compile goes on; others may break the lock
                pass

    def _break_if_stale(self, path) -> bool:
        """Remove the lock if its holder is gone or it is stale; whether it was removed."""
        holder = self._holder(path)
        if not holder and not self.fs.exists(path):
            return False
        try:
            stamp = os.path.getmtime(path) if self.local else float(holder["time"])
        except (ValueError, KeyError, TypeError, OSError):
            stamp = 0
        if _holder_gone(holder):
            log.warning("kiln cache: breaking the compile lock of %s, which is no longer running", _who(holder))
        elif time.time() - stamp > self.stale_seconds:
            log.warning("kiln cache: breaking a stale compile lock %s (%s)", path, _who(holder))
        else:
            return False
        if self._holder(path).get("token") != holder.get("token"):     # no longer the one judged
            return False
        self._rm(path)
        return not self.broken


def _proc_stat(pid):
    """(state, start time in clock ticks since boot) of a process from /proc, or (None, None)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), fields[19].decode()
    except (OSError, IndexError):
        return None, None


def _pidns():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _holder_gone(holder) -> bool:
    """The lock's holder ran on this host, in this pid namespace, and is gone: its pid is free, a
    zombie, or now a process started at another time (a reused pid). Other hosts: False."""
    pid = holder.get("pid")
    if (holder.get("host") != os.uname().nodename or holder.get("pidns") != _pidns()
            or not isinstance(pid, int) or pid <= 0):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:          # EPERM: alive, another user's
        return False
    state, start = _proc_stat(pid)
    return state == "Z" or (holder.get("start") is not None and start not in (None, holder["start"]))


def _who(holder) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
