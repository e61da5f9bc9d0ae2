"""The persistent compile cache: compile a graph once per machine type, share it with a fleet.

Storage is any fsspec URL (a local directory by default, ``s3://`` for a fleet,
``memory://`` in tests). Layout under the root::

    entries/<key>/artifact.kiln    the compiled artifact (absent for a cached failure)
    entries/<key>/meta.json        written last: model name, engine, size,
                                   created, last used, status ok|failed (+ error)
    aliases/<fingerprint>.json     fast lookup: model fingerprint -> key
    locks/<key>.lock               held while one process compiles the key

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
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import posixpath
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from kiln import __version__

from kiln.artifact import specs
from kiln.host import target as target_mod
from kiln.artifact.container import FORMAT_VERSION, sweep_temps, temp_prefix
from kiln.errors import KilnError

log = logging.getLogger("kiln")

KEY_VERSION = 2            # bump when what goes into a key changes
LOCK_STALE_SECONDS = 60.0  # a lock not refreshed for this long belongs to a dead process
LOCK_REFRESH_SECONDS = 10.0

# Process-wide counters (also per Cache instance): what tests and reports read.
stats = {"hits": 0, "misses": 0, "alias_hits": 0, "compiles": 0, "failed_hits": 0, "discarded": 0,
         "lock_waits": 0, "untrusted": 0}
_stats_lock = threading.Lock()


def _count(name, n=1):
    with _stats_lock:
        stats[name] += n


class CacheError(KilnError):
    """The cache location cannot be used."""


class CachedFailure(KilnError):
    """This graph failed to compile before; the cache remembers it."""


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
        env = os.environ.get("KILN_CACHE_URL")
        if env is not None:
            return None if env.strip().lower() in ("", "0", "off", "false", "none") else env
        return default_url()
    return os.fspath(cache)


def max_bytes_from_env():
    value = os.environ.get("KILN_CACHE_MAX_BYTES")
    if not value:
        return None
    try:
        return _parse_size(value)
    except ValueError:
        raise CacheError(f"KILN_CACHE_MAX_BYTES={value!r}: expected a size like 2000000000, 2G or 500M") from None


def _parse_size(text) -> int:
    text = str(text).strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    if text and text[-1] in mult:
        return int(float(text[:-1]) * mult[text[-1]])
    return int(text)


# -- keys ------------------------------------------------------------------------------------------
def _engine_versions() -> dict:
    """Installed engine versions, from package metadata (importing OpenVINO takes a second)."""
    from kiln import engines as backends
    out = {}
    for name in backends.names():
        backend = backends.get(name, required=False)
        if backend is None:
            out[name] = None
            continue
        dist = {"onnxruntime": "onnxruntime", "openvino": "openvino", "inductor": "torch"}.get(name, name)
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = backend.version()
    return out


@functools.lru_cache(maxsize=1)
def _environment() -> dict:
    return {"key_version": KEY_VERSION, "format_version": FORMAT_VERSION, "kiln": __version__,
            "kiln_source": _kiln_source_digest(), "torch": torch.__version__,
            "engines": _engine_versions()}


def _options_for_key(opts) -> dict:
    # validate/atol/rtol stay in: a stricter tolerance must re-check, not reuse a pass.
    return opts.to_dict()


def _kiln_source_digest() -> str:
    """kiln's own code, by content: a fix in kiln must not be served stale artifacts
    compiled by the code it fixed, even before the version number moves."""
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(here)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                h.update(name.encode())
                h.update(_file_digest(os.path.join(dirpath, name)).encode())
    return h.hexdigest()


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


_digests: dict = {}   # id(tensor) -> (weakref, state, digest), this process only
_digests_lock = threading.Lock()


def _tensor_digest(t: torch.Tensor) -> str:
    """Content digest of a tensor, remembered while the tensor is alive and unchanged, so
    a second trace in the same process does not rehash hundreds of megabytes of weights.
    ``_version`` moves on every in-place write and ``data_ptr`` on ``param.data = ...``;
    the weak reference makes sure a reused id is not taken for the old tensor."""
    import weakref
    try:
        state = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t._version)
        ref = weakref.ref(t)
    except (TypeError, RuntimeError):
        return _compute_digest(t)
    with _digests_lock:
        hit = _digests.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == state:
        return hit[2]
    digest = _compute_digest(t)
    with _digests_lock:
        _digests[id(t)] = (ref, state, digest)
    return digest


def _compute_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # XXH3-128 hashes at memory speed (BLAKE2b took 1.5 s for BERT-base's 440 MB); a
    # fingerprint only has to tell models apart, not resist forgery: whoever can
    # write to the cache can replace entries anyway.
    h = xxhash.xxh3_128()
    h.update(f"{specs.dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.dtype != torch.bool
                 else t.to(torch.uint8).numpy().data)
    return h.hexdigest()


def tensors_digest(named_tensors) -> str:
    """One digest over (name, tensor) pairs; tensors hash in parallel (xxhash drops the GIL
    for large inputs)."""
    items = list(named_tensors)
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda kv: _tensor_digest(kv[1]), items))
    return _hash_json([[name, d] for (name, _), d in zip(items, digests)])


def _literal(a, index):
    """A node argument as canonical JSON: nodes by position, values by repr."""
    if isinstance(a, torch.fx.Node):
        return ["node", index[a]]
    if isinstance(a, (list, tuple)):
        return [type(a).__name__, [_literal(x, index) for x in a]]
    if isinstance(a, dict):
        return ["dict", sorted((str(k), _literal(v, index)) for k, v in a.items())]
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ["torch", str(a)]
    if isinstance(a, (int, float, bool, str)) or a is None:
        return a
    return ["repr", type(a).__name__, repr(a)]


def graph_key(captured, opts, extra=None) -> str:
    """The entry key: canonical graph + weights + options + engines + ISA (see module doc)."""
    gm = captured.graph_module
    index, nodes, attrs = {}, [], []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        meta = None
        if isinstance(val, torch.Tensor):
            meta = [list(val.shape), specs.dtype_name(val.dtype)]
        target = node.target
        if node.op == "get_attr":
            attrs.append(target)
            target = ["attr", len(attrs) - 1]
        elif not isinstance(target, str):
            target = getattr(target, "name", None) and target.name() or repr(target)
        elif node.op == "placeholder":
            target = "input"
        nodes.append([node.op, target, _literal(node.args, index), _literal(node.kwargs, index), meta])
    weights = [(f"attr{i}", _fetch_attr(gm, a)) for i, a in enumerate(attrs)]
    weights = [(n, t) for n, t in weights if isinstance(t, torch.Tensor)]
    return _hash_json({
        "kind": "graph", "graph": nodes, "weights": tensors_digest(weights),
        "inputs": [s.to_dict() for s in captured.input_specs],
        "input_structure": captured.input_structure, "output_structure": captured.output_structure,
        "options": _options_for_key(opts), "extra": extra, "env": _environment(),
        "target": target_mod.describe(opts.target, opts.device)})


def _fetch_attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=256)
def _file_digest(path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


def _class_digest(cls) -> list:
    """A class's identity without its location: qualname + the content of its source file
    (helpers in the same file are covered) + its package's version (imports are not)."""
    try:
        path = inspect.getsourcefile(cls) or inspect.getfile(cls)
        content = _file_digest(path)
    except (TypeError, OSError):
        content = "builtin"
    return [cls.__qualname__, content, _package_version((cls.__module__ or "").split(".")[0])]


@functools.lru_cache(maxsize=None)
def _package_version(top):
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _settings(value, depth=0):
    """Non-tensor module state as canonical JSON; unknown objects by type (and to_dict)."""
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    if depth > 4:
        return ["deep", type(value).__name__]
    if isinstance(value, (list, tuple)):
        return [_settings(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        # sorted: a set's order follows string hashing, which differs per process
        return ["set", sorted((_settings(v, depth + 1) for v in value), key=json.dumps)]
    if isinstance(value, dict):
        return {str(k): _settings(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        try:
            return [type(value).__qualname__, _settings(value.to_dict(), depth + 1)]
        except Exception:  # noqa: BLE001
            pass
    if callable(value):
        code = getattr(value, "__code__", None)
        return ["callable", getattr(value, "__qualname__", type(value).__qualname__),
                hashlib.sha256(code.co_code).hexdigest() if code else None]
    text = repr(value)
    return [type(value).__qualname__, None if " at 0x" in text else text]


_SKIP = {"_parameters", "_buffers", "_modules", "training",
         "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
         "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_non_persistent_buffers_set",
         "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
         "_is_full_backward_hook", "_compiled_call_impl"}
# Forward hooks change what the model computes; their dict keys are process-global
# counters, so only the hooks themselves (in order) go into the fingerprint.
_HOOKS = {"_forward_hooks", "_forward_pre_hooks"}


def fingerprint(model, named_inputs: dict, opts, extra=None) -> str | None:
    """The fast key: no capture. None when the model is not an ``nn.Module`` (functions
    have no reliable identity), which then always captures."""
    if not isinstance(model, torch.nn.Module):
        return None
    modules = []
    for name, mod in model.named_modules():
        state = {k: _settings(list(v.values()) if k in _HOOKS else v) for k, v in vars(mod).items()
                 if k not in _SKIP and not isinstance(v, torch.Tensor)}
        modules.append([name, _class_digest(type(mod)), state])
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    leaves, in_specs = [], []
    structure = {n: specs.encode(v, n, leaves, in_specs) for n, v in named_inputs.items()}
    return _hash_json({
        "kind": "fingerprint", "modules": modules, "weights": tensors_digest(tensors),
        "inputs": [s.to_dict() for s in in_specs], "structure": structure,
        "options": _options_for_key(opts), "extra": extra, "env": _environment(),
        "target": target_mod.describe(opts.target, opts.device)})


# -- the store ----------------------------------------------------------------------------------------------
class Cache:
    """One cache location. Safe to share between threads, processes and machines."""

    def __init__(self, url: str, max_bytes: int | None = None):
        import fsspec
        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CacheError(f"cache {url!r}: {e}. Install the fsspec implementation for this URL "
                             "(s3fs for s3://) or pass cache=False") from None
        self.root = self.root.rstrip("/")
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.max_bytes = max_bytes if max_bytes is not None else max_bytes_from_env()
        self.stats = {k: 0 for k in stats}

    def __repr__(self):
        return f"kiln.compiler.cache.Cache({self.url!r})"

    def _count(self, name):
        self.stats[name] += 1
        _count(name)

    def _path(self, *parts):
        return posixpath.join(self.root, *parts) if not self.local else os.path.join(self.root, *parts)

    # -- primitive file operations ------------------------------------------------------------
    def _read(self, path):
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _write_atomic(self, path, data: bytes):
        self.fs.makedirs(self._path("tmp"), exist_ok=True)
        if self.local:    # temp files of this host's killed writers go before they pile up
            sweep_temps(self._path("tmp"))
        tmp = self._path("tmp", f"{temp_prefix()}{uuid.uuid4().hex}.tmp")
        parent = path.rsplit("/", 1)[0] if not self.local else os.path.dirname(path)
        self.fs.makedirs(parent, exist_ok=True)
        if self.local:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _rm(self, path, recursive=False):
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass

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
            self._count("discarded")
            self._rm(self._path("entries", key), recursive=True)
            return None
        return "ok", data, meta

    def touch(self, key, meta):
        """Record a use, for least-recently-used eviction (best effort)."""
        meta = dict(meta, last_used=_now(), uses=int(meta.get("uses", 0)) + 1)
        try:
            self._write_atomic(self._path("entries", key, "meta.json"), json.dumps(meta).encode())
        except OSError as e:
            log.debug("kiln cache: could not update last-used of %s: %s", key[:16], e)

    def store(self, key, data: bytes, info: dict):
        # No digest of the whole file: every blob's digest is checked when it is read.
        meta = dict(info, key=key, status="ok", size=len(data),
                    created=_now(), last_used=_now(), uses=0)
        self._write_atomic(self._path("entries", key, "artifact.kiln"), data)
        self._write_atomic(self._path("entries", key, "meta.json"), json.dumps(meta).encode())
        self.evict()
        return meta

    def store_failure(self, key, error: BaseException, info: dict):
        meta = dict(info, key=key, status="failed", size=0, error=f"{type(error).__name__}: {error}",
                    created=_now(), last_used=_now(), uses=0)
        self._write_atomic(self._path("entries", key, "meta.json"), json.dumps(meta).encode())
        return meta

    def discard(self, key, why):
        log.warning("kiln cache: entry %s is unusable (%s); discarding it", key[:16], why)
        self._count("discarded")
        self.forget(key)

    def forget(self, key):
        self._rm(self._path("entries", key), recursive=True)

    # -- aliases ------------------------------------------------------------------------------------
    def alias(self, fp):
        raw = self._read(self._path("aliases", f"{fp}.json"))
        try:
            return json.loads(raw)["key"] if raw else None
        except (ValueError, KeyError):
            return None

    def set_alias(self, fp, key):
        self._write_atomic(self._path("aliases", f"{fp}.json"), json.dumps({"key": key}).encode())

    # -- one compile per key ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key, wait_for=None, poll=0.25):
        """Hold the compile lock of ``key``; while another process holds it, poll
        ``wait_for()`` (e.g. "is the entry there now?") and return its result early.

        Local directories use an exclusive create; object stores, which have no
        such primitive everywhere, write a random token, wait, and read it back:
        the last writer wins and everyone agrees who that was. A holder refreshes
        its lock; a lock not refreshed for LOCK_STALE_SECONDS is broken."""
        path = self._path("locks", f"{key}.lock")
        self.fs.makedirs(self._path("locks"), exist_ok=True)
        token = f"{os.getpid()}-{uuid.uuid4().hex}"
        waited = False
        while True:
            if self._try_lock(path, token):
                break
            if not waited:
                waited = True
                self._count("lock_waits")
                log.info("kiln cache: another process is compiling %s; waiting for it", key[:16])
            result = wait_for() if wait_for else None
            if result is not None:
                yield result
                return
            self._break_if_stale(path)
            time.sleep(poll)
        stop = threading.Event()
        refresher = threading.Thread(target=self._refresh, args=(path, token, stop), daemon=True)
        refresher.start()
        try:
            yield None
        finally:
            stop.set()
            refresher.join()
            self._rm(path)

    def _lock_body(self, token):
        return json.dumps({"token": token, "time": time.time(), "host": os.uname().nodename}).encode()

    def _try_lock(self, path, token) -> bool:
        if self.local:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(self._lock_body(token))
            return True
        if self.fs.exists(path):
            return False
        with self.fs.open(path, "wb") as f:
            f.write(self._lock_body(token))
        time.sleep(0.5)   # let concurrent writers land, then see who won
        raw = self._read(path)
        try:
            return raw is not None and json.loads(raw)["token"] == token
        except (ValueError, KeyError):
            return False

    def _refresh(self, path, token, stop):
        while not stop.wait(LOCK_REFRESH_SECONDS):
            try:
                if self.local:
                    os.utime(path)
                else:
                    with self.fs.open(path, "wb") as f:
                        f.write(self._lock_body(token))
            except OSError:
                pass

    def _break_if_stale(self, path):
        raw = self._read(path)
        if raw is None:
            return
        try:
            stamp = os.path.getmtime(path) if self.local else json.loads(raw)["time"]
        except (ValueError, KeyError, OSError):
            stamp = 0
        if time.time() - stamp > LOCK_STALE_SECONDS:
            log.warning("kiln cache: breaking a stale compile lock %s", path)
            self._rm(path)

    # -- management ------------------------------------------------------------------------------------
    def entries(self) -> list:
        base = self._path("entries")
        try:
            keys = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return []
        out = []
        for key in keys:
            meta = self._meta(key)
            if meta is not None:
                out.append(dict(meta, key=key))
        return out

    def total_bytes(self) -> int:
        return sum(int(e.get("size", 0)) for e in self.entries())

    def evict(self, max_bytes=None) -> list:
        """Delete least-recently-used entries until the total fits ``max_bytes``."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None:
            return []
        entries = sorted(self.entries(), key=lambda e: (e.get("last_used", ""), e.get("created", "")))
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


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


def open_cache(cache=None, max_bytes=None):
    """The Cache for a ``cache=`` argument, or None when caching is off."""
    if isinstance(cache, Cache):
        return cache
    url = resolve_url(cache)
    return None if url is None else Cache(url, max_bytes)
