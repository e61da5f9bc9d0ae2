"""The compile cache when things fail: full disks, read-only locations, dead lock holders, a
size cap below one entry, orphaned artifacts. Failures are simulated (monkeypatch), not made
with mounts or permissions, so these run unprivileged and as root alike."""
import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
import time

import fsspec.implementations.local
import pytest

import kiln
from kiln.cli.app import main as cli
from kiln.compiler import cache as cache_mod

from . import models

KEY = "k" * 64
STALE = 60.0      # kiln.compiler.cache_lock.LOCK_STALE_SECONDS


def _start_time(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[19].decode()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(cache_mod, "_warned", set())     # each test sees its own once-per-URL warnings


def _full_disk_for(monkeypatch, suffix):
    """Writes of files whose path ends with ``suffix`` fail as on a full disk."""
    write = cache_mod.Cache._write

    def failing(self, path, data):
        if path.endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, path, data)
    monkeypatch.setattr(cache_mod.Cache, "_write", failing)


def _lock_path(url, key=KEY):
    return os.path.join(url, "locks", f"{key}.lock")


# -- 1. a failed store leaves no partial entry and no lock ------------------------------------------------
def test_a_failed_meta_write_removes_the_artifact_and_releases_the_lock(tmp_path, monkeypatch, caplog):
    """A disk that fills between the artifact and its meta left artifact.kiln without meta (not
    listed, not counted, never pruned) and, since the failure marked the Cache broken, the compile
    lock too: the next process waited the stale timeout for a lock nobody held."""
    url = str(tmp_path / "cache")
    _full_disk_for(monkeypatch, "meta.json")
    store = cache_mod.Cache(url)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        with store.lock(KEY) as ready:
            assert ready is None
            assert store.store(KEY, b"x" * 1000, {"model_name": "m"}) is None
    assert not os.path.exists(os.path.join(url, "entries", KEY))
    assert not os.path.exists(_lock_path(url))
    assert "was not stored" in caplog.text and "neither reused nor kept" not in caplog.text


def test_a_failed_alias_write_keeps_the_entry_releases_the_lock_and_says_so(tmp_path, monkeypatch, caplog):
    url = str(tmp_path / "cache")
    _full_disk_for(monkeypatch, "fp.json")
    store = cache_mod.Cache(url)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        with store.lock(KEY):
            assert store.store(KEY, b"x" * 1000, {"model_name": "m"}) is not None
            store.set_alias("fp", KEY)
    assert cache_mod.Cache(url).lookup(KEY)[0] == "ok"
    assert not os.path.exists(_lock_path(url))
    assert "is stored but not the alias" in caplog.text and "neither reused nor kept" not in caplog.text


def test_a_trace_whose_store_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    url = str(tmp_path / "cache")
    _full_disk_for(monkeypatch, "meta.json")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, cache=url)
    assert compiled.manifest["cache"]["stored"] is False
    assert os.listdir(os.path.join(url, "entries")) == []
    assert os.listdir(os.path.join(url, "locks")) == []


def test_orphaned_artifacts_are_counted_and_pruned(tmp_path, kiln_cli_inproc):
    """An artifact without meta (a writer killed between the two, or an older kiln's failed
    store) was invisible to ls, the size cap and prune, so it stayed for good."""
    url = str(tmp_path / "cache")
    entry = os.path.join(url, "entries", KEY)
    os.makedirs(entry)
    with open(os.path.join(entry, "artifact.kiln"), "wb") as f:
        f.write(b"x" * 5000)
    old = time.time() - 2 * STALE
    os.utime(os.path.join(entry, "artifact.kiln"), (old, old))
    store = cache_mod.Cache(url)
    assert store.total_bytes() == 5000
    assert [e["status"] for e in store.entries(orphans=True)] == ["orphan"]
    rc, out, _ = kiln_cli_inproc("cache", "prune", "--url", url)
    assert rc == 0 and "removed 1 entry" in out
    assert not os.path.exists(entry)


def test_a_fresh_or_locked_entry_without_meta_is_no_orphan(tmp_path):
    """Another process may be between writing an artifact and its meta: that is left alone."""
    url = str(tmp_path / "cache")
    store = cache_mod.Cache(url, max_bytes=0)
    os.makedirs(os.path.join(url, "entries", KEY))
    with open(os.path.join(url, "entries", KEY, "artifact.kiln"), "wb") as f:
        f.write(b"x" * 10)                                      # fresh
    assert store.entries(orphans=True) == [] and store.evict() == []
    old = time.time() - 2 * STALE
    os.utime(os.path.join(url, "entries", KEY, "artifact.kiln"), (old, old))
    os.makedirs(os.path.join(url, "locks"))
    open(_lock_path(url), "w").close()                         # old, but its writer holds the lock
    assert store.entries(orphans=True) == []


# -- 2. kiln cache clear / prune on a location that refuses deletions --------------------------------------
@pytest.fixture
def kiln_cli_inproc(capsys):
    def run(*argv):
        rc = cli(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err
    return run


def _one_entry(url):
    store = cache_mod.Cache(url)
    store.store(KEY, b"x" * 100, {"model_name": "m"})
    return store


@pytest.mark.parametrize("argv", [["clear"], ["prune", "--max-bytes", "0"]])
def test_clear_and_prune_on_a_read_only_location_fail_with_the_reason(tmp_path, monkeypatch, kiln_cli_inproc,
                                                                      argv):
    """They printed "cleared 1 entries" / "removed 1 entry" and exited 0 with the entry still there."""
    url = str(tmp_path / "cache")
    _one_entry(url)

    def read_only(self, path, recursive=False, maxdepth=None):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "rm", read_only)
    rc, out, err = kiln_cli_inproc("cache", *argv, "--url", url)
    assert rc == 2 and "Read-only file system" in err
    assert "removed 0 of 1 entries" in out and "cleared 1" not in out and "removed 1" not in out
    assert cache_mod.Cache(url).lookup(KEY)[0] == "ok"


def test_prune_with_a_bad_size_is_an_error_not_a_traceback(tmp_path, kiln_cli_inproc):
    rc, _, err = kiln_cli_inproc("cache", "prune", "--max-bytes", "1X", "--url", str(tmp_path))
    assert rc == 2 and "--max-bytes '1X': expected a size like" in err
    for bad in ("-5", "inf"):
        with pytest.raises(kiln.errors.CacheError, match="expected a size"):
            cache_mod.parse_max_bytes(bad, "x")


# -- 3. waiting on another process's lock ------------------------------------------------------------
def _holder_lock(url, pid, **changes):
    """A lock file as process ``pid`` on this host would have written it."""
    os.makedirs(os.path.join(url, "locks"), exist_ok=True)
    body = {"token": f"{pid}-x", "time": time.time(), "host": os.uname().nodename, "pid": pid,
            "start": _start_time(pid) if os.path.exists(f"/proc/{pid}") else None,
            "pidns": os.readlink("/proc/self/ns/pid")}
    with open(_lock_path(url), "w") as f:
        json.dump(dict(body, **changes), f)


def _gives_up_after(polls):
    """A wait_for that fails the test after ``polls`` polls instead of waiting the stale timeout."""
    seen = []

    def wait_for():
        seen.append(1)
        assert len(seen) < polls, "the lock was not broken"
        return None
    return wait_for


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()                              # reaped: the pid is free (or, rarely, reused: then alive)
    return p.pid


def test_a_lock_whose_holder_died_on_this_host_is_broken_at_once(tmp_path, monkeypatch):
    url = str(tmp_path / "cache")
    monkeypatch.setattr(cache_mod, "LOCK_STALE_SECONDS", 1e9, raising=False)    # (what the old code read)
    _holder_lock(url, _dead_pid())
    store = cache_mod.Cache(url)
    store.stale_seconds = 1e9
    with store.lock(KEY, wait_for=_gives_up_after(200), poll=0.01) as ready:
        assert ready is None
        assert json.load(open(_lock_path(url)))["pid"] == os.getpid()     # ours now
    assert not os.path.exists(_lock_path(url))


def test_a_reused_pid_does_not_keep_a_dead_holder_alive(tmp_path, monkeypatch):
    """The lock records its holder's start time: a live process with the same pid is another."""
    url = str(tmp_path / "cache")
    monkeypatch.setattr(cache_mod, "LOCK_STALE_SECONDS", 1e9, raising=False)
    _holder_lock(url, os.getpid(), start="1")
    store = cache_mod.Cache(url)
    store.stale_seconds = 1e9
    with store.lock(KEY, wait_for=_gives_up_after(200), poll=0.01) as ready:
        assert ready is None


@pytest.mark.parametrize("changes", [{}, {"host": "another-host"}, {"pidns": "pid:[1]"}])
def test_a_live_or_remote_holder_is_waited_for_and_named(tmp_path, caplog, changes):
    url = str(tmp_path / "cache")
    _holder_lock(url, os.getpid(), **changes)
    store = cache_mod.Cache(url)
    store.stale_seconds = 1e9
    polls = []

    def wait_for():
        polls.append(1)
        return "the other process's result" if len(polls) == 3 else None
    with caplog.at_level(logging.INFO, logger="kiln"):
        with store.lock(KEY, wait_for=wait_for, poll=0.01) as ready:
            assert ready == "the other process's result"
    assert os.path.exists(_lock_path(url))                      # not ours: left alone
    host = changes.get("host", os.uname().nodename)
    what = f"waiting for another process compiling this graph (pid {os.getpid()} on host {host})"
    assert [r.levelname for r in caplog.records if what in r.getMessage()][0] == "WARNING"
    assert any(r.getMessage().startswith(f"kiln: {what} took") for r in caplog.records)   # progress phase


def test_a_holder_releases_only_its_own_lock(tmp_path):
    """A holder whose lock was broken (and taken by another) leaves the new holder's lock alone."""
    url = str(tmp_path / "cache")
    store = cache_mod.Cache(url)
    with store.lock(KEY):
        os.unlink(_lock_path(url))
        _holder_lock(url, os.getpid(), token="another")
    assert json.load(open(_lock_path(url)))["token"] == "another"


# -- 5. a size cap smaller than one entry ------------------------------------------------------------
def test_a_cap_below_one_entry_is_reported_and_not_claimed_stored(tmp_path, caplog):
    url = str(tmp_path / "cache")
    store = cache_mod.Cache(url, max_bytes=10)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert store.store(KEY, b"x" * 100, {}) is None
        assert store.store("j" * 64, b"x" * 100, {}) is None
    assert store.entries() == []
    assert caplog.text.count("smaller than one entry") == 1


def test_a_trace_under_a_cap_below_one_entry_says_not_stored_and_writes_no_alias(tmp_path, monkeypatch):
    url = str(tmp_path / "cache")
    monkeypatch.setenv("KILN_CACHE_MAX_BYTES", "10k")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, cache=url)
    assert compiled.manifest["cache"]["stored"] is False
    assert os.listdir(os.path.join(url, "entries")) == []
    aliases = os.path.join(url, "aliases")
    assert not os.path.exists(aliases) or os.listdir(aliases) == []


def test_a_wait_shows_on_the_compiles_own_progress(tmp_path):
    """The wait is a phase of the compile's progress (quiet when ``kiln.trace(quiet=True)``),
    not a line of its own."""
    url = str(tmp_path / "cache")
    _holder_lock(url, os.getpid())
    store = cache_mod.Cache(url)
    store.stale_seconds = 1e9
    phases = []

    class Recorder:
        @contextlib.contextmanager
        def phase(self, name):
            phases.append(name)
            yield
    polls = []

    def wait_for():
        polls.append(1)
        return "done" if len(polls) == 2 else None
    with store.lock(KEY, wait_for=wait_for, poll=0.01, progress=Recorder()) as ready:
        assert ready == "done"
    assert phases == [f"waiting for another process compiling this graph (pid {os.getpid()} on host "
                      f"{os.uname().nodename})"]
