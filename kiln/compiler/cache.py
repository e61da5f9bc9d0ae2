"""The persistent compile cache: compile a graph once per machine type, share it with a fleet.

Storage is any fsspec URL (a local directory by default, ``s3://`` for a fleet,
``memory://`` in tests). Layout under the root::

    entries/<key>/artifact.kiln    the compiled artifact (absent for a cached failure)
    entries/<key>/meta.json        written last: model name, engine, size,
                                   created, last used, status ok|failed (+ error)
    aliases/<fingerprint>.json     fast lookup: model fingerprint -> key (a hint: an alias hit is
                                   served only if the entry's signed manifest records that
                                   fingerprint, see kiln.compiler.caching)
    locks/<key>.lock               held while one process compiles the key (cache_lock.py)

Two keys. The *key* of an entry hashes the canonical captured graph (op
targets, wiring, shapes, dtypes, literal arguments; no names, paths or source
locations), the weights' bytes, the compile options, the engines and their
versions, kiln's artifact format and the target ISA. Computing it needs
``torch.export``, seconds for a large model, so a trace first computes a
*fingerprint* without capturing: the source files (content, not path) of every
module class in the model, each module's non-tensor settings (``config``
objects, flags), the weights' bytes, the example inputs' specs and the same
options/engines/ISA. A fingerprint that was seen before names its key through
an alias; anything else captures, keys and compiles as usual.

An entry is valid only when its meta exists (written after the artifact), the
artifact has the recorded size, its signature (if any) verifies and every blob
matches its digest when the artifact is read; anything else is discarded and
recompiled. Entries are signed by the host that wrote them (``kiln.artifact.trust``); one
holding native code is loaded only if a key this host trusts signed it, and
otherwise left in place and compiled again here. A local entry is mapped, not
read, so a hit costs about what ``kiln.load`` does.
Writes go to a temporary name and are moved into place. One process compiles
a key at a time: the others wait for its result (see ``lock``).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import posixpath
import re
import time
import uuid

from kiln.atomic import sweep_temps, temp_prefix
from kiln.compiler.cache_lock import CompileLocks
from kiln.errors import CacheError
from kiln.observe.metrics import compile_cache
from kiln import config

log = logging.getLogger("kiln")


_warned: set = set()       # cache URLs already reported unusable (or with a cap below one entry) here

# Process-wide counters (also per Cache instance): they live in kiln.observe, which reports them
# and may not import the compiler; ``stats`` is that same dict, for readers.
stats = compile_cache.values


# -- names --------------------------------------------------------------------------------------
# Keys and fingerprints are kiln's own digests (64 hex digits from keys._hash_json); a name read
# from the store (an alias file, a listing) or given by a caller becomes one path component
# under entries/, locks/ or aliases/, so it is checked to be a plain name that cannot climb out
# (no separator, no dot: no "..", "/", "\\" or absolute path). Tests use other plain names.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def valid_name(name) -> bool:
    """Whether ``name`` can be a cache key or fingerprint (a plain path component)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name, what="key"):
    if not valid_name(name):
        raise CacheError(f"{name!r} is not a kiln cache {what} (kiln's keys are 64 hex digits)")
    return name


# -- where ----------------------------------------------------------------------------------
def default_url() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln")


def resolve_url(cache=None):
    """``cache=`` argument → URL, or None when the cache is off.

    None: ``KILN_CACHE_URL`` (``off`` disables), else the default directory.
    False: off. True: as None. A string: that URL or path."""
    if cache is False:
        return None
    if cache is None or cache is True:
        env = config.get("KILN_CACHE_URL")
        if env is not None:
            return None if env.strip().lower() in ("", "0", "off", "false", "none") else env
        return default_url()
    return os.fspath(cache)


def max_bytes_from_env():
    value = config.get("KILN_CACHE_MAX_BYTES")
    return parse_max_bytes(value, f"KILN_CACHE_MAX_BYTES={value!r}") if value else None


def parse_max_bytes(value, where: str) -> int:
    """A size cap (``KILN_CACHE_MAX_BYTES``, ``kiln cache prune --max-bytes``), or CacheError."""
    try:
        size = parse_size(value)
        if size >= 0:
            return size
    except (ValueError, OverflowError):
        pass
    raise CacheError(f"{where}: expected a size like 2000000000, 2G or 500M")


def parse_size(text) -> int:
    """``KILN_CACHE_MAX_BYTES`` and ``kiln cache evict --max-bytes``: decimal units (2G = 2e9)."""
    return config.parse_size(text)




# -- the store ----------------------------------------------------------------------------------------------
class Cache(CompileLocks):
    """One cache location. Safe to share between threads, processes and machines."""

    def __init__(self, url: str, max_bytes: int | None = None, strict: bool = False):
        import fsspec
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CacheError(f"cache {url!r}: {e}. Install the fsspec implementation for this URL "
                             "(s3fs for s3://) or pass cache=False") from None
        self.root = self.root.rstrip("/")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        # What a failing location raises: the OS's errors locally; an object store's client has
        # its own (botocore's EndpointConnectionError is no OSError), so there any error is one.
        self.failures = OSError if self.local else Exception
        self.broken = False       # set at the first failure: this Cache is then skipped (see unusable)
        self.strict = strict      # kiln cache: a failure raises CacheError instead, there is no fallback
        self.max_bytes = max_bytes if max_bytes is not None else max_bytes_from_env()
        self.stats = {k: 0 for k in stats}

    def __repr__(self):
        return f"kiln.compiler.cache.Cache({self.url!r})"

    def count(self, name):
        """Add one to this store's counter ``name`` and to the process's (``kiln.metrics()``)."""
        self.stats[name] += 1
        compile_cache.count(name)

    def unusable(self, doing: str, error: BaseException, outcome: str = "the lookup is a miss"):
        """The location failed an operation (not a directory, no permission, a full disk, an
        unreachable store). A cache only saves time, so the trace goes on without it: a
        read is a miss, a failed store removes what it wrote, and the compile runs without the
        lock. Warned once per location and process, with ``outcome``, what the failure cost. This
        object then stops using the location: an unreachable store costs a client's retries (a
        minute for S3), which every later read and write of the same trace would pay again; the
        next ``kiln.trace`` tries afresh. A ``strict`` Cache raises :class:`CacheError` instead."""
        self.count("errors")
        if self.strict:
            raise CacheError(f"cache {self.url!r}: {doing} failed: {type(error).__name__}: {error}") from None
        self.broken = True
        if self.url not in _warned:
            _warned.add(self.url)
            log.warning("kiln cache %s failed (%s: %s: %s): %s; kiln goes on without it for the rest "
                        "of this trace. Fix the location, point KILN_CACHE_URL (or cache=) elsewhere, or "
                        "turn the cache off with KILN_CACHE_URL=off (cache=False)",
                        self.url, doing, type(error).__name__, error, outcome)

    def check_usable(self):
        """Raise :class:`CacheError` if the location is not a directory that can be listed:
        for ``kiln cache``, which manages the location and has nothing to fall back on."""
        try:
            if self.fs.exists(self.root) and not self.fs.isdir(self.root):
                raise NotADirectoryError(f"{self.root} is a file, not a directory")
            self.fs.ls(self._path("entries"), detail=False)
        except FileNotFoundError:
            return
        except self.failures as e:
            raise CacheError(f"cache {self.url!r} cannot be read: {type(e).__name__}: {e}. "
                             "Pass --url (or set KILN_CACHE_URL) to a directory or store URL") from None

    def _path(self, *parts):
        if len(parts) > 1 and parts[0] in ("entries", "locks", "aliases"):   # no name escapes its folder
            suffix = {"entries": "", "locks": ".lock", "aliases": ".json"}[parts[0]]
            name = parts[1]
            if not (isinstance(name, str) and name.endswith(suffix) and valid_name(name[:len(name) - len(suffix)])):
                raise CacheError(f"cache {self.url!r}: {name!r} is not a kiln cache "
                                 f"{'fingerprint' if parts[0] == 'aliases' else 'key'}")
        return posixpath.join(self.root, *parts) if not self.local else os.path.join(self.root, *parts)

    # -- primitive file operations ------------------------------------------------------------
    def _read(self, path):
        if self.broken:
            return None
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except self.failures as e:
            self.unusable("reading", e)
            return None

    def _write_atomic(self, path, data: bytes, outcome: str) -> bool:
        """Write ``data`` to ``path`` atomically; False (and a warning) if the location
        refuses it."""
        if self.broken:
            return False
        try:
            self._write(path, data)
            return True
        except self.failures as e:
            self.unusable("writing", e, outcome)
            return False

    def _write(self, path, data: bytes):
        self.fs.makedirs(self._path("tmp"), exist_ok=True)
        if self.local:    # temp files of this host's killed writers go before they pile up
            sweep_temps(self._path("tmp"))
        tmp = self._path("tmp", f"{temp_prefix()}{uuid.uuid4().hex}.tmp")
        parent = path.rsplit("/", 1)[0] if not self.local else os.path.dirname(path)
        self.fs.makedirs(parent, exist_ok=True)
        if self.local:
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError:          # a full disk: no half-written file left behind
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _rm(self, path, recursive=False):
        error = None if self.broken else self._remove(path, recursive)
        if error is not None:
            self.unusable(f"deleting {path}", error, "it stays")

    def _remove(self, path, recursive=False):
        """Delete ``path`` even on a broken Cache (what this process wrote, its lock); the error or None."""
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except self.failures as e:
            return e
        return None

    # -- entries --------------------------------------------------------------------------------
    def _meta(self, key):
        raw = self._read(self._path("entries", key, "meta.json"))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"status": "corrupt"}

    def lookup(self, key):
        """("ok", artifact, meta) | ("failed", error text, meta) | None.

        The artifact is a local path (to be mapped) or, on an object store, the
        bytes. Corrupt or partial entries are discarded here, so the caller
        recompiles."""
        meta = self._meta(key)
        if meta is None:
            return None
        if meta.get("status") == "failed":
            return "failed", meta.get("error", "unknown error"), meta
        path = self._path("entries", key, "artifact.kiln")
        data = None
        if meta.get("status") == "ok":
            if self.local:
                size = os.path.getsize(path) if os.path.exists(path) else None
                data = path if size is not None else None
            else:
                data = self._read(path)
                size = None if data is None else len(data)
        # Size here; every blob's digest is checked when the artifact is parsed (and a
        # failure there discards the entry too).
        if data is None or size != meta.get("size"):
            log.warning("kiln cache: entry %s is corrupt or partial; discarding it", key[:16])
            self.count("discarded")
            self._rm(self._path("entries", key), recursive=True)
            return None
        return "ok", data, meta

    def touch(self, key, meta):
        """Record a use, for least-recently-used eviction (best effort: a store that can be
        read but not written, such as a read-only mount of a fleet's cache, still serves)."""
        meta = dict(meta, last_used=_now(), uses=int(meta.get("uses", 0)) + 1)
        if self.broken:
            return
        try:
            self._write(self._path("entries", key, "meta.json"), json.dumps(meta).encode())
        except self.failures as e:
            log.debug("kiln cache: could not update last-used of %s: %s", key[:16], e)

    def store(self, key, data: bytes, info: dict):
        """Keep an entry; its meta, or None when it is not there afterwards: the location refused
        a write (see :meth:`unusable`; what was written is removed again) or the size cap is
        smaller than the entry, which eviction then removed at once (warned once)."""
        # No digest of the whole file: every blob's digest is checked when it is read.
        meta = dict(info, key=key, status="ok", size=len(data),
                    created=_now(), last_used=_now(), uses=0)
        lost = "this compile was not stored (what was written of it is removed)"
        if self.broken or not self._write_atomic(self._path("entries", key, "artifact.kiln"), data, lost):
            return None
        if not self._write_atomic(self._path("entries", key, "meta.json"), json.dumps(meta).encode(), lost):
            self._remove(self._path("entries", key), recursive=True)     # no artifact without its meta
            return None
        try:
            evicted = {e["key"] for e in self.evict()}
        except self.failures as e:
            self.unusable("evicting", e, "the size cap was not applied")
            return meta
        if key not in evicted:
            return meta
        if len(data) > self.max_bytes and (self.url, "cap") not in _warned:
            _warned.add((self.url, "cap"))
            log.warning("kiln cache %s: the size cap (KILN_CACHE_MAX_BYTES or max_bytes=, %d bytes) is smaller "
                        "than one entry (this one is %d bytes), so every entry is evicted as soon as it is "
                        "stored and nothing is reused; raise the cap", self.url, self.max_bytes, len(data))
        return None

    def store_failure(self, key, error: BaseException, info: dict):
        meta = dict(info, key=key, status="failed", size=0, error=f"{type(error).__name__}: {error}",
                    created=_now(), last_used=_now(), uses=0)
        self._write_atomic(self._path("entries", key, "meta.json"), json.dumps(meta).encode(),
                           "this compile failure was not remembered")
        return meta

    def discard(self, key, why):
        log.warning("kiln cache: entry %s is unusable (%s); discarding it", key[:16], why)
        self.count("discarded")
        self.forget(key)

    def forget(self, key):
        self._rm(self._path("entries", key), recursive=True)

    # -- aliases ------------------------------------------------------------------------------------
    def alias(self, fp):
        """The key a fingerprint's alias names, or None. An alias whose key is not a kiln key (a
        path such as ``../../x``, written by anyone with access to the store) is never followed:
        it is a miss (warned once per location), and the trace's capture overwrites it."""
        if not valid_name(fp):
            return None
        raw = self._read(self._path("aliases", f"{fp}.json"))
        try:
            key = json.loads(raw)["key"] if raw else None
        except (ValueError, KeyError, TypeError):
            return None
        if key is not None and not valid_name(key):
            if (self.url, "alias") not in _warned:
                _warned.add((self.url, "alias"))
                log.warning("kiln cache %s: alias %s.json names %r, which is not a cache key; ignoring it "
                            "(it is overwritten once the model is captured)", self.url, fp[:16], str(key)[:80])
            return None
        return key

    def set_alias(self, fp, key):
        self._write_atomic(self._path("aliases", f"{fp}.json"), json.dumps({"key": key}).encode(),
                           f"entry {key[:16]} is stored but not the alias to it, so a later trace of "
                           "the model captures it again to find the entry")

    def drop_alias(self, fp):
        """Remove ``fp``'s alias (it named an entry compiled for another model)."""
        self._rm(self._path("aliases", f"{fp}.json"))

    # -- management ------------------------------------------------------------------------------------
    def entries(self, orphans=False) -> list:
        """Each entry's meta, with its key; ``orphans``: also entries without a meta (a killed or
        older writer's), not being written (unlocked, older than LOCK_STALE_SECONDS), as
        ``{"key", "size", "status": "orphan"}``: eviction, ``prune`` and ``clear`` remove them."""
        base = self._path("entries")
        try:
            keys = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return []
        keys = [k for k in keys if valid_name(k)]      # nothing else is kiln's (a stray file, "..")
        out = []
        for key in keys:
            meta = self._meta(key)
            if meta is not None:
                out.append(dict(meta, key=key))
            elif orphans and (orphan := self._orphan(key)):
                out.append(orphan)
        return out

    def _orphan(self, key):
        path = self._path("entries", key)
        try:
            if self.fs.exists(self._path("locks", f"{key}.lock")):
                return None
            found = self.fs.ls(path, detail=True) or [self.fs.info(path)]
        except FileNotFoundError:
            return None
        except self.failures as e:
            self.unusable("reading", e)
            return None
        stamp = max(_mtime(f) for f in found)
        size = sum(int(f.get("size") or 0) for f in found if f.get("type") == "file")
        return None if time.time() - stamp < self.stale_seconds else {"key": key, "size": size, "status": "orphan"}

    def total_bytes(self) -> int:
        return sum(int(e.get("size", 0)) for e in self.entries(orphans=True))

    def evict(self, max_bytes=None) -> list:
        """Delete least-recently-used entries (orphans first) until the total fits ``max_bytes``."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None:
            return []
        entries = sorted(self.entries(orphans=True), key=lambda e: (e.get("last_used", ""), e.get("created", "")))
        total = sum(int(e.get("size", 0)) for e in entries)
        removed = []
        for e in entries:
            if total <= cap:
                break
            self.forget(e["key"])
            total -= int(e.get("size", 0))
            removed.append(e)
        if removed:
            self._drop_dangling_aliases()
        return removed

    def _drop_dangling_aliases(self):
        try:
            paths = self.fs.ls(self._path("aliases"), detail=False)
        except FileNotFoundError:
            return
        live = {e["key"] for e in self.entries()}
        for p in paths:
            raw = self._read(p)
            try:
                if json.loads(raw)["key"] not in live:
                    self._rm(p)
            except (ValueError, KeyError, TypeError):
                self._rm(p)

    def clear(self):
        for sub in ("entries", "aliases", "locks", "tmp"):
            self._rm(self._path(sub), recursive=True)


def _mtime(info) -> float:
    stamp = info.get("mtime") or info.get("LastModified") or 0      # local | s3
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def open_cache(cache=None, max_bytes=None):
    """The Cache for a ``cache=`` argument, or None when caching is off."""
    if isinstance(cache, Cache):
        return cache
    url = resolve_url(cache)
    return None if url is None else Cache(url, max_bytes)
