"""The OpenAI-compatible routes over the served LLMs, as vLLM's server speaks them.

==========================================  ==========================================
``GET  /v1/models``                          the LLMs ready to answer (``id`` = the model's name)
``POST /v1/completions``                     text (or token ids) in, text out
``POST /v1/chat/completions``                messages in (the tokenizer's chat template)
==========================================  ==========================================

``"stream": true`` answers with server-sent events, one chunk per piece of text that is
safe to show (:class:`kiln.runtime.text.TextStream`), then a chunk with the finish
reason, a usage chunk when ``stream_options.include_usage`` is set, and ``[DONE]``. A
client that disconnects, streaming or not, cancels its generation: its KV-cache slot is
free at the next decode step.

Settings: ``max_tokens`` (``max_completion_tokens`` in chat), ``temperature`` (0: greedy),
``top_p``, ``seed``, ``stop`` (strings), and vLLM's ``top_k``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``. Settings kiln does not implement (``n`` > 1, logprobs,
presence/frequency penalties, tools...) and unknown fields are a 400, never silently
ignored. Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad request (a prompt longer than the largest context bucket included), 404
for an unknown model, 429 at once when the model's queue is full, 503 while loading;
both with ``Retry-After``. ``/v1/models`` lists a model only once it answers (loaded,
warmed up, its scheduler running; not while the server drains), so a client that polls it
until the model appears never meets that 503.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kiln.errors import (BadRequestError, BodyTimeoutError, BodyTooLargeError, InputError, OverloadedError)
from kiln.runtime.sampling import SamplingParams
from kiln.serving.body import read_body
from kiln.serving.logs import log

COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "repetition_penalty", "stop_token_ids", "ignore_eos", "n", "user", "presence_penalty",
          "frequency_penalty", "logprobs", "logit_bias"}
FIELDS = {"completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                            "response_format", "parallel_tool_calls"}}
RETRY_AFTER = "1"      # seconds, on a 429 (queue full) or a 503 (loading, draining)
UNSUPPORTED = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "top_logprobs": None,
               "echo": False, "best_of": 1, "suffix": None, "logit_bias": None, "tools": None,
               "tool_choice": None, "parallel_tool_calls": None}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER} if self.status in (429, 503) else None
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


# -- reading requests ----------------------------------------------------------------------------
async def read_json(request: Request, config) -> dict:
    try:
        body = await read_body(request, config.max_request_bytes, config.body_timeout_s)
    except (BadRequestError, BodyTooLargeError, BodyTimeoutError) as e:
        raise OpenAIError(400, str(e)) from None
    try:
        payload = json.loads(body)
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    return payload


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
        raise OpenAIError(503, f"model '{name}' is not ready ({sm.state.lower()})", "service_unavailable")
    return sm


def llm_names(state) -> list:
    return [n for n, sm in state.models.items() if getattr(sm, "kind", None) == "llm"]


def answering(state, sm) -> bool:
    """Whether a request to ``sm`` now would be answered: what ``/v1/models`` lists."""
    return getattr(sm, "kind", None) == "llm" and sm.ready and not state.draining


def check_fields(payload: dict, route: str):
    unknown = sorted(set(payload) - FIELDS[route])
    if unknown:
        raise OpenAIError(400, f"unknown field(s) {unknown}; kiln accepts {sorted(FIELDS[route])}", param=unknown[0])
    for key, neutral in UNSUPPORTED.items():
        value = payload.get(key, neutral)
        if value not in (neutral, None, False) and not (key == "logit_bias" and value == {}):
            raise OpenAIError(400, f"'{key}' = {value!r} is not supported by kiln's server (it supports "
                                   f"{key} = {neutral!r})", param=key)


def field(payload, key, kind, default, check=None, message=""):
    value = payload.get(key, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or (check and not check(value)):
        raise OpenAIError(400, f"'{key}' must be {message or kind.__name__}; got {value!r}", param=key)
    return value


def sampling_of(payload: dict) -> SamplingParams:
    temperature = field(payload, "temperature", float, 1.0, lambda v: v >= 0, "a number >= 0")
    top_p = field(payload, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    top_k = field(payload, "top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0: off)")
    penalty = field(payload, "repetition_penalty", float, 1.0, lambda v: v > 0, "a number > 0")
    seed = field(payload, "seed", int, None)
    greedy = temperature == 0
    return SamplingParams(do_sample=not greedy, temperature=1.0 if greedy else temperature,
                          top_k=max(top_k, 0), top_p=top_p, repetition_penalty=penalty, seed=seed)


def stops_of(payload: dict) -> tuple:
    stop = payload.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OpenAIError(400, f"'stop' must be a string or a list of strings; got {payload.get('stop')!r}",
                          param="stop")
    return tuple(stop)


def stop_ids_of(payload: dict, sm) -> tuple:
    ids = field(payload, "stop_token_ids", list, [], lambda v: all(isinstance(i, int) for i in v),
                "a list of token ids")
    eos = () if field(payload, "ignore_eos", bool, False) else sm.stop_token_ids
    return tuple(sorted(set(eos) | set(ids)))


def prompt_of(payload: dict, sm) -> list:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one
    if isinstance(prompt, str):
        return sm.require_tokenizer().encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = sm.llm.meta["vocab_size"]
        if not all(0 <= t < vocab for t in prompt):
            raise OpenAIError(400, f"token ids in 'prompt' must be in [0, {vocab})", param="prompt")
        return prompt
    raise OpenAIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                      param="prompt")


def messages_of(payload: dict) -> list:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OpenAIError(400, "each message needs a 'role' and a 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise OpenAIError(400, "only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(400, "a message's 'content' must be a string or text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


# -- generation --------------------------------------------------------------------------------
class Call:
    """One request's generation and how its answer is written, per route."""

    def __init__(self, route: str, sm, gen, include_usage: bool):
        self.route, self.sm, self.gen, self.include_usage = route, sm, gen, include_usage
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def envelope(self, **extra) -> dict:
        kind = {"chat": "chat.completion", "completions": "text_completion"}[self.route]
        return {"id": self.id, "object": kind, "created": self.created, "model": self.sm.name, **extra}

    def usage(self) -> dict:
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def choice(self, text: str | None, finish, *, delta: bool) -> dict:
        if self.route == "completions":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            body = {} if text is None else {"content": text}
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def chunk(self, text, finish=None, first=False) -> str:
        body = self.envelope(choices=[self.choice(text, finish, delta=True)])
        if self.route == "chat":
            body["object"] = "chat.completion.chunk"
            if first:
                body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return sse(body)


def sse(body) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def watch_disconnect(request: Request):
    """Returns when the client has gone away (the body is read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def answer(request: Request, call: Call) -> JSONResponse:
    """Wait for the whole generation (cancelling it if the client leaves); the response."""
    gen, parts = call.gen, []
    gone = asyncio.ensure_future(watch_disconnect(request))
    try:
        while True:
            get = asyncio.ensure_future(gen.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                gen.cancel()
                log("debug", "client_disconnected", model=call.sm.name, stage="generating")
                return JSONResponse({}, status_code=499)
            kind, value = get.result()
            if kind == "text":
                parts.append(value)
                continue
            return finished(call, value, "".join(parts))
    finally:
        gone.cancel()


def finished(call: Call, reason: str, text: str) -> JSONResponse:
    if reason == "error":
        error = call.gen.request.error
        raise OpenAIError(500, f"generation failed: {type(error).__name__}: {error}", "internal_error")
    return JSONResponse(call.envelope(choices=[call.choice(text, reason, delta=False)], usage=call.usage()))


async def stream(call: Call):
    """The server-sent events of a streamed generation; cancelled with the connection."""
    gen, ended = call.gen, False
    try:
        if call.route == "chat":
            yield call.chunk(None, first=True)
        while True:
            kind, value = await gen.events.get()
            if kind == "text":
                yield call.chunk(value)
                continue
            ended = True
            if value == "error":
                error = gen.request.error
                yield sse({"error": {"message": f"generation failed: {type(error).__name__}: {error}",
                                     "type": "internal_error", "param": None, "code": None}})
            else:
                yield call.chunk(None if call.route == "chat" else "", value)
                if call.include_usage:
                    yield sse(call.envelope(object=("chat.completion.chunk" if call.route == "chat"
                                                    else "text_completion"), choices=[], usage=call.usage()))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not ended:
            gen.cancel()


async def handle(request: Request, route: str):
    state = request.app.state.kiln
    try:
        payload = await read_json(request, state.config)
        sm = served_llm(request, payload)
        check_fields(payload, route)
        params, stop = sampling_of(payload), stops_of(payload)
        streaming = field(payload, "stream", bool, False)
        options = field(payload, "stream_options", dict, {}, message="an object")
        include_usage = bool(options.get("include_usage")) and streaming
        if route == "chat":
            prompt = sm.require_tokenizer().encode_chat(messages_of(payload))
            max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
            key = "max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"
            max_tokens = field({key: max_tokens}, key, int, None, lambda v: v >= 1, "an integer >= 1")
        else:
            prompt = prompt_of(payload, sm)
            max_tokens = field(payload, "max_tokens", int, 16, lambda v: v >= 1, "an integer >= 1")
        stop_ids = stop_ids_of(payload, sm)
        gen = sm.submit(prompt, max_tokens, params, stop, stop_ids)
    except OpenAIError as e:
        return e.response()
    except InputError as e:
        return OpenAIError(400, str(e)).response()
    except OverloadedError as e:
        return OpenAIError(429, str(e), "rate_limit_exceeded").response()
    except ClientDisconnect:
        return JSONResponse({}, status_code=499)
    call = Call(route, sm, gen, include_usage)
    if streaming:
        return StreamingResponse(stream(call), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await answer(request, call)
    except OpenAIError as e:
        return e.response()


async def completions(request):
    return await handle(request, "completions")


async def chat_completions(request):
    return await handle(request, "chat")


async def list_models(request):
    """The LLMs that answer now. One still loading (or failed, or draining) is not listed: it
    would answer 503; ``/v2/repository/index`` and ``/v2/models/{name}/ready`` show its state."""
    state = request.app.state.kiln
    data = [{"id": name, "object": "model", "created": sm.created, "owned_by": "kiln",
             "max_model_len": sm.llm.meta["cache_shape"][3]}
            for name, sm in state.models.items() if answering(state, sm)]
    return JSONResponse({"object": "list", "data": data})


def routes() -> list:
    return [Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"])]
