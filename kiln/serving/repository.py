"""The server's model repository: which models it serves, under which names, and their lifecycle.

Models are named after their file, as Triton names a model after its repository
folder (``models/bert.kiln`` -> ``bert``), unless named ``name=path``.
:class:`ServerState` holds every :class:`~kiln.serving.models.ServedModel` and
the flags the app's handlers share; it loads the models in a background thread
once the app starts, and drains them on shutdown.
"""
from __future__ import annotations

import os

from kiln.artifact.container import manifest_of
from kiln.errors import KilnError
from kiln.runtime.llm import LLM
from kiln.runtime.tp_llm import KIND as TP_KIND, TensorParallelLLM
from kiln.runtime.model import Model
from kiln.serving.llm import ServedLLM
from kiln.serving.logs import log
from kiln.serving.metrics import ServeMetrics
from kiln.serving.models import ServedModel
from kiln.serving.settings import ServeConfig


# -- names -----------------------------------------------------------------------------------------
def model_name_of(path: str) -> str:
    """The model name in an artifact's manifest (and a quick check that it is one)."""
    return manifest_of(path).get("model_name", "model")


def served(name: str, source, config: ServeConfig, metrics: ServeMetrics):
    """The served form of a model: an LLM artifact behind the OpenAI routes, anything else
    behind the Open Inference Protocol's."""
    if isinstance(source, (LLM, TensorParallelLLM)) or (
            isinstance(source, str) and manifest_of(source).get("kind") in ("llm", TP_KIND)):
        return ServedLLM(name, source, config, metrics)
    return ServedModel(name, source, config, metrics)


def default_name(path: str) -> str:
    """The URL name of an artifact served without ``name=``: the file's stem, as Triton names a
    model after its repository folder (``models/bert.kiln`` -> ``bert``). The artifact's own model
    name (often just the Python class) stays visible in the model's metadata."""
    model_name_of(path)
    stem = os.path.basename(os.fspath(path))
    root, ext = os.path.splitext(stem)
    return root if ext and root else stem


def _spec_items(models) -> list:
    """``[(name or None, path or Model)]`` from a list of paths, ``name=path`` strings, models
    and pairs (a path that exists wins over reading ``=`` in it as a name)."""
    if isinstance(models, (str, os.PathLike, Model, LLM, TensorParallelLLM)):
        models = [models]
    items = []
    for spec in models:
        if isinstance(spec, tuple):
            items.append(spec)
        elif isinstance(spec, (Model, LLM, TensorParallelLLM)):
            items.append((getattr(spec, "name", None) or spec.manifest.get("model_name", "llm"), spec))
        else:
            spec = os.fspath(spec)
            name, sep, path = spec.partition("=")
            if sep and name and os.sep not in name and not os.path.exists(spec):
                items.append((name, path))
            else:
                items.append((None, spec))
    return items


def resolve_models(models) -> dict:
    """``{name: path or Model}`` from what :func:`kiln.serving.app.build_app` accepts."""
    items = list(models.items()) if isinstance(models, dict) else _spec_items(models)
    out: dict = {}
    for name, src in items:
        if not isinstance(src, (Model, LLM, TensorParallelLLM)):
            src = os.fspath(src)
            name = name or default_name(src)
        if name in out:
            raise KilnError(f"two models are named '{name}'; name them on the command line "
                            "(name=path.kiln)")
        if not name or "/" in name or not name.isprintable() or not _utf8(name):
            raise KilnError(f"model name {name!r} cannot be used in a URL path; name it on the "
                            "command line (name=path.kiln)")
        out[name] = src
    if not out:
        raise KilnError("no models to serve")
    return out


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:      # a file name that is not UTF-8 (surrogate escapes)
        return False


# -- the models and the server's lifecycle ----------------------------------------------------------
class ServerState:
    """Everything the app's handlers share: models, config, metrics, lifecycle flags."""

    def __init__(self, models: dict, config: ServeConfig):
        self.config = config
        self.metrics = ServeMetrics()
        self.models = {name: served(name, src, config, self.metrics) for name, src in models.items()}
        self.draining = False
        self.failed = False
        self.in_flight = 0            # inference requests being handled
        self.on_fatal = None          # set by serve(): stop the server when a model fails to load
        self.loop = None
        self.drain_timeout = None     # set by serve(): how long shutdown waits for an LLM's scheduler
        for sm in self.models.values():
            if isinstance(sm, ServedLLM):
                sm.on_fatal = self._fatal

    def _fatal(self):
        self.failed = True
        if self.on_fatal is not None:
            self.on_fatal()

    def ready(self) -> bool:
        return not self.draining and all(m.ready for m in self.models.values()) and not self.stalled()

    def stalled(self) -> dict:
        """``{model: seconds}`` of the LLMs whose scheduler has been in one step longer than
        ``--stall-timeout``: they cannot answer, though loaded (:meth:`ServedLLM.stalled`)."""
        seconds = {name: sm.stalled() for name, sm in self.models.items() if isinstance(sm, ServedLLM)}
        return {name: s for name, s in seconds.items() if s is not None}

    def load_all(self):
        """Loading thread: load and warm up every model, then start it on the event loop."""
        for sm in self.models.values():
            log("info", "model_loading", model=sm.name,
                source=sm.source if isinstance(sm.source, str) else type(sm.source).__name__,
                instances=self.config.instances)
            try:
                seconds = sm.load()
            except Exception as e:  # noqa: BLE001 - reported, and the server stops
                sm.state, sm.error = "UNAVAILABLE", f"{type(e).__name__}: {e}"
                self.failed = True
                log("error", "model_load_failed", model=sm.name, error=sm.error)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            log("info", "model_loaded", model=sm.name, seconds=round(seconds, 3))
            if not self._on_loop(sm.start):
                return
        self._on_loop(lambda: log("info", "server_ready", models=list(self.models)))

    def _on_loop(self, fn) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn)
            return True
        except RuntimeError:      # the event loop closed: the server stopped while loading
            return False

    def begin_drain(self):
        """SIGTERM: readiness goes false; queued requests run without waiting for batches to fill."""
        if self.draining:
            return
        self.draining = True
        # in_flight counts the inference endpoints' requests; an LLM's generations (whose
        # OpenAI requests stream) are its scheduler's, running or waiting
        log("info", "draining", in_flight=self.in_flight, generations=self.generations())
        for sm in self.models.values():
            if sm.batcher is not None:
                sm.batcher.flush()      # an LLM's scheduler never waits to fill a batch

    def generations(self) -> int:
        """Generations the served LLMs are running or holding in their queues."""
        total = 0
        for sm in self.models.values():
            scheduler = getattr(sm, "scheduler", None) if isinstance(sm, ServedLLM) else None
            if scheduler is not None and hasattr(scheduler, "usage"):
                usage = scheduler.usage()
                total += usage["slots_used"] + usage["waiting"]
        return total

    async def shutdown(self):
        """Finish every queued and running request, then mark every model unavailable."""
        self.draining = True
        for sm in self.models.values():
            if isinstance(sm, ServedLLM):
                await sm.close(self.drain_timeout)
            elif sm.batcher is not None and sm.batcher.started:
                await sm.batcher.close()
            sm.ready, sm.state = False, "UNAVAILABLE"
            self.metrics.ready.labels(sm.name).set(0)
        log("info", "stopped")
