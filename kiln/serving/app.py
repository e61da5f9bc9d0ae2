"""The ASGI app (Starlette): the Open Inference Protocol's routes over the served models.

==========================================  ==========================================
``GET  /v2/health/live``                     200 while the process runs
``GET  /v2/health/ready``, ``GET /health``   200 once every model is loaded and warmed up, else 503
``GET  /v2``                                 server metadata (name, version, extensions)
``GET  /v2/models/{name}``                   model metadata: inputs/outputs, shapes (-1 varies)
``GET  /v2/models/{name}/ready``             200 when that model is ready (LLMs too), else 503
``GET  /v2/models/{name}/config``            batching and instance settings
``POST /v2/models/{name}/infer``             inference: JSON tensors or binary tensor data
``POST /v2/repository/index``                the models and their states
``POST /v2/repository/models/{name}/load``   400: models are not loaded or unloaded at run time
``GET  /v2/models/{name}/stats``             400: no statistics extension (see ``/metrics``)
``GET  /metrics``                            Prometheus metrics
``GET  /v1/models``                          the LLMs ready to answer: the OpenAI API
``POST /v1/completions``                     (:mod:`kiln.serving.openai_api`)
``POST /v1/chat/completions``
``POST /v1/embeddings``                      encoders named by ``embeddings=`` (``--embeddings``)
==========================================  ==========================================

(``/v2/models/{name}/versions/1/...`` works too; every model has version ``1``.)

The handlers are thin: the codec is :mod:`kiln.serving.protocol`, the models and
their batchers :mod:`kiln.serving.models`. This module reads request bodies
safely (size limit checked as the body streams in, a deadline for its arrival,
gzip/deflate inflated up to the same limit) and maps kiln's errors to statuses:
400 for bad requests, 404 for an unknown model, 408 for a body that does not
arrive in time, 413 for one over the size limit, 503 when a model's queue is
full, it is not ready yet or the server is shutting down, 504 when a request
times out; the body is the protocol's ``{"error": "..."}``. Every 503 carries
``Retry-After`` (:class:`RetryAfter`): the condition is temporary, and a client or load
balancer that honours the header tries again instead of failing.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import zlib

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln._version import __version__
from kiln.errors import (BadRequestError, BodyTimeoutError, BodyTooLargeError, InputError,
                         ModelUnavailableError, OverloadedError, RequestTimeoutError)
from kiln.serving import openai_api
from kiln.serving.body import inflate, read_body
from kiln.serving.embeddings import load_embedders
from kiln.serving.logs import log
from kiln.serving.protocol import error_body, parse_body
from kiln.serving.repository import ServerState, resolve_models
from kiln.serving.settings import ServeConfig

RETRY = {"Retry-After": "1"}
# what a model's batcher raises -> (failure reason in the metrics, HTTP status, headers)
SUBMIT_ERRORS = ((OverloadedError, "overloaded", 503, RETRY),
                 (ModelUnavailableError, "unavailable", 503, RETRY),
                 (RequestTimeoutError, "timeout", 504, None),
                 (InputError, "bad_request", 400, None))


class RetryAfter:
    """ASGI middleware: a 503 (a model loading, a full queue, the server draining) that does
    not say when to come back gets ``Retry-After: 1``, whichever handler answered it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message):
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": headers + [(b"retry-after", RETRY["Retry-After"].encode())]}
            await send(message)
        await self.app(scope, receive, send_with_retry_after)


def error_response(status: int, message: str, headers=None) -> Response:
    """The protocol's error body with ``status``."""
    return Response(error_body(message), status_code=status, headers=headers, media_type="application/json")


def lookup_model(request: Request, allow_llm: bool = False):
    """(state, served model) for the request's path, or (state, an error response). An LLM
    has no tensors to describe or take; it answers on the OpenAI routes."""
    state: ServerState = request.app.state.kiln
    name = request.path_params["name"]
    sm = state.models.get(name)
    if sm is None:
        return state, error_response(404, f"unknown model '{name}'; this server serves "
                                          f"{', '.join(repr(n) for n in state.models) or 'no models'}")
    version = request.path_params.get("version")
    if version is not None and version != "1":
        return state, error_response(404, f"model '{name}' has no version '{version}'; it has version '1'")
    if getattr(sm, "kind", "model") == "llm" and not allow_llm:
        return state, error_response(400, f"model '{name}' is an LLM: use the OpenAI routes "
                                          "(/v1/completions, /v1/chat/completions)")
    return state, sm


# -- metadata, health, repository, metrics ---------------------------------------------------------
async def server_metadata(request):
    """Only the extensions served whole: the model repository extension's index route is
    served, its load and unload are not (:func:`not_offered`), so it is not advertised."""
    return JSONResponse({"name": "kiln", "version": __version__, "extensions": ["binary_tensor_data"]})


async def not_offered(request):
    """A 400 naming what kiln serve does not do, for Triton's routes a client may try
    (``tritonclient``'s ``load_model``, ``unload_model``, ``get_inference_statistics``)."""
    if request.url.path.endswith("/stats"):
        return error_response(400, "kiln serve has no statistics extension: each model's requests, failures, "
                                   "queue and inference times are Prometheus metrics at GET /metrics")
    return error_response(400, "kiln serve does not load or unload models at run time (no model_repository "
                               "extension): it serves the models named when it started; restart it to change them")


async def health_live(request):
    return JSONResponse({"live": True})


async def health_ready(request):
    """``/v2/health/ready`` and ``/health``: 200 once every model answers; 503 while any is
    loading, after one failed to load, while draining, and while an LLM is stalled (in one
    step for longer than ``--stall-timeout``: the body names it and the seconds)."""
    state: ServerState = request.app.state.kiln
    ok, stalled = state.ready(), state.stalled()
    body = {"ready": ok, "stalled": {name: round(s, 1) for name, s in stalled.items()}} if stalled else {"ready": ok}
    return JSONResponse(body, status_code=200 if ok else 503)


def not_ready(sm):
    """The 503 of a model's metadata or config before it is ready (loading, warming up,
    checking merges: its batching is not settled yet) or after it failed; None once ready."""
    if sm.ready:
        return None
    return error_response(503, f"model '{sm.name}' is not ready ({sm.state.lower()})"
                               + (f": {sm.error}" if sm.error else ""), RETRY)


async def model_metadata(request):
    state, sm = lookup_model(request)
    if isinstance(sm, Response):
        return sm
    return not_ready(sm) or JSONResponse(sm.metadata())


async def model_config(request):
    state, sm = lookup_model(request)
    if isinstance(sm, Response):
        return sm
    return not_ready(sm) or JSONResponse(sm.model_config())


async def model_ready(request):
    state, sm = lookup_model(request, allow_llm=True)
    if isinstance(sm, Response):
        return sm
    ok = sm.ready and not state.draining
    return JSONResponse({"name": sm.name, "ready": ok}, status_code=200 if ok else 503)


async def repository_index(request):
    state: ServerState = request.app.state.kiln
    return JSONResponse([{"name": sm.name, "version": "1", "state": sm.state,
                          **({"reason": sm.error} if sm.error else {})} for sm in state.models.values()])


async def metrics_endpoint(request):
    state: ServerState = request.app.state.kiln
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- inference ---------------------------------------------------------------------------------------
async def infer(request):
    state, sm = lookup_model(request)
    if isinstance(sm, Response):
        return sm
    m = state.metrics
    name = sm.name
    m.requests.labels(name).inc()
    gauge = m.in_flight.labels(name)
    gauge.inc()
    state.in_flight += 1
    loop = asyncio.get_running_loop()
    start = loop.time()

    def fail(reason, status, message, headers=None):
        m.failures.labels(name, reason).inc()
        return error_response(status, message, headers)

    try:
        if not sm.ready:
            return fail("unavailable", 503, f"model '{name}' is not ready ({sm.state.lower()})", RETRY)
        try:
            req, rows, timeout = await read_request(request, sm, state.config)
        except (BadRequestError, InputError) as e:
            return fail("bad_request", 400, str(e))
        except BodyTooLargeError as e:
            return fail("bad_request", 413, str(e))
        except BodyTimeoutError as e:   # and close the connection: the rest of its body is not awaited
            return fail("bad_request", 408, str(e), {"Connection": "close"})
        except ClientDisconnect:
            m.failures.labels(name, "disconnected").inc()
            log("debug", "client_disconnected", model=name, stage="reading the request body")
            return Response(status_code=400)      # nobody is listening
        except (OSError, EOFError, zlib.error) as e:
            return fail("bad_request", 400, f"cannot read the request body: {e}")
        try:
            outs = await sm.batcher.submit(req.inputs, rows, timeout)
        except asyncio.CancelledError:
            if not state.draining:
                raise
            # the drain timeout passed during a shutdown and uvicorn cancelled the request: the
            # protocol's JSON error, not uvicorn's plain-text 500 and a traceback (until 12-03)
            asyncio.current_task().uncancel()
            return fail("unavailable", 503, f"model '{name}': the server shut down before this request was "
                        f"answered (its drain timeout, {getattr(state, 'drain_timeout', 0):g} s, passed); retry "
                        "on another server", {"Connection": "close"})
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            for cls, reason, status, headers in SUBMIT_ERRORS:
                if isinstance(e, cls):
                    return fail(reason, status, str(e), headers)
            log("error", "inference_failed", model=name, error=f"{type(e).__name__}: {e}")
            return fail("internal", 500, f"inference failed: {type(e).__name__}: {e}")
        body, media_type, headers = sm.encode(outs, req)
        response = Response(body, media_type=media_type, headers=headers)
        m.request_seconds.labels(name).observe(loop.time() - start)
        return response
    finally:
        gauge.dec()
        state.in_flight -= 1


async def read_request(request: Request, sm, config: ServeConfig) -> tuple:
    """(decoded request, rows, timeout) of an infer request: the body read within the limits,
    inflated, parsed and checked. The raw body is not kept: the tensors are copies, and a
    queued request must not hold it."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity", "gzip", "deflate"):
        raise BadRequestError(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
    body = await read_body(request, config.max_request_bytes, config.body_timeout_s)
    if encoding in ("gzip", "deflate"):
        body = inflate(body, encoding, config.max_request_bytes)
    payload, binary = parse_body(body, request.headers.get("inference-header-content-length"))
    return sm.decode(payload, binary)


# -- the app -----------------------------------------------------------------------------------------
async def http_error(request, exc):
    return error_response(exc.status_code, exc.detail or "error", getattr(exc, "headers", None))


async def internal_error(request, exc):
    """Any other exception: a JSON 500 (Starlette re-raises it after, so uvicorn logs it)."""
    log("error", "request_failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return error_response(500, f"internal error: {type(exc).__name__}")


def routes() -> list:
    """Every route of the Open Inference Protocol that kiln serves."""
    out = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        out += [Route(prefix, model_metadata, methods=["GET"]),
                Route(prefix + "/ready", model_ready, methods=["GET"]),
                Route(prefix + "/config", model_config, methods=["GET"]),
                Route(prefix + "/infer", infer, methods=["POST"]),
                Route(prefix + "/stats", not_offered, methods=["GET"])]
    return [Route("/v2", server_metadata, methods=["GET"]),
            Route("/v2/health/live", health_live, methods=["GET"]),
            Route("/v2/health/ready", health_ready, methods=["GET"]),
            Route("/health", health_ready, methods=["GET"]),
            Route("/v2/repository/index", repository_index, methods=["POST", "GET"]),
            Route("/v2/repository/models/{name}/load", not_offered, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", not_offered, methods=["POST"]),
            Route("/metrics", metrics_endpoint, methods=["GET"])] + out + openai_api.routes()


def build_app(models, config: ServeConfig | None = None, **settings) -> Starlette:
    """The ASGI app serving ``models``: paths (``"m.kiln"`` or ``"name=m.kiln"``), loaded
    ``kiln.Model`` objects, ``(name, path or model)`` pairs, or a ``{name: path or model}``
    dict. ``settings`` are :class:`ServeConfig` fields. Models load and warm up in a
    background thread once the app starts; ``/v2/health/ready`` (and ``/health``) turns 200
    when all are ready, and ``/v1/models`` lists an LLM once it is.
    ``app.state.kiln`` is the :class:`~kiln.serving.repository.ServerState`."""
    config = config or ServeConfig(**settings)
    state = ServerState(resolve_models(models), config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=state.load_all, name="kiln-serve-load", daemon=True).start()
        try:
            yield
        finally:
            await state.shutdown()

    app = Starlette(routes=routes(), lifespan=lifespan, middleware=[Middleware(RetryAfter)],
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.kiln = state
    app.state.embedders = load_embedders(config.embeddings, state.models)
    return app
