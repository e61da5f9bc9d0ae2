"""Text in and out of a compiled LLM, without transformers: the tokenizer stored in the
artifact, its chat template, and streaming detokenization with stop strings.

* :class:`Tokenizer` reads the files ``save_pretrained`` wrote (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``) with the ``tokenizers`` library,
  which is what transformers' fast tokenizers run, so ids are the same.
* The chat template is rendered by Jinja in its immutable sandbox, in the environment
  transformers renders it in (``transformers.utils.chat_template_utils``): loop controls
  (``{% break %}``, ``{% continue %}``), ``{% generation %}`` blocks, its ``tojson`` (no HTML
  escaping), ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``; the messages
  with their keys whose value is None dropped, and the tokenizer's named special tokens. The
  template is data from the artifact and must not reach Python objects.
* :class:`TextStream` turns tokens into text as they come. It holds text back while it
  ends in an incomplete UTF-8 character (a byte-level token can carry half of one) or
  could still be the start of a stop string, so a streamed reply never shows a stop
  string or a broken character, and the concatenated deltas equal the final text. It
  knows where each token's text starts in that text (:meth:`TextStream.start`).
"""
from __future__ import annotations

import datetime
import json

from kiln.errors import ArtifactError, InputError
from kiln.runtime import chat_limits

# transformers' named special tokens (``SPECIAL_TOKENS_ATTRIBUTES``), passed to the chat template
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")    # transformers' names of a message's reasoning


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
        # what decode(skip_special_tokens=True) leaves out
        self.special_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        self._bytes = _byte_scheme(self.backend)
        # sentencepiece's <0xNN> tokens: a run of them decodes as one group, its UTF-8 or, if
        # that is invalid, one U+FFFD a byte, so a run's text can change until the run ends
        self.byte_fallback_ids = frozenset(
            i for t, i in self.backend.get_vocab().items()
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">")) if self._bytes == "fallback" else frozenset()

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

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes ``token`` stands for where the vocabulary spells bytes (GPT-2's byte-level
        alphabet, sentencepiece's ``<0xNN>``): a token that is half a UTF-8 character has its
        real bytes. Empty for a special token (the text leaves it out); None where the
        vocabulary's tokens are text (a piece's bytes then depend on its neighbours, as
        sentencepiece's word-initial space does)."""
        if token in self.special_ids:
            return b""
        piece = self.backend.id_to_token(token) if self._bytes is not None else None
        if isinstance(self._bytes, dict) and piece is not None and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        if self._bytes == "fallback" and piece is not None and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        return None

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ..., ...}]``), rendered
        as transformers' ``apply_chat_template(..., tokenize=False)`` renders it. A template
        that does not compile is an ArtifactError; one that fails on these messages (its
        ``raise_exception``, an undefined value used) an InputError."""
        import jinja2
        if not self.chat_template:
            raise InputError("this model's tokenizer has no chat template; use a completion instead")
        if self._compiled_template is None:
            try:
                self._compiled_template = _chat_environment().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ArtifactError(f"this model's chat template does not compile (line {e.lineno}: {e.message}); "
                                    "use completions instead") from None
        special = {k: self.token(k) for k in SPECIAL_TOKENS if self.token(k) is not None}
        chat_limits.start()
        try:
            return self._compiled_template.render(
                messages=[_chat_message(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **special)
        except InputError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError,
                RecursionError, MemoryError) as e:
            raise InputError(f"the chat template could not render these messages: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list) -> list:
        """Token ids of the chat prompt; the template writes the special tokens itself."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def _chat_message(m: dict) -> dict:
    """A message as transformers hands it to the template: keys whose value is None dropped,
    its reasoning under each name templates read."""
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _raise(message):
    raise InputError(f"the chat template refused the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.datetime.now().strftime(format)


def _chat_environment():
    """transformers' chat-template environment (``_compile_jinja_template``), but for its
    assistant-mask tracking: a ``{% generation %}`` block renders its body."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:            # dict() without the class's attributes
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):     # no underscore-prefixed attributes
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, chat_limits.sized(value, f"namespace value {name!r}"))

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r} (underscore-prefixed)")

    class Bounded(ImmutableSandboxedEnvironment):       # what a template may make (kiln.runtime.chat_limits)
        intercepted_binops = frozenset(["*", "+", "**", "%"])

        def call_binop(self, context, operator, left, right):
            return chat_limits.binop(self.binop_table, operator, left, right)

        def call(*args, **kwargs):
            for value in (*args[3:], *kwargs.values()):
                chat_limits.sized(value, "a call's argument")
            return chat_limits.sized(ImmutableSandboxedEnvironment.call(*args, **kwargs), "a call's result")

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["replace"] = chat_limits.replace(env.filters["replace"])
    env.filters.update({name: chat_limits.filtered(name, fn) for name, fn in env.filters.items()})
    env.globals["range"] = chat_limits.counted_range(env.globals["range"])
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


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


def _byte_scheme(backend):
    """How the vocabulary spells bytes: GPT-2's byte-level alphabet (a dict), sentencepiece's
    ``<0xNN>`` byte fallback ("fallback"), or None (tokens are text)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return _gpt2_bytes()
    return "fallback" if "ByteFallback" in kinds else None


CONTEXT = 6     # tokens decoded before the new ones (TextStream._decoded)


def _partial(text: str) -> int:
    """How many replacement characters end ``text`` (half a character so far), without
    copying it."""
    n = len(text)
    while n and text[n - 1] == "\ufffd":
        n -= 1
    return len(text) - n


class TextStream:
    """Incremental detokenization with stop strings (module doc). ``push(token)`` returns
    the text now safe to show; ``stopped`` turns true when a stop string appears (the
    text before it has been returned, the stop string never is); ``finish()`` returns
    what was held back once no more tokens come.

    Per token it records how far the text decoded through it reaches, so :meth:`start`
    says where the token's text begins in ``text`` (special tokens add nothing; a token
    that is part of a character starts where the character does), :meth:`shown` whether
    its text has been returned, and :meth:`removed` whether a stop string took it."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list = []
        self.text = ""          # everything decoded so far (final text once finished)
        self.sent = 0           # characters of self.text already returned
        self.stopped = False
        self.whole: list = []   # per token: characters of whole characters decoded through it (before a cut)
        self.reach: list = []   # per token: characters decoded through it, a partial one included
        # Incremental decoding: ids[:_base] are settled, their text is _settled; each push
        # decodes only from CONTEXT tokens before _base (_head is those tokens' own text).
        self._base, self._settled, self._head = 0, "", ""
        self._run = None        # where the trailing run of <0xNN> tokens starts (Tokenizer.byte_fallback_ids)

    def push(self, token: int) -> str:
        if self.stopped:
            self.whole.append(self.whole[-1])
            self.reach.append(float("inf"))
            return ""
        token = int(token)
        if token in self.tokenizer.byte_fallback_ids:
            self._run = len(self.ids) if self._run is None else self._run
        elif token not in self.tokenizer.special_ids:     # skipped special tokens do not end a run
            self._run = None
        self.ids.append(token)
        self.text = self._decoded()
        last = (self.whole[-1], self.reach[-1]) if self.whole else (0, 0)
        self.whole.append(max(last[0], len(self.text) - _partial(self.text)))
        self.reach.append(max(last[1], len(self.text)))
        for s in self.stop:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        return self._release(final=self.stopped)

    def finish(self) -> str:
        return self._release(final=True)

    def _decoded(self) -> str:
        """``tokenizer.decode(self.ids)``, in time independent of the text's length.

        Decoding everything at each token made a long reply quadratic (0.44 ms a token at
        4,096 tokens, on the server's event loop, per stream). Decoders act token by token
        except at the text's start (sentencepiece drops the first word's space, WordPiece
        does not join a first ``##``) and inside a UTF-8 character split over byte tokens,
        so the tokens since the last settled point are decoded after :data:`CONTEXT` tokens
        before it, and that context's own text is cut off the front (vLLM's incremental
        detokenization does the same). A window whose front reads differently from the
        context alone falls back to decoding everything. A point is settled only where the
        text does not end in half a character."""
        ctx = max(0, self._base - CONTEXT)
        window = self.tokenizer.decode(self.ids[ctx:])
        if window.startswith(self._head):
            text = self._settled + window[len(self._head):]
        else:
            text = self.tokenizer.decode(self.ids)
        if len(self.ids) - self._base >= CONTEXT and not _partial(text) and self._run is None:
            self._base, self._settled = len(self.ids), text
            self._head = self.tokenizer.decode(self.ids[max(0, self._base - CONTEXT):])
        return text

    def start(self, k: int) -> int:
        """Where token ``k``'s text begins in ``text``."""
        return min(self.whole[k - 1] if k else 0, len(self.text))

    def shown(self, k: int) -> bool:
        """Whether token ``k``'s text has all been returned."""
        return min(self.reach[k], len(self.text)) <= self.sent

    def removed(self, k: int) -> bool:
        """Whether token ``k``'s text lies in (or after) the stop string cut off the text."""
        return self.stopped and (self.whole[k - 1] if k else 0) >= len(self.text) and self.reach[k] > len(self.text)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= _partial(self.text)                  # half a character so far
            if self._run is not None:                   # a run of <0xNN> tokens may still turn to U+FFFD
                end = min(end, self.start(self._run))
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
