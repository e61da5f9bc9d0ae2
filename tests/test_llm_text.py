"""The text side of a served LLM, in-process: chat templates rendered as transformers renders
them (the same Jinja environment, the same messages), and the logprob entries a generation
hands the OpenAI routes (each token's place in the answer and the bytes it adds), driven
token by token on a byte-level vocabulary."""
import asyncio
import itertools
import os
import tempfile
from types import SimpleNamespace

import pytest

from kiln.errors import ArtifactError, InputError
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.text import Tokenizer

transformers = pytest.importorskip("transformers")

# templates written the way real ones are (Llama 3.x, Qwen 2.5, SmolLM3, Mistral), each on a
# piece of transformers' environment that kiln's lacked or rendered differently
TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                     "{% if m['content'] == 'STOP' %}{% break %}{% endif %}{{ m['role'][0] }}:{{ m['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}a:{% endif %}",
    "tojson": "{% for m in messages %}{{ m['role'] | tojson }}|{{ m | tojson(indent=2) }}\n{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y') if strftime_now is defined else 'none' }}"
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "message keys": "{% for m in messages %}{% if m.name is defined %}[{{ m.name }}]{% endif %}{{ m.role }}:"
                    "{% if m.content is defined %}{{ m.content }}{% else %}(none){% endif %}"
                    "{% for call in m.tool_calls | default([]) %}<call {{ call.function.name }}("
                    "{{ call.function.arguments }})>{% endfor %}"
                    "{% if m.tool_call_id is defined %}<for {{ m.tool_call_id }}>{% endif %}"
                    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                    "\n{% endfor %}",
    "namespace and dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                          "{% endfor %}{{ ns.n }} {{ dict(a=1) | tojson }} {{ bos_token }}{{ unk_token }}"
                          "{{ pad_token is defined }}",
    "generation block": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
}
MESSAGES = {"messages": [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "a<b & 'c' é", "name": "bob"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    {"role": "assistant", "content": "two", "reasoning_content": "1+1"},
    {"role": "user", "content": [{"type": "text", "text": "again "}, {"type": "text", "text": "please"}]},
    {"role": "user", "content": "STOP"},
]}


def tokenizer_files(tok) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}


def test_chat_templates_render_as_transformers_renders_them():
    """The server's prompt (kiln's Tokenizer on the request's messages, as
    ``openai_params.messages_of`` reads them) is transformers' ``apply_chat_template``:
    loop controls, its tojson (no HTML escaping), strftime_now, the messages' other keys
    (name, tool_calls, tool_call_id, reasoning; null content dropped), namespace, dict,
    the named special tokens and ``{% generation %}`` blocks."""
    from kiln.serving.openai_params import messages_of
    from tests.conftest import tiny_tokenizer
    tok = tiny_tokenizer()
    for name, template in TEMPLATES.items():
        tok.chat_template = template
        want = tok.apply_chat_template(messages_of(MESSAGES), tokenize=False, add_generation_prompt=True)
        got = Tokenizer(tokenizer_files(tok)).apply_chat_template(messages_of(MESSAGES))
        assert got == want, (name, got, want)


def test_chat_template_errors_say_whose_they_are():
    """A template refusing the messages or failing on them is the request's error (InputError,
    a 400); one that does not compile is the artifact's (ArtifactError, a 500)."""
    from tests.conftest import tiny_tokenizer
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "x"}]
    tok.chat_template = "{% if messages[0].role == 'user' %}{{ raise_exception('no users') }}{% endif %}"
    with pytest.raises(InputError, match="refused the messages: no users"):
        Tokenizer(tokenizer_files(tok)).apply_chat_template(messages)
    tok.chat_template = "{{ messages[0].nothing.deeper }}"
    with pytest.raises(InputError, match="could not render these messages: UndefinedError"):
        Tokenizer(tokenizer_files(tok)).apply_chat_template(messages)
    tok.chat_template = "{% for m in messages %}{{ m.content }}"
    with pytest.raises(ArtifactError, match="chat template does not compile \\(line 1"):
        Tokenizer(tokenizer_files(tok)).apply_chat_template(messages)


# -- logprob entries ------------------------------------------------------------------------------
def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: token b is byte b (GPT-2's alphabet), then <s> (256)
    and </s> (257)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from kiln.runtime.text import _gpt2_bytes
    t = tokenizers.Tokenizer(models.BPE(vocab=dict(_gpt2_bytes()), merges=[]))
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), decoders.ByteLevel()
    t.add_special_tokens(["<s>", "</s>"])
    return Tokenizer({"tokenizer.json": t.to_str().encode()})


def generate(tok, tokens, stop=(), reason="length"):
    """Feed ``tokens`` to a Generation as the scheduler would (each with a logprob), then
    finish it: (events, the Generation)."""
    from kiln.serving.llm import Generation

    async def run():
        served = SimpleNamespace(tokenizer=tok, observe_token=lambda r: None, observe_finish=lambda r: None)
        gen = Generation(served, [1], 64, SamplingParams(), tuple(stop), (), logprobs=1)
        r, r.finish_reason = gen.request, reason
        for t in tokens:
            r.tokens.append(t)
            r.token_logprobs.append((-1.0, [(t, -1.0)]))
            if gen._on_token(r, t):
                r.finish_reason = "stop"
                break
        gen._on_finish(r)
        await asyncio.sleep(0)
        return [gen.events.get_nowait() for _ in range(gen.events.qsize())], gen
    return asyncio.run(run())


def test_logprob_entries_place_each_token_in_the_answer():
    """Each token's entry says where its text starts in the answer (``text_offset``) and
    which bytes it adds (chat's ``bytes``): a character split over byte tokens has its real
    bytes, each token starting where the character does; a special token adds none and
    takes no room; the tokens of a stop string have no entry, and one that is partly before
    it adds only that part; an answer cut mid-character ends in U+FFFD's bytes. Joined, the
    bytes are the answer's UTF-8, and the entries come with the chunk bringing their text."""
    from kiln.serving.openai_format import Reply
    tok = byte_tokenizer()

    def utf8(s):
        return list(s.encode())
    cases = [  # tokens, stop strings, finish reason -> answer, [(offset, bytes)] per entry
        (utf8("hé") + [256] + utf8("l€x") + [257], (), "stop", "hél€x",
         [(0, b"h"), (1, b"\xc3"), (1, b"\xa9"), (2, b""), (2, b"l"), (3, b"\xe2"), (3, b"\x82"), (3, b"\xac"),
          (4, b"x"), (5, b"")]),
        (utf8("aé€b"), ("€",), "length", "aé", [(0, b"a"), (1, b"\xc3"), (1, b"\xa9")]),
        (utf8("xyz"), ("yz",), "length", "x", [(0, b"x")]),
        (utf8("ab") + [256] + utf8("cd"), ("cd",), "length", "ab", [(0, b"a"), (1, b"b"), (2, b"")]),
        (utf8("aé") + [0xE2, 0x82], (), "length", "aé\ufffd",
         [(0, b"a"), (1, b"\xc3"), (1, b"\xa9"), (2, b""), (2, "\ufffd".encode())]),
    ]
    for tokens, stop, reason, answer, want in cases:
        events, gen = generate(tok, tokens, stop, reason)
        assert "".join(v for _, kind, v, _ in events if kind == "text") == answer
        entries = [e for *_, lp in events for e in lp]
        assert [(e[3], e[4]) for e in entries] == want, (answer, entries)
        assert b"".join(e[4] for e in entries) == answer.encode()
        # an entry comes with the text it brings: the offsets of a chunk's entries lie in the text so far
        shown = 0
        for _, kind, value, lp in events:
            shown += len(value) if kind == "text" else 0
            assert all(e[3] <= shown for e in lp)
        # the bodies: chat's bytes and completions' text_offset; special tokens spelled out, with no bytes
        sm = SimpleNamespace(tokenizer=tok, name="m")
        chat = Reply("chat", sm, [gen], False).logprobs_body(entries)["content"]
        assert [bytes(c["bytes"]) for c in chat] == [b for _, b in want]
        assert all(c["token"] in ("<s>", "</s>") and c["bytes"] == [] for c, e in zip(chat, entries)
                   if e[0] in tok.special_ids)
        assert Reply("completions", sm, [gen], False).logprobs_body(entries)["text_offset"] == [o for o, _ in want]


# -- incremental detokenization --------------------------------------------------------------------
def decoders_as_shipped() -> dict:
    """Three vocabularies, each with the decoder real tokenizers ship (decode only, so no
    merges): GPT-2's byte level (SmolLM2, Llama 3), sentencepiece's word-initial ``▁`` with
    ``<0xNN>`` byte fallback (Llama 2, Mistral) and WordPiece with its clean-up (BERT)."""
    import tokenizers
    from tokenizers import decoders, models

    from kiln.runtime.text import _gpt2_bytes
    spell = {b: c for c, b in _gpt2_bytes().items()}
    words = ["the", " the", " world", "ing", "é", "中文", "🙂", " ", "\n", ".", "'s", " n't"]
    byte_level = dict(_gpt2_bytes())
    for w in words:
        byte_level.setdefault("".join(spell[b] for b in w.encode()), len(byte_level))
    sp = {f"<0x{b:02X}>": b for b in range(256)}
    for w in ["▁the", "▁world", "ing", "▁", "é", "中", "a", "▁a", ".", "▁."]:
        sp.setdefault(w, len(sp))
    wp = {w: i for i, w in enumerate(["[UNK]", "the", "world", "##ing", "##s", ".", ",", "'", "s", "n", "##'",
                                      "t", "do", "##n", "?", "!", "-", "é", "##é", "a"])}
    made = {}
    for name, model, decoder in [
            ("byte level", models.BPE(vocab=byte_level, merges=[]), decoders.ByteLevel()),
            ("sentencepiece", models.BPE(vocab=sp, merges=[], byte_fallback=True),
             decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                decoders.Strip(" ", 1, 0)])),
            ("wordpiece", models.WordPiece(vocab=wp, unk_token="[UNK]"), decoders.WordPiece(cleanup=True))]:
        t = tokenizers.Tokenizer(model)
        t.decoder = decoder
        t.add_special_tokens(["<s>", "</s>"])
        made[name] = Tokenizer({"tokenizer.json": t.to_str().encode()})
    return made


def streamed(tok, ids):
    from kiln.runtime.text import TextStream
    stream = TextStream(tok)
    out = "".join(stream.push(i) for i in ids) + stream.finish()
    return out, stream


def test_streamed_text_is_the_decoded_text_for_every_decoder():
    """The text a stream hands out, token by token, is ``decode`` of all the tokens, for
    each decoder family, over random token sequences: byte tokens that split characters
    (and invalid UTF-8), special tokens, a first ``##`` piece, sentencepiece's first-word
    space, WordPiece's clean-up around punctuation."""
    import random
    for name, tok in decoders_as_shipped().items():
        size = tok.backend.get_vocab_size()
        rng = random.Random(name)
        for length in (1, 2, 5, 6, 7, 13, 64, 300):
            for _ in range(6):
                ids = [rng.randrange(size) for _ in range(length)]
                out, stream = streamed(tok, ids)
                assert out == stream.text == tok.decode(ids), (name, ids)
                # each token's place in the text: the furthest whole characters decoding
                # everything up to a token before it reached
                whole = list(itertools.accumulate(
                    (len(tok.decode(ids[:k + 1]).rstrip("\ufffd")) for k in range(len(ids))), max))
                assert [stream.start(k) for k in range(len(ids))] == \
                    [min(whole[k - 1], len(stream.text)) if k else 0 for k in range(len(ids))], (name, ids)


def test_a_long_reply_is_decoded_in_linear_time():
    """Each token decodes a bounded number of tokens, however long the reply: decoding all
    of them at every token made a 4,096-token reply cost 0.44 ms a token on the server's
    event loop, per stream. Counted, not timed: the ids handed to ``decode`` over a reply."""
    for name, tok in decoders_as_shipped().items():
        vocab = tok.backend.get_vocab()
        words = [vocab[w] for w in ("Ġworld", "Ġthe", "ing", "▁the", "▁world", "the", "##ing", ".") if w in vocab]
        ids = [words[k % len(words)] for k in range(2000)]
        decoded = []
        real = tok.decode
        tok.decode = lambda got, **kw: decoded.append(len(got)) or real(got, **kw)
        try:
            out, stream = streamed(tok, ids)
        finally:
            del tok.decode
        assert out == real(ids)
        assert sum(decoded) < 30 * len(ids), (name, sum(decoded))


ATTACKS = {     # 80-byte templates that took a server's memory or a core for good (found by probing)
    "repeat": "{{ 'ab' * 2000000000 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling in a namespace": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}{{ ns.s|length }}",
    "doubling by +": "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "power": "{{ 2 ** 100000000 }}",
    "center": "{{ 'a'|center(3000000000) }}",
    "format width": "{{ '%0999999999d' % 1 }}",
    "replace": "{% set ns = namespace(s='aaaa') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}"
               "{% endfor %}",
    "a macro doubling its argument": "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
                                     "{{ f('a', 60) }}",
    "endless recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


def test_a_chat_template_cannot_take_the_memory_or_a_core():
    """The template comes from the artifact: rendering bounds what its operators, filters,
    calls, namespaces and ranges may make (kiln.runtime.chat_limits), so each of these is an
    InputError at once. Run under a 2 GiB address-space limit and a timeout, where the sandbox
    alone made 4 GB strings and looped 10^10 times; a real template still renders."""
    import json
    import subprocess
    import sys
    script = """if True:
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        import tokenizers
        from tokenizers.models import WordLevel
        from kiln.errors import InputError
        from kiln.runtime.text import Tokenizer
        base = tokenizers.Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str().encode()
        out = {}
        for name, template in json.loads(sys.argv[1]).items():
            try:
                Tokenizer({"tokenizer.json": base, "chat_template.jinja": template.encode()}).apply_chat_template(
                    [{"role": "user", "content": "hi"}])
                out[name] = "rendered"
            except InputError as e:
                out[name] = str(e)
        print(json.dumps(out))
    """
    run = subprocess.run([sys.executable, "-c", script, json.dumps(ATTACKS)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    refused = {name: why for name, why in out.items() if why.startswith("the chat template")}
    assert set(refused) == set(ATTACKS), out
    big = "x" * 200_000                 # a long real prompt renders, with ranges, +, % and loops
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] + '\\n' }}{% endfor %}"
                "{{ range(3)|list|length }}{{ (range(5)|reverse|list)[0] }}{% for i in range(2) %}{{ loop.last }}"
                "{% endfor %}{{ '%3d' % 7 }}")
    from tests.conftest import tiny_tokenizer
    tok = tiny_tokenizer()
    tok.chat_template = template
    messages = [{"role": "user", "content": big}]
    assert Tokenizer(tokenizer_files(tok)).apply_chat_template(messages) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
