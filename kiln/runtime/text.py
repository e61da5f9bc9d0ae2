"""Text in and out of a compiled LLM, without transformers: the tokenizer stored in the
artifact, its chat template, and streaming detokenization with stop strings.

* :class:`Tokenizer` reads the files ``save_pretrained`` wrote (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``) with the ``tokenizers`` library,
  which is what transformers' fast tokenizers run, so ids are the same.
* The chat template is rendered by Jinja in its immutable sandbox, as transformers
  renders it: the template is data from the artifact and must not reach Python objects.
* :class:`TextStream` turns tokens into text as they come. It holds text back while it
  ends in an incomplete UTF-8 character (a byte-level token can carry half of one) or
  could still be the start of a stop string, so a streamed reply never shows a stop
  string or a broken character, and the concatenated deltas equal the final text.
"""
from __future__ import annotations

import json

from kiln.errors import ArtifactError, InputError


class Tokenizer:
    def __init__(self, files: dict):
        if "tokenizer.json" not in files:
            raise ArtifactError("this LLM artifact has no tokenizer (compile it with tokenizer=...); "
                                "give token ids instead of text")
        import tokenizers
        self.backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
        self.config = json.loads(files.get("tokenizer_config.json", b"{}"))
        template = files.get("chat_template.jinja")
        self.chat_template = template.decode("utf-8") if template else self.config.get("chat_template")
        self._compiled_template = None

    def token(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def token_id(self, name: str) -> int | None:
        text = self.token(name)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``)."""
        if not self.chat_template:
            raise InputError("this model's tokenizer has no chat template; use a completion instead")
        if self._compiled_template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token("bos_token") or "", eos_token=self.token("eos_token") or "")

    def encode_chat(self, messages: list) -> list:
        """Token ids of the chat prompt; the template writes the special tokens itself."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _raise(message):
    raise InputError(f"the chat template refused the messages: {message}")


class TextStream:
    """Incremental detokenization with stop strings (module doc). ``push(token)`` returns
    the text now safe to show; ``stopped`` turns true when a stop string appears (the
    text before it has been returned, the stop string never is); ``finish()`` returns
    what was held back once no more tokens come."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list = []
        self.text = ""          # everything decoded so far (final text once finished)
        self.sent = 0           # characters of self.text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        return self._release(final=self.stopped)

    def finish(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):            # half a character so far
                end = len(self.text.rstrip("\ufffd"))
            end = min(end, self._before_partial_stop(end))
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out

    def _before_partial_stop(self, end: int) -> int:
        """Where the text must be held back because its tail may begin a stop string."""
        cut = end
        for s in self.stop:
            for n in range(min(len(s) - 1, end), 0, -1):
                if self.text[end - n:end] == s[:n]:
                    cut = min(cut, end - n)
                    break
        return cut
