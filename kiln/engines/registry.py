"""The registry of engines: kiln's own, plugins found through an entry point, and
engines registered at run time.

Built-in engines are named by ``module:class`` and imported only when first
asked for, so importing kiln imports no engine package. Plugins are discovered
once, when kiln first needs a name it does not know or the full list, from the
``kiln.engines`` entry-point group: each entry point's name is the engine's
name and its object an ``Engine`` subclass, an instance, or a function
returning one. A plugin that fails to load is a warning and stays unavailable,
never a crash. A built-in name cannot be taken by a plugin; ``register`` can
replace anything (tests use ``registered`` to do it for a block).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import threading
import warnings

from kiln.engines.base import Engine
from kiln.errors import EngineUnavailableError

ENTRY_POINT_GROUP = "kiln.engines"

BUILTIN = {
    "onnxruntime": "kiln.engines.onnxruntime:OnnxRuntimeEngine",
    "openvino": "kiln.engines.openvino:OpenVinoEngine",
    "inductor": "kiln.engines.inductor:InductorEngine",
    "eager": "kiln.engines.eager:EagerEngine",
}


class _Entry:
    """One registered engine: where it comes from, and the engine once built."""

    def __init__(self, source, origin: str):
        self.source, self.origin = source, origin    # origin: "kiln", "plugin <dist>", "registered"
        self.engine: Engine | None = None
        self.error: str | None = None

    def build(self, name: str) -> Engine:
        with _lock:
            return self.engine if self.engine is not None else self._build(name)

    def _build(self, name: str) -> Engine:
        if self.error is not None:
            raise EngineUnavailableError(f"engine {name!r} cannot be imported: {self.error}")
        try:
            engine = _instantiate(self.source)
        except Exception as e:  # noqa: BLE001 - a broken engine must not take kiln down
            self.error = f"{type(e).__name__}: {e}" if not isinstance(e, ImportError) else str(e)
            if self.origin.startswith("plugin"):
                warnings.warn(f"kiln: the engine plugin {name!r} ({self.origin}) failed to load: "
                              f"{self.error}", stacklevel=4)
            raise EngineUnavailableError(f"engine {name!r} cannot be imported: {self.error}") from None
        if not isinstance(engine, Engine):
            self.error = f"{self.source!r} made {type(engine).__name__}, not a kiln.engines.Engine"
        elif engine.name != name:     # the manifest records engine.name, and loading looks it up
            self.error = f"it is registered as {name!r} but calls itself {engine.name!r}"
        if self.error is not None:
            raise EngineUnavailableError(f"engine {name!r} cannot be used: {self.error}")
        self.engine = engine
        return engine


def _instantiate(source):
    if isinstance(source, str):
        module, _, attr = source.partition(":")
        source = getattr(importlib.import_module(module), attr)
    elif isinstance(source, importlib.metadata.EntryPoint):
        source = source.load()
    return source if isinstance(source, Engine) else source()


_lock = threading.RLock()
_entries: dict = {name: _Entry(spec, "kiln") for name, spec in BUILTIN.items()}
_discovered = False


def _discover():
    """Add the entry-point plugins, once."""
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True
        try:
            points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception as e:  # noqa: BLE001 - broken metadata must not stop kiln
            warnings.warn(f"kiln: could not list {ENTRY_POINT_GROUP} entry points: {e}", stacklevel=3)
            return
        for point in points:
            dist = getattr(getattr(point, "dist", None), "name", None) or "unknown distribution"
            if point.name in BUILTIN:
                warnings.warn(f"kiln: the engine plugin {point.name!r} from {dist} is ignored: "
                              "kiln has an engine of that name", stacklevel=3)
                continue
            _entries.setdefault(point.name, _Entry(point, f"plugin {dist}"))


def _entry(name: str) -> _Entry:
    with _lock:
        if name not in _entries:
            _discover()
        if name not in _entries:
            raise EngineUnavailableError(f"unknown engine {name!r}; kiln has: {', '.join(names())}")
        return _entries[name]


# -- public ---------------------------------------------------------------------------

def register(engine, name: str | None = None) -> str:
    """Register an engine: an ``Engine`` subclass or instance, a function returning one,
    or a ``"module:attribute"`` string naming one (imported when first used). Replaces an
    engine of the same name. Returns the name."""
    if name is None:
        name = getattr(engine, "name", None)
        if not name or not isinstance(name, str):
            raise ValueError(f"register({engine!r}): the engine has no name; pass name=")
    with _lock:
        _discover()
        _entries[name] = _Entry(engine, "registered")
    return name


def unregister(name: str) -> None:
    """Forget engine ``name`` (a built-in included) until it is registered again."""
    with _lock:
        _discover()
        _entries.pop(name, None)


@contextlib.contextmanager
def registered(*engines, without=()):
    """For the block: ``engines`` registered and the names in ``without`` hidden;
    the registry is restored afterwards. For tests and experiments."""
    with _lock:
        _discover()
        saved = dict(_entries)
    try:
        for engine in engines:
            register(engine)
        for name in without:
            unregister(name)
        yield
    finally:
        with _lock:
            _entries.clear()
            _entries.update(saved)


def names() -> list:
    """Every registered engine's name, installed or not: kiln's first."""
    with _lock:
        _discover()
        return list(_entries)


def describe(name: str) -> Engine | None:
    """Engine ``name`` whether or not its package is installed (to read what it says
    about itself), or None when kiln does not know it or cannot import its code."""
    try:
        return _entry(name).build(name)
    except EngineUnavailableError:
        return None


def get(name: str, required: bool = True, *, purpose: str = "compile") -> Engine | None:
    """The engine ``name``, ready to use; if it is unknown or not installed, raise
    ``EngineUnavailableError`` (or return None when not ``required``). ``purpose="load"``:
    ready to load blobs, which may need fewer modules than compiling
    (:attr:`Engine.load_modules`)."""
    try:
        engine = _entry(name).build(name)
        # an engine's own missing() (a plugin's) may take no purpose: asked only when it has load_modules
        why = engine.missing("load") if purpose == "load" and engine.load_modules is not None else engine.missing()
        if why is not None:
            raise EngineUnavailableError(
                f"engine {name!r} is not installed in this environment ({why}); install it "
                f"(pip install {engine.package or name}) or choose another engine")
    except EngineUnavailableError:
        if required:
            raise
        return None
    return engine


def available() -> list:
    """The names of the engines installed here."""
    return [name for name in names() if get(name, required=False) is not None]


def versions(metadata: bool = False) -> dict:
    """{name: version} of every registered engine, None where it is not installed.
    ``metadata``: the package's version from its metadata where it has one (no import of
    the engine's package beyond the availability check), for keys that must be cheap."""
    out = {}
    for name in names():
        engine = get(name, required=False)
        if engine is None:
            out[name] = None
        else:
            out[name] = (engine.package_version() if metadata else None) or engine.version()
    return out


def native_code(name: str) -> bool:
    """Whether engine ``name``'s blobs are native code, without checking it is installed;
    an engine this kiln does not know, or cannot import, counts as native."""
    engine = describe(str(name))
    return True if engine is None else bool(engine.native_code)


def ranked(device: str) -> list:
    """The engines in kiln's default order on ``device`` (``Engine.priority``), installed
    or not; an engine without a priority there is left out."""
    found = [e for e in (describe(n) for n in names()) if e is not None and device in e.priority]
    return sorted(found, key=lambda e: e.priority[device])


def runs_on(device: str) -> list:
    """The names of the registered engines whose builds run on ``device``, in default order
    (engines that run there only when named come last)."""
    ordered = [e.name for e in ranked(device)]
    rest = [n for n in names() if n not in ordered and device in getattr(describe(n), "devices", ())]
    return ordered + rest


def native_engine(cast_type: str, device: str = "cpu", among: str | None = None) -> str | None:
    """The installed engine that computes ``cast_type`` ("bf16", "fp16") natively on this
    host's ``device``: the first in default order, or ``among`` (an engine the user named)
    if it does; None when kiln must emulate the type."""
    candidates = [among] if among else [e.name for e in ranked(device)]
    for name in candidates:
        engine = get(name, required=False)
        if engine is not None and cast_type in engine.native_types(device):
            return name
    return None
