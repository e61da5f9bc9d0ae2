"""Reading an OpenAI request's settings: every field checked, and the ones kiln does not
implement refused by name (a 400), never silently ignored.

The checks follow OpenAI's own limits where it states them: ``stop`` is a string or up to
4 strings, ``top_logprobs`` is 0-20 and needs ``logprobs``, ``max_tokens`` and
``max_completion_tokens`` mean the same thing (both given and different is an error).
"""
from __future__ import annotations

import json
import math

from starlette.responses import JSONResponse

from kiln.errors import BadRequestError, BodyTimeoutError, BodyTooLargeError
from kiln.runtime.sampling import SamplingParams
from kiln.serving.body import read_body

COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stream", "stream_options", "repetition_penalty", "stop_token_ids", "ignore_eos", "n", "user",
          "presence_penalty", "frequency_penalty", "logprobs", "logit_bias"}
FIELDS = {"completions": COMMON | {"prompt", "echo", "best_of", "suffix"},
          "chat": COMMON | {"messages", "top_logprobs", "tools", "tool_choice", "response_format",
                            "parallel_tool_calls"}}
# fields kiln accepts only at their neutral value (anything else is a 400 naming the field)
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "echo": False, "best_of": 1, "suffix": None,
               "logit_bias": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
               "response_format": None}
MAX_STOP = 4            # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = 20   # OpenAI's limit on top_logprobs (and vLLM's on legacy logprobs)
MAX_N = 128             # choices per request (each is a request of its own in the scheduler)
RETRY_AFTER = "1"       # seconds, on a 429 (queue full) or a 503 (loading, draining)


class OpenAIError(Exception):
    """A request OpenAI's way refuses: status, message and OpenAI's error ``type``/``param``/``code``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": RETRY_AFTER} if self.status in (429, 503) else None
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


async def read_json(request, config) -> dict:
    """The request's JSON object, read within the server's body limits."""
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


def check_fields(payload: dict, route: str):
    unknown = sorted(set(payload) - FIELDS[route])
    if unknown:
        raise OpenAIError(400, f"unknown field(s) {unknown}; kiln accepts {sorted(FIELDS[route])}", param=unknown[0])
    for key, neutral in UNSUPPORTED.items():
        value = payload.get(key, neutral)
        if value in (neutral, None, False) or (key == "logit_bias" and value == {}) or (
                key == "response_format" and value == {"type": "text"}):
            continue
        raise OpenAIError(400, f"'{key}' = {value!r} is not supported by kiln's server (it supports "
                               f"{key} = {neutral!r})", param=key)


def field(payload, key, kind, default, check=None, message=""):
    value = payload.get(key, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or (
            kind is float and not math.isfinite(value)) or (check and not check(value)):
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


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling settings of choice ``index`` of an ``n > 1`` request. Choice 0 keeps the
    request's seed (so it equals the same request with ``n = 1``); choice ``i`` draws from a
    seed derived from it (a 64-bit mix of seed and index), so a seeded request gives the
    same ``n`` answers every time without the choices repeating each other. Unseeded
    choices draw from fresh generators; greedy ones are all the same answer."""
    if index == 0 or params.seed is None:
        return params
    mixed = (int(params.seed) * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)
    return SamplingParams(do_sample=params.do_sample, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, repetition_penalty=params.repetition_penalty, seed=mixed)


def stops_of(payload: dict) -> tuple:
    stop = payload.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OpenAIError(400, f"'stop' must be a string or a list of strings; got {payload.get('stop')!r}",
                          param="stop")
    if len(stop) > MAX_STOP:
        raise OpenAIError(400, f"'stop' takes at most {MAX_STOP} strings (OpenAI's limit); got {len(stop)}",
                          param="stop")
    return tuple(stop)


def stop_ids_of(payload: dict, eos: tuple, vocab: int) -> tuple:
    ids = field(payload, "stop_token_ids", list, [], lambda v: all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in v),
                f"a list of token ids in [0, {vocab})")
    eos = () if field(payload, "ignore_eos", bool, False) else eos
    return tuple(sorted(set(eos) | set(ids)))


def max_tokens_of(payload: dict, route: str):
    """``max_completion_tokens`` or its older name ``max_tokens`` (None: as many as the cache
    holds, for chat; 16 for completions, as OpenAI's legacy default)."""
    check = (lambda v: v >= 1, "an integer >= 1")
    new = field(payload, "max_completion_tokens", int, None, *check)
    old = field(payload, "max_tokens", int, None, *check)
    if new is not None and old is not None and new != old:
        raise OpenAIError(400, f"'max_tokens' ({old}) and 'max_completion_tokens' ({new}) disagree; they are "
                               "the same setting (max_tokens is its older name): send one", param="max_tokens")
    value = new if new is not None else old
    return value if value is not None or route == "chat" else 16


def n_of(payload: dict) -> int:
    return field(payload, "n", int, 1, lambda v: 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]")


def logprobs_of(payload: dict, route: str):
    """How many alternatives per token the request wants (None: no logprobs). Chat:
    ``logprobs: true`` and ``top_logprobs`` 0-20; completions: the legacy ``logprobs`` integer."""
    if route == "completions":
        return field(payload, "logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                     f"an integer in [0, {MAX_TOP_LOGPROBS}] (or null)")
    wanted = field(payload, "logprobs", bool, False)
    top = field(payload, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
                f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not wanted:
        raise OpenAIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def prompt_of(payload: dict, tokenizer, vocab: int) -> list:
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab for t in prompt):
            raise OpenAIError(400, f"token ids in 'prompt' must be in [0, {vocab})", param="prompt")
        return prompt
    raise OpenAIError(400, "'prompt' must be a string or a list of token ids (one prompt per request; "
                           "n asks for several answers to it)", param="prompt")


def messages_of(payload: dict) -> list:
    """The messages as the chat template sees them: every key kept (``name``, ``tool_calls``,
    ``tool_call_id``...: the template decides what it renders, as in transformers), text
    parts joined into the content. An assistant message may have no content (one that only
    calls tools); the template then sees none, as transformers drops keys whose value is null."""
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
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant"):
            raise OpenAIError(400, "a message's 'content' must be a string or text parts (or null in an "
                                   "assistant's message)", param="messages")
        out.append({**m, "content": content})
    return out
