"""Writing OpenAI's response bodies: choices, chunks, usage and logprobs, in the shapes the
``openai`` package's own types parse (``ChatCompletion``, ``Completion`` and their chunks).

Logprobs are the model's own distribution at each step (the raw ``log_softmax`` of the
logits, before temperature or truncation, as OpenAI and vLLM report them), for every
generated token, the end-of-sequence token included, but for the tokens of a stop string
(the answer leaves them out, so do its logprobs): without a stop string, ``len(content)``
equals ``usage.completion_tokens``. A token's ``token`` is its text decoded alone (special
tokens spelled out). The rest comes from the stream that writes the answer
(:class:`kiln.serving.llm.Generation`): chat's ``bytes`` are what the token adds to the
answer's UTF-8, so they join to exactly the answer's bytes (a byte-level token that is half
a character has its real byte, though its text reads ``\ufffd``; a special token, which the
answer leaves out, has none); completions' ``text_offset`` is where the token's text starts
in the completion's text, in characters. Chat answers ``choice.logprobs.content = [{token,
logprob, bytes, top_logprobs: [...]}]``; completions answer the legacy ``{tokens,
token_logprobs, top_logprobs: [{token: logprob}], text_offset}``.
"""
from __future__ import annotations

import json
import time
import uuid


def sse(body) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class Reply:
    """One request's answer (``n`` choices, one :class:`~kiln.serving.llm.Generation`
    each), written per route."""

    def __init__(self, route: str, sm, gens: list, include_usage: bool):
        self.route, self.sm, self.gens, self.include_usage = route, sm, gens, include_usage
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.logprobs = gens[0].request.logprobs is not None

    def envelope(self, **extra) -> dict:
        kind = {"chat": "chat.completion", "completions": "text_completion"}[self.route]
        return {"id": self.id, "object": kind, "created": self.created, "model": self.sm.name, **extra}

    def usage(self) -> dict:
        """The prompt counted once (every choice shares it), the choices' tokens summed; with
        speculative decoding, the draft's accepted and rejected proposals."""
        p, c = self.gens[0].prompt_tokens, sum(g.completion_tokens for g in self.gens)
        out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        counts = [g.draft_counts() for g in self.gens]
        if any(x is not None for x in counts):
            accepted = sum(x[0] for x in counts if x is not None)
            proposed = sum(x[1] for x in counts if x is not None)
            out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                "rejected_prediction_tokens": proposed - accepted}
        return out

    # -- logprobs -------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return self.sm.tokenizer.decode([token], skip_special_tokens=False)

    def logprobs_body(self, entries: list):
        """The choice's ``logprobs`` for ``entries`` (``[(token, logprob, [(id, logprob)],
        offset, bytes)]``, :class:`~kiln.serving.llm.Generation`'s)."""
        if not self.logprobs:
            return None
        if self.route == "chat":
            def one(token, logprob, raw=None):
                text = self.token_text(token)
                if raw is None:
                    raw = self.sm.tokenizer.token_bytes(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode() if raw is None else raw)}
            return {"content": [{**one(t, lp, raw), "top_logprobs": [one(i, v) for i, v in top]}
                                for t, lp, top, _, raw in entries], "refusal": None}
        return {"tokens": [self.token_text(e[0]) for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [{self.token_text(i): v for i, v in e[2]} for e in entries],
                "text_offset": [e[3] for e in entries]}

    # -- bodies -----------------------------------------------------------------------------
    def choice(self, index: int, text: str | None, finish, entries=(), *, delta: bool) -> dict:
        logprobs = self.logprobs_body(list(entries))
        if self.route == "completions":
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if delta:
            body = {} if text is None else {"content": text}
            return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def whole(self, texts: list, reasons: list, entries: list) -> dict:
        """The non-streamed answer."""
        choices = [self.choice(i, texts[i], reasons[i], entries[i], delta=False) for i in range(len(self.gens))]
        return self.envelope(choices=choices, usage=self.usage())

    def chunk(self, index: int, text, finish=None, entries=(), first=False) -> str:
        body = self.envelope(choices=[self.choice(index, text, finish, entries, delta=True)])
        if self.route == "chat":
            body["object"] = "chat.completion.chunk"
            if first:
                body["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return sse(body)

    def usage_chunk(self) -> str:
        kind = "chat.completion.chunk" if self.route == "chat" else "text_completion"
        return sse(self.envelope(object=kind, choices=[], usage=self.usage()))
