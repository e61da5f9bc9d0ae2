"""Writing OpenAI's response bodies: choices, chunks, usage and logprobs, in the shapes the
``openai`` package's own types parse (``ChatCompletion``, ``Completion`` and their chunks).

Logprobs are the model's own distribution at each step (the raw ``log_softmax`` of the
logits, before temperature or truncation, as OpenAI and vLLM report them), for every
generated token, the end-of-sequence token included, so ``len(content)`` equals
``usage.completion_tokens``. A token's ``token`` is its text decoded alone (special tokens
spelled out) and ``bytes`` the token's own bytes (:func:`token_bytes`: a byte-level BPE
token that is half a UTF-8 character has its real bytes, though its text reads ``\ufffd``). Chat answers
``choice.logprobs.content = [{token, logprob, bytes, top_logprobs: [...]}]``; completions
answer the legacy ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``,
offsets counted in characters from the start of the completion's text.
"""
from __future__ import annotations

import functools
import json
import time
import uuid


def sse(body) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _gpt2_bytes() -> dict:
    """GPT-2's byte-level alphabet, inverted: the character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=32)
def byte_scheme(tokenizer):
    """How the tokenizer's vocabulary spells bytes: GPT-2's byte-level alphabet (a dict),
    sentencepiece's ``<0xNN>`` byte fallback ("fallback"), or None (tokens are text)."""
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return _gpt2_bytes()
    return "fallback" if "ByteFallback" in kinds else None


def token_bytes(tokenizer, token: int, text: str) -> list:
    """The bytes token ``token`` stands for (``text``: it decoded alone), so that a client
    joining the tokens' bytes gets the answer's UTF-8 even where a character spans tokens."""
    scheme = byte_scheme(tokenizer)
    piece = tokenizer.backend.id_to_token(token) if scheme is not None else None
    if isinstance(scheme, dict) and piece is not None and all(c in scheme for c in piece):
        return [scheme[c] for c in piece]
    if scheme == "fallback" and piece is not None and len(piece) == 6 and piece.startswith("<0x"):
        return [int(piece[3:5], 16)]
    return list(text.encode("utf-8"))


class Reply:
    """One request's answer (``n`` choices, one :class:`~kiln.serving.llm.Generation`
    each), written per route; keeps each streamed choice's text offset."""

    def __init__(self, route: str, sm, gens: list, include_usage: bool):
        self.route, self.sm, self.gens, self.include_usage = route, sm, gens, include_usage
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.logprobs = gens[0].request.logprobs is not None
        self.offsets = [0] * len(gens)      # characters of each choice's text so far (text_offset)

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

    def logprobs_body(self, index: int, entries: list):
        """The choice's ``logprobs`` for ``entries`` (``[(token, logprob, [(id, logprob)])]``)."""
        if not self.logprobs:
            return None
        if self.route == "chat":
            def one(token, logprob):
                text = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": token_bytes(self.sm.tokenizer, token, text)}
            return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]}
                                for t, lp, top in entries], "refusal": None}
        tokens, offsets = [], []
        for t, _, _ in entries:
            tokens.append(self.token_text(t))
            offsets.append(self.offsets[index])
            self.offsets[index] += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{self.token_text(i): v for i, v in top} for _, _, top in entries],
                "text_offset": offsets}

    # -- bodies -----------------------------------------------------------------------------
    def choice(self, index: int, text: str | None, finish, entries=(), *, delta: bool) -> dict:
        logprobs = self.logprobs_body(index, list(entries))
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
