"""``POST /v1/embeddings``: OpenAI's embeddings route over the encoder artifacts served with
``--embeddings name=DIR`` (:mod:`kiln.serving.embeddings` says how texts become vectors).

``input`` is a string, a list of strings, a list of token ids or a list of such lists (up to
2048 inputs, OpenAI's limit; none empty); ``encoding_format`` is ``float`` (default) or
``base64`` (little-endian float32, what the ``openai`` client asks for by default);
``dimensions`` is accepted only when it equals the model's (truncating a model that was not
trained for it would change what the vectors mean); ``user`` is accepted and unused.
``usage.prompt_tokens`` counts the inputs' tokens (special tokens included, padding not).
The batches run through the model's batcher, so they share batches with other requests
and the KServe route's limits apply: ``--timeout`` to the whole request, ``--max-queue`` to
it as one request (admitted whole when the queue has room, or refused with 429 before any of
its batches is queued; then its batches go through the queue a few at a time, at most two
per instance at once, so a request of 2048 inputs is never refused for its own size). An
embeddings request counts in ``kiln_serve_requests_total`` and the other request metrics
under its model's name once its body names a served embedding model.
"""
from __future__ import annotations

import asyncio
import base64

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from kiln.errors import BadRequestError, InputError, ModelUnavailableError, OverloadedError, RequestTimeoutError
from kiln.serving.batching import duration
from kiln.serving.logs import log
from kiln.serving.openai_params import OpenAIError, read_json

FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048


def embedders(request: Request) -> dict:
    return getattr(request.app.state, "embedders", None) or {}


def ready(state, sm) -> bool:
    return sm is not None and sm.ready and not state.draining


def listed(request: Request) -> list:
    """``/v1/models`` entries of the embedding models that answer now."""
    state = request.app.state.kiln
    return [{"id": name, "object": "model", "created": 0, "owned_by": "kiln"}
            for name in embedders(request) if ready(state, state.models.get(name))]


def inputs_of(payload: dict) -> list:
    """The request's inputs as strings and token-id lists."""
    x = payload.get("input")
    if isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in x)):
        x = [x]
    bad = OpenAIError(400, "'input' must be a string, a list of strings, a list of token ids or a list of "
                           "token-id lists", param="input")
    if not isinstance(x, list) or not x:
        raise bad
    for item in x:
        if isinstance(item, str):
            if not item:
                raise OpenAIError(400, "an 'input' string is empty", param="input")
        elif not (isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in item)):
            raise bad
    if len(x) > MAX_INPUTS:
        raise OpenAIError(400, f"'input' has {len(x)} items; at most {MAX_INPUTS}", param="input")
    return x


def check(payload: dict) -> str:
    unknown = sorted(set(payload) - FIELDS)
    if unknown:
        raise OpenAIError(400, f"unknown field(s) {unknown}; kiln accepts {sorted(FIELDS)}", param=unknown[0])
    fmt = payload.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise OpenAIError(400, f"'encoding_format' must be 'float' or 'base64'; got {fmt!r}",
                          param="encoding_format")
    return fmt


def first_failure(done):
    """Raise the first of ``done``'s failures (every one of them retrieved)."""
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        raise errors[0]


async def run_batches(sm, plan, tokens: list, pad_id: int, timeout: float) -> list:
    """Each batch through the model's batcher; the first output of each, per batch. The
    request is admitted once, as a whole (a full queue refuses it before anything is
    queued), then its batches are submitted a window at a time (two per instance: every
    instance busy, the queue not flooded), within one deadline. A batch that fails (or times
    out) fails the request and cancels the rest: nothing of it stays queued."""
    batches = plan.batches(tokens, pad_id)
    for _, flat, _ in batches:
        sm.check_inputs(flat)
    b = sm.batcher
    b.admit()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    window = 2 * len(b.instances)
    outs: list = [None] * len(batches)

    async def one(k, flat):
        timed_out = RequestTimeoutError(f"model '{sm.name}': request timed out after {duration(timeout)}")
        left = deadline - loop.time()
        if left <= 0:
            raise timed_out
        try:
            outs[k] = (await b.submit(flat, flat[0].shape[0] if b.batching else 1, left, admitted=True))[0]
        except RequestTimeoutError:     # the request's own limit, not what was left of it
            raise timed_out from None

    running: set = set()
    try:
        for k, (_, flat, _) in enumerate(batches):
            if len(running) >= window:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                first_failure(done)
            running.add(asyncio.ensure_future(one(k, flat)))
        while running:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            first_failure(done)
    finally:
        for task in running:                # a failure (or the handler cancelled): drop the rest
            task.cancel()
        if running:
            await asyncio.wait(running)
            for task in running:
                if not task.cancelled():
                    task.exception()        # seen: no "exception never retrieved" in the log
    return [(idx, flat, out) for (idx, flat, _), out in zip(batches, outs)]


async def embed(request: Request, payload: dict):
    state = request.app.state.kiln
    name = payload.get("model")
    table = embedders(request)
    if not isinstance(name, str) or name not in table:
        raise OpenAIError(404, f"The model `{name}` does not exist or does not serve embeddings. This server's "
                               f"embedding models: {', '.join(table) or 'none (kiln serve --embeddings name=DIR)'}",
                          "NotFoundError", "model", "model_not_found")
    fmt = check(payload)
    sm, embedder = state.models[name], table[name]
    if not ready(state, sm):
        raise OpenAIError(503, f"model '{name}' is not ready ({sm.state.lower()})", "service_unavailable")
    plan = embedder.bind(sm)
    tokens = embedder.tokenize(inputs_of(payload))
    longest = max(len(t) for t in tokens)
    limit = min(plan.max_length, embedder.max_seq_length or plan.max_length)
    if longest > limit:
        raise OpenAIError(400, f"an input has {longest} tokens; model '{name}' takes at most {limit} (its "
                               "compiled sequence length); shorten it, or compile longer buckets", param="input")
    vectors = [None] * len(tokens)
    for idx, flat, hidden in await run_batches(sm, plan, tokens, embedder.pad_id, state.config.timeout_s):
        pooled = embedder.pool(hidden, flat[plan.names.index("attention_mask")])
        for r, i in enumerate(idx):
            vectors[i] = pooled[r]
    dims = payload.get("dimensions")
    if dims is not None and dims != vectors[0].numel():
        raise OpenAIError(400, f"'dimensions' = {dims!r}: model '{name}' makes {vectors[0].numel()}-dimensional "
                               "embeddings and kiln does not truncate them (the model was not trained for it)",
                          param="dimensions")
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, fmt)} for i, v in enumerate(vectors)]
    count = sum(len(t) for t in tokens)
    return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": count, "total_tokens": count}}


def encoded(v, fmt: str):
    if fmt == "float":
        return v.tolist()
    return base64.b64encode(v.numpy().astype("<f4").tobytes()).decode("ascii")


# an embeddings answer's status -> its failure reason in kiln_serve_request_failures_total
REASONS = {429: "overloaded", 503: "unavailable", 504: "timeout", 500: "internal", 499: "disconnected"}


async def embeddings(request: Request):
    """``POST /v1/embeddings``, counted in the request metrics under the model it names."""
    state = request.app.state.kiln
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        payload = await read_json(request, state.config)
    except OpenAIError as e:
        return e.response()
    except ClientDisconnect:
        return JSONResponse({}, status_code=499)
    name = payload.get("model")
    if not isinstance(name, str) or name not in embedders(request):
        return await answer(request, payload)      # a 404: no model to count it under
    m = state.metrics
    m.requests.labels(name).inc()
    gauge = m.in_flight.labels(name)
    gauge.inc()
    state.in_flight += 1
    try:
        response = await answer(request, payload)
    finally:
        gauge.dec()
        state.in_flight -= 1
    if response.status_code == 200:
        m.request_seconds.labels(name).observe(loop.time() - start)
    else:
        m.failures.labels(name, REASONS.get(response.status_code, "bad_request")).inc()
    return response


async def answer(request: Request, payload: dict):
    """The response to an embeddings request: the embeddings, or the error OpenAI's way."""
    try:
        return JSONResponse(await embed(request, payload))
    except OpenAIError as e:
        return e.response()
    except (InputError, BadRequestError) as e:
        return OpenAIError(400, str(e)).response()
    except OverloadedError as e:
        return OpenAIError(429, str(e), "rate_limit_exceeded").response()
    except ModelUnavailableError as e:
        return OpenAIError(503, str(e), "service_unavailable").response()
    except RequestTimeoutError as e:
        return OpenAIError(504, str(e), "timeout").response()
    except Exception as e:  # noqa: BLE001 - one request's failure is its own
        log("error", "embedding_failed", model=payload.get("model"), error=f"{type(e).__name__}: {e}")
        return OpenAIError(500, f"embedding failed: {type(e).__name__}: {e}", "internal_error").response()
