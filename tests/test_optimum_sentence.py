"""kiln.optimum.neuron's NeuronSentenceTransformers against the installed sentence-transformers on
the same directory (tiny random BERTs saved by sentence-transformers itself): Dense modules
applied (never dropped), any other module refused by name, encode()'s keywords (prompt,
prompt_name and the saved default prompt, output_value, precision, truncate_dim, unknown keywords
refused), similarity_fn_name and similarity_pairwise, do_lower_case, sentence-transformers 6's
saved format and the older 0_Transformer/ layout; and the encoder checks that live beside it:
an empty sequence, RoBERTa's position offset, the class a directory was exported as."""
import json
import os
import shutil
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("sentence_transformers")

from kiln.errors import ArtifactError, CompilerArgsError, InputError  # noqa: E402
from kiln.optimum import neuron  # noqa: E402
from kiln.optimum.neuron.exported import check_positions  # noqa: E402

FAST = dict(optlevel="1", disable_neuron_cache=True)
ATOL = 1e-5
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "paris", "is", "capital", "of", "france",
         "what", "where", "who", "blue", "sky", "sea", "query", ":", "passage"]
TEXTS = ["The Cat sat on the MAT", "where is Paris", "what is the capital of France the blue sky the sea far",
         "a dog"]


def _bert(directory) -> str:
    """A tiny random BERT with a cased tokenizer (so do_lower_case matters)."""
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).eval().save_pretrained(directory)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS))
    transformers.BertTokenizerFast(os.path.join(directory, "vocab.txt"), do_lower_case=False).save_pretrained(
        directory)
    return directory


def _edit(path, **changes):
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Mean pooling, Dense(32->16, tanh), Dense(16->8, identity, residual), Normalize; prompts with
    a default, manhattan similarity, do_lower_case, max_seq_length 12; the pooling config in the
    older pooling_mode_*_tokens keys. Returns (directory, sentence-transformers, kiln)."""
    from sentence_transformers import SentenceTransformer, models
    base = _bert(str(tmp_path_factory.mktemp("bert")))
    directory = str(tmp_path_factory.mktemp("st_dense") / "st")
    torch.manual_seed(1)
    modules = [models.Transformer(base, max_seq_length=12), models.Pooling(32, "mean"),
               models.Dense(32, 16, activation_function=torch.nn.Tanh()),
               models.Dense(16, 8, activation_function=None, use_residual=True), models.Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts={"query": "query : ", "passage": "passage : "},
                        default_prompt_name="query", similarity_fn_name="manhattan").save(directory)
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True,
                   "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False}, f)
    with open(os.path.join(directory, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 12, "do_lower_case": True}, f)
    ref = SentenceTransformer(directory, device="cpu")
    model = neuron.NeuronSentenceTransformers.from_pretrained(directory, export=True, batch_size=2,
                                                              sequence_length=16, **FAST)
    return directory, ref, model


def test_dense_modules_applied_as_sentence_transformers(dense):
    """Two Dense modules (one with a residual) after the pooling, then Normalize: [4, 8]
    embeddings equal sentence-transformers' (were [4, 32]: the Dense modules were dropped)."""
    _, ref, model = dense
    want = ref.encode(TEXTS, convert_to_tensor=True, prompt="")
    got = model.encode(TEXTS, convert_to_tensor=True, prompt="")
    assert got.shape == want.shape == (4, 8)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_prompts_default_prompt_and_lowercase(dense):
    """The saved default prompt applies when none is given, prompt_name picks a saved one,
    prompt= wins; do_lower_case lowercases the text (the tokenizer is cased)."""
    _, ref, model = dense
    for kw in ({}, {"prompt_name": "passage"}, {"prompt": "where : "}, {"prompt_name": "query"}):
        torch.testing.assert_close(model.encode(TEXTS, convert_to_tensor=True, **kw),
                                   ref.encode(TEXTS, convert_to_tensor=True, **kw), atol=ATOL, rtol=0)
    assert not torch.allclose(model.encode(TEXTS[0], convert_to_tensor=True),
                              model.encode(TEXTS[0], convert_to_tensor=True, prompt=""))
    with pytest.raises(ValueError, match="Prompt name 'nope' not found"):
        model.encode(TEXTS, prompt_name="nope")


def test_encode_keywords_as_sentence_transformers(dense):
    """output_value='token_embeddings' (each text's unpadded tokens) and None (a dict per
    text), truncate_dim, precision (int8, binary), numpy and list outputs; unknown keywords
    are a ValueError, as in sentence-transformers."""
    _, ref, model = dense
    got, want = model.encode(TEXTS, output_value="token_embeddings"), ref.encode(TEXTS, output_value="token_embeddings")
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    got, want = model.encode(TEXTS, output_value=None, batch_size=2), ref.encode(TEXTS, output_value=None, batch_size=2)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            if isinstance(w[k], torch.Tensor) and w[k].is_floating_point():
                torch.testing.assert_close(g[k], w[k], atol=ATOL, rtol=0)
            else:
                assert (g[k] == w[k]) if not isinstance(w[k], torch.Tensor) else torch.equal(g[k], w[k])
    torch.testing.assert_close(model.encode(TEXTS, convert_to_tensor=True, truncate_dim=4, normalize_embeddings=True),
                               ref.encode(TEXTS, convert_to_tensor=True, truncate_dim=4, normalize_embeddings=True),
                               atol=ATOL, rtol=0)
    for precision in ("int8", "binary"):
        g, w = model.encode(TEXTS, precision=precision), ref.encode(TEXTS, precision=precision)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert abs(g.astype(int) - w.astype(int)).max() <= 1
    one = model.encode(TEXTS[1])
    assert one.shape == (8,) and abs(one - ref.encode(TEXTS[1])).max() < ATOL
    assert isinstance(model.encode(TEXTS, convert_to_numpy=False), list)
    with pytest.raises(ValueError, match="bogus"):
        model.encode(TEXTS, bogus=1)
    with pytest.raises(ValueError, match="Precision 'int4'"):
        model.encode(TEXTS, precision="int4")


def test_similarity_functions_as_sentence_transformers(dense):
    """The saved similarity_fn_name (manhattan: a negative distance), then each of the four,
    as similarity and similarity_pairwise."""
    _, ref, model = dense
    a = ref.encode(TEXTS, convert_to_tensor=True)
    b = a.flip(0)
    assert model.similarity_fn_name == ref.similarity_fn_name == "manhattan"
    for name in ("manhattan", "cosine", "dot", "euclidean"):
        model.similarity_fn_name = ref.similarity_fn_name = name
        torch.testing.assert_close(model.similarity(a, b), ref.similarity(a, b), atol=ATOL, rtol=0)
        torch.testing.assert_close(model.similarity_pairwise(a, b), ref.similarity_pairwise(a, b), atol=ATOL, rtol=0)
    model.similarity_fn_name = ref.similarity_fn_name = "manhattan"
    assert float(model.similarity(a[:1], a[:1])) == 0.0 and float(model.similarity(a, b).max()) <= 0


def test_saved_and_reloaded_keeps_the_modules(dense, tmp_path):
    """save_pretrained keeps the Dense weights, prompts, similarity function and lowercasing;
    a reload answers as sentence-transformers."""
    _, ref, model = dense
    model.save_pretrained(tmp_path / "kiln")
    again = neuron.NeuronSentenceTransformers.from_pretrained(tmp_path / "kiln")
    assert again.similarity_fn_name == "manhattan"
    torch.testing.assert_close(again.encode(TEXTS, convert_to_tensor=True), ref.encode(TEXTS, convert_to_tensor=True),
                               atol=ATOL, rtol=0)
    # the saved plan names each Dense's activation class; loading imports torch.nn's only
    # (importing `this` would print the Zen of Python: any other module runs its code)
    config = json.loads((tmp_path / "kiln" / "config.json").read_text())
    dense_step = [s for s in config["neuron"]["sentence_transformers"]["steps"] if s["type"] == "Dense"][0]
    dense_step["activation_function"] = "this.Zen"
    (tmp_path / "kiln" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompilerArgsError, match="not a torch.nn module"):
        neuron.NeuronSentenceTransformers.from_pretrained(tmp_path / "kiln").encode(TEXTS)
    assert "this" not in sys.modules


def test_empty_sequence_is_an_input_error(dense):
    """input_ids of shape [1, 0]: an InputError (the model answered made-up values)."""
    with pytest.raises(InputError, match="empty sequence"):
        dense[2](input_ids=torch.ones(1, 0, dtype=torch.long))


def test_sentence_transformers_6_format_in_a_subfolder(tmp_path):
    """A directory as sentence-transformers 6.2 saves it ({"pooling_mode": [...]}, the length in
    tokenizer_config.json's model_max_length) with its encoder moved to 0_Transformer/ (the
    older layout), pooling CLS and max concatenated: equal to sentence-transformers (export
    failed: pooling [] unsupported; and 0_Transformer/ crashed)."""
    from sentence_transformers import SentenceTransformer, models
    base = _bert(str(tmp_path / "bert"))
    directory = str(tmp_path / "st")
    SentenceTransformer(modules=[models.Transformer(base, max_seq_length=10), models.Pooling(32, ("cls", "max"))],
                        device="cpu").save(directory)
    os.makedirs(os.path.join(directory, "0_Transformer"))
    for f in os.listdir(directory):
        if os.path.isfile(os.path.join(directory, f)) and f not in ("modules.json", "config_sentence_transformers.json",
                                                                    "README.md"):
            shutil.move(os.path.join(directory, f), os.path.join(directory, "0_Transformer", f))
    with open(os.path.join(directory, "modules.json")) as f:
        modules = json.load(f)
    modules[0]["path"] = "0_Transformer"
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    ref = SentenceTransformer(directory, device="cpu")
    model = neuron.NeuronSentenceTransformers.from_pretrained(directory, export=True, batch_size=2,
                                                              sequence_length=16, **FAST)
    want = ref.encode(TEXTS, convert_to_tensor=True)
    assert want.shape == (4, 64)
    torch.testing.assert_close(model.encode(TEXTS, convert_to_tensor=True), want, atol=ATOL, rtol=0)


def test_other_module_types_are_refused_by_name(tmp_path):
    """A module kiln does not apply (LayerNorm here) is a CompilerArgsError naming it at export
    (it was dropped silently)."""
    from sentence_transformers import SentenceTransformer, models
    base = _bert(str(tmp_path / "bert"))
    directory = str(tmp_path / "st")
    SentenceTransformer(modules=[models.Transformer(base), models.Pooling(32, "mean"), models.LayerNorm(32)],
                        device="cpu").save(directory)
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:     # the keys any kiln reads
        json.dump({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}, f)
    with pytest.raises(CompilerArgsError, match="LayerNorm"):
        neuron.NeuronSentenceTransformers.from_pretrained(directory, export=True, batch_size=1, sequence_length=8,
                                                          **FAST)


def test_roberta_position_offset_refused_at_export(tmp_path):
    """RoBERTa numbers positions from padding_idx + 1: 18 position embeddings hold 16 tokens, so
    sequence_length=17 is a CompilerArgsError at export (was an IndexError inside the trace)."""
    cfg = transformers.RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=18, pad_token_id=1)
    model = transformers.RobertaModel(cfg).eval()
    model.save_pretrained(tmp_path / "roberta")
    with pytest.raises(CompilerArgsError, match="sequence_length=17 .* 16 tokens"):
        neuron.NeuronModelForFeatureExtraction.from_pretrained(tmp_path / "roberta", export=True, batch_size=1,
                                                               sequence_length=17, **FAST)
    check_positions(model, cfg, 16)              # the largest length that fits passes


def test_wrong_class_names_the_exported_class(tmp_path):
    """A causal LM and an encoder-decoder kiln exported, loaded with an encoder class: the
    message names the class they were exported as (said 'not saved by kiln.optimum')."""
    causal = tmp_path / "causal"
    causal.mkdir()
    transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                             vocab_size=40).save_pretrained(causal)
    (causal / "neuron_config.json").write_text(json.dumps({"compiler": "kiln", "batch_size": 1}))
    (causal / "model.kiln").write_bytes(b"")
    with pytest.raises(ArtifactError, match="by kiln as NeuronModelForCausalLM.*load it with NeuronModelForCausalLM"):
        neuron.NeuronModelForSequenceClassification.from_pretrained(causal)
    seq2seq = tmp_path / "seq2seq"
    seq2seq.mkdir()
    config = transformers.T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=40).to_dict()
    config["neuron"] = {"compiler_type": "kiln", "task": "text2text-generation"}
    (seq2seq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="by kiln as NeuronModelForSeq2SeqLM"):
        neuron.NeuronModelForFeatureExtraction.from_pretrained(seq2seq)
