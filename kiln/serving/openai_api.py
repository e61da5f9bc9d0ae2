"""The OpenAI-compatible routes over the served LLMs, as vLLM's server speaks them.

==========================================  ==========================================
``GET  /v1/models``                          the LLMs ready to answer (``id`` = the model's name)
``GET  /v1/models/{id}``                     one of them (404 for an unknown id)
``POST /v1/completions``                     text (or token ids) in, text out
``POST /v1/chat/completions``                messages in (the tokenizer's chat template)
``POST /v1/embeddings``                      encoder artifacts (:mod:`kiln.serving.openai_embeddings`)
==========================================  ==========================================

``"stream": true`` answers with server-sent events, one chunk per piece of text that is
safe to show (:class:`kiln.runtime.text.TextStream`), then a chunk with the finish
reason, a usage chunk when ``stream_options.include_usage`` is set, and ``[DONE]``. A
client that disconnects, streaming or not, cancels its generation: its KV-cache slot is
free at the next decode step.

Settings (:mod:`kiln.serving.openai_params`): ``max_completion_tokens`` (or ``max_tokens``),
``temperature`` (0: greedy), ``top_p``, ``seed``, ``stop`` (a string or up to 4), ``n``
(choices, each a request of its own in the scheduler), ``logprobs`` (and ``top_logprobs``
in chat), and vLLM's ``top_k``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``.
Settings kiln does not implement (presence/frequency penalties, tools, ``echo``...) and
unknown fields are a 400 naming them, never silently ignored. The bodies are written by
:mod:`kiln.serving.openai_format`. Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad request (a prompt longer than the largest context bucket included, ``n``
over the queue's size, a chat template failing on the messages), 404 for an unknown model,
429 at once when the model's queue is full, 503 while loading, both with ``Retry-After``;
500 for anything else (a chat template that does not compile), never a bare traceback.
``/v1/models`` lists a model only once it answers (loaded, warmed up, its scheduler
running; not while the server drains), so a client that polls it until the model appears
never meets that 503.
"""
from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kiln.errors import InputError, OverloadedError
from kiln.serving import openai_embeddings
from kiln.serving.logs import log
from kiln.serving.openai_format import Reply, sse
from kiln.serving.openai_params import (OpenAIError, check_fields, choice_params, field, logprobs_of,
                                        max_tokens_of, messages_of, n_of, prompt_of, read_json, sampling_of,
                                        stop_ids_of, stops_of)

__all__ = ["OpenAIError", "routes", "read_json"]


# -- reading requests ----------------------------------------------------------------------------
def served_llm(request: Request, payload: dict):
    state = request.app.state.kiln
    name = payload.get("model")
    if not isinstance(name, str) or not name:
        raise OpenAIError(400, "'model' is required: one of " + ", ".join(llm_names(state)), param="model")
    sm = state.models.get(name)
    if sm is None or getattr(sm, "kind", None) != "llm":
        raise OpenAIError(404, f"The model `{name}` does not exist. This server serves: "
                               f"{', '.join(llm_names(state)) or 'no LLMs'}", "NotFoundError", "model",
                          "model_not_found")
    if not answering(state, sm):
        # why: a failed model's error (a tensor-parallel rank that died), not just its state
        why = (sm.error if sm.error and sm.state == "UNAVAILABLE" else
               "the server is shutting down" if state.draining else sm.state.lower())
        raise OpenAIError(503, f"model '{name}' is not ready ({why})", "service_unavailable")
    return sm


def llm_names(state) -> list:
    return [n for n, sm in state.models.items() if getattr(sm, "kind", None) == "llm"]


def answering(state, sm) -> bool:
    """Whether a request to ``sm`` now would be answered: what ``/v1/models`` lists."""
    return getattr(sm, "kind", None) == "llm" and sm.ready and not state.draining


def submit_all(sm, n: int, prompt, max_tokens, params, stop, stop_ids, logprobs) -> list:
    """The request's ``n`` generations, sharing one event queue; none if any is refused. More
    choices than the queue holds could never all be queued: a 400, not a 429 to retry."""
    limit = sm.scheduler.max_queue
    if n > limit:
        raise OpenAIError(400, f"n = {n} choices exceed what this server can ever queue for one request: its "
                               f"queue holds {limit} requests (kiln serve --max-queue {limit}), and each "
                               "choice is one", param="n")
    events, gens = asyncio.Queue(), []
    try:
        for i in range(n):
            gens.append(sm.submit(prompt, max_tokens, choice_params(params, i), stop, stop_ids,
                                  logprobs=logprobs, index=i, events=events))
    except BaseException:
        for g in gens:
            g.cancel()
        raise
    return gens


# -- answering -----------------------------------------------------------------------------------
async def watch_disconnect(request: Request):
    """Returns when the client has gone away (the body is read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def cancel_all(reply: Reply):
    for g in reply.gens:
        g.cancel()


def failure(reply: Reply, index: int) -> str:
    error = reply.gens[index].request.error
    return f"generation failed: {type(error).__name__}: {error}"


async def answer(request: Request, reply: Reply) -> JSONResponse:
    """Wait for every choice's whole generation (cancelling them if the client leaves)."""
    n = len(reply.gens)
    texts, entries, reasons = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    events = reply.gens[0].events
    gone = asyncio.ensure_future(watch_disconnect(request))
    try:
        while None in reasons:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                cancel_all(reply)
                log("debug", "client_disconnected", model=reply.sm.name, stage="generating")
                return JSONResponse({}, status_code=499)
            index, kind, value, lp = get.result()
            entries[index] += lp
            if kind == "text":
                texts[index].append(value)
            elif value == "error":
                cancel_all(reply)
                raise OpenAIError(500, failure(reply, index), "internal_error")
            else:
                reasons[index] = value
        return JSONResponse(reply.whole(["".join(t) for t in texts], reasons, entries))
    finally:
        gone.cancel()


async def stream(reply: Reply):
    """The server-sent events of a streamed generation (every choice's chunks, as they come,
    each with its ``index``); cancelled with the connection."""
    events, ended, left = reply.gens[0].events, False, len(reply.gens)
    try:
        if reply.route == "chat":
            for i in range(left):
                yield reply.chunk(i, None, first=True)
        while left:
            index, kind, value, lp = await events.get()
            if kind == "text":
                yield reply.chunk(index, value, entries=lp)
                continue
            if value == "error":
                yield sse({"error": {"message": failure(reply, index), "type": "internal_error", "param": None,
                                     "code": None}})
                yield "data: [DONE]\n\n"
                return
            yield reply.chunk(index, None if reply.route == "chat" else "", value, entries=lp)
            left -= 1
        ended = True
        if reply.include_usage:
            yield reply.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            cancel_all(reply)


def start(payload: dict, route: str, sm) -> tuple:
    """(reply, streaming): the request's settings read and checked, its generations queued."""
    check_fields(payload, route)
    params, stop = sampling_of(payload), stops_of(payload)
    streaming = field(payload, "stream", bool, False)
    options = field(payload, "stream_options", dict, {}, message="an object")
    include_usage = field(options, "include_usage", bool, False, message="true or false")   # "no" was true
    n, logprobs, max_tokens = n_of(payload), logprobs_of(payload, route), max_tokens_of(payload, route)
    tokenizer, vocab = sm.require_tokenizer(), sm.llm.meta["vocab_size"]
    if route == "chat":
        prompt = tokenizer.encode_chat(messages_of(payload))
    else:
        prompt = prompt_of(payload, tokenizer, vocab)
    gens = submit_all(sm, n, prompt, max_tokens, params, stop, stop_ids_of(payload, sm.stop_token_ids, vocab),
                      logprobs)
    return Reply(route, sm, gens, include_usage and streaming), streaming


async def handle(request: Request, route: str):
    state = request.app.state.kiln
    try:
        payload = await read_json(request, state.config)
        sm = served_llm(request, payload)
        reply, streaming = start(payload, route, sm)
    except OpenAIError as e:
        return e.response()
    except InputError as e:
        return OpenAIError(400, str(e)).response()
    except OverloadedError as e:
        return OpenAIError(429, str(e), "rate_limit_exceeded").response()
    except ClientDisconnect:
        return JSONResponse({}, status_code=499)
    except Exception as e:  # noqa: BLE001 - a broken chat template, a bug: OpenAI's body, not a traceback
        log("error", "request_failed", route=route, error=f"{type(e).__name__}: {e}")
        return OpenAIError(500, f"{type(e).__name__}: {e}", "internal_error").response()
    if streaming:
        return StreamingResponse(stream(reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await answer(request, reply)
    except OpenAIError as e:
        return e.response()


async def completions(request):
    return await handle(request, "completions")


async def chat_completions(request):
    return await handle(request, "chat")


def listed(request) -> list:
    """The LLMs (and embedding models) that answer now. One still loading (or failed, or
    draining) is not listed: it would answer 503; ``/v2/repository/index`` and
    ``/v2/models/{name}/ready`` show its state."""
    state = request.app.state.kiln
    data = [{"id": name, "object": "model", "created": sm.created, "owned_by": "kiln",
             "max_model_len": sm.llm.meta["cache_shape"][3]}
            for name, sm in state.models.items() if answering(state, sm)]
    return data + openai_embeddings.listed(request)


async def list_models(request):
    return JSONResponse({"object": "list", "data": listed(request)})


async def retrieve_model(request):
    """One model of ``/v1/models`` (the ``openai`` client's ``models.retrieve``); an LLM this
    server has but that does not answer yet is a 503 (it is loading), any other a 404."""
    name = request.path_params["model"]
    found = [m for m in listed(request) if m["id"] == name]
    if found:
        return JSONResponse(found[0])
    if getattr(request.app.state.kiln.models.get(name), "kind", None) == "llm":
        return OpenAIError(503, f"model '{name}' is not ready", "service_unavailable").response()
    return OpenAIError(404, f"The model `{name}` does not exist", "invalid_request_error", "model",
                       "model_not_found").response()


def routes() -> list:
    return [Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", openai_embeddings.embeddings, methods=["POST"])]
