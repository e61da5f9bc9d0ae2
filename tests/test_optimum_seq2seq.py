"""kiln.optimum.neuron.NeuronModelForSeq2SeqLM (Optimum Neuron's T5 class) on a tiny random T5
saved to a directory: the decoder step with its static KV cache gives transformers eager's
logits at every step; ``generate`` gives transformers' ``model.generate`` tokens exactly,
greedy and beam search (the cache following the beams), on a padded batch of rows of
different lengths; save_pretrained reloads in a fresh process without recompiling and without
T5's modeling code; a directory saved before the cache (no-cache decoder, whose right padding
never changes an earlier position) still loads; ``kiln export`` infers the task and
validates; the limits fixed at export are clear errors.

Two exports are shared by the module: greedy (``kiln export`` on the command line) and
num_beams=2 (``from_pretrained(export=True)`` in process); a third model, without the cache,
reuses the greedy export's encoder and compiles only its decoder."""
import json
import os
import shutil
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kiln.errors import ArtifactError, CompilerArgsError  # noqa: E402
from kiln.optimum import neuron  # noqa: E402
from kiln.optimum.neuron import exporter  # noqa: E402
from tests import forkserver  # noqa: E402

SHAPES = dict(batch_size=2, sequence_length=8)
FAST = dict(optlevel="1", disable_neuron_cache=True)
# two rows of different lengths, the second padded (pad 0, mask 0); 1 is </s>
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 1], [11, 12, 13, 1, 0, 0, 0, 0]])
MASK = (IDS != 0).to(torch.int64)
NEW = 8


def _t5_config():
    # at T5's default initialization a random model repeats one token; initializer_factor=2 and
    # seed 36 give varied tokens, an early </s> in one row, beams that differ from greedy, and
    # float32 answers within 2e-5 of float64 ones (larger factors make attention ill-conditioned)
    return transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                 num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                 initializer_factor=2.0)


def _tokenizer():
    """A word-level tokenizer built offline (w3 ... w63 are ids 3 ... 63)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                unk_token="<unk>")


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("t5") / "ckpt"
    torch.manual_seed(36)
    transformers.T5ForConditionalGeneration(_t5_config()).eval().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf(t5_dir):
    return transformers.T5ForConditionalGeneration.from_pretrained(t5_dir).eval()


def _kiln(*args, env=None):
    return forkserver.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.fixture(scope="module")
def cli_export(t5_dir, tmp_path_factory):
    """``kiln export --task auto`` of the T5 directory (greedy: num_beams defaults to 1), with 10
    decoder positions for 8 input tokens (the beam export keeps the default, 8)."""
    out = tmp_path_factory.mktemp("cli") / "t5-kiln"
    run = _kiln("export", "-m", t5_dir, "--task", "auto", "--batch_size", "2", "--sequence_length", "8",
                "--decoder_sequence_length", "10", "-O1", "--disable_neuron_cache", str(out))
    return run, str(out)


@pytest.fixture(scope="module")
def greedy(cli_export):
    run, out = cli_export
    assert run.returncode == 0, run.stderr[-3000:]
    return neuron.NeuronModelForSeq2SeqLM.from_pretrained(out)


@pytest.fixture(scope="module")
def beam(t5_dir):
    return neuron.NeuronModelForSeq2SeqLM.from_pretrained(t5_dir, export=True, num_beams=2, **SHAPES, **FAST)


def _hf_generate(hf, ids, mask, **kwargs):
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, **dict(dict(max_new_tokens=NEW), **kwargs))


def test_greedy_generate_equals_transformers_tokens(greedy, hf):
    want = _hf_generate(hf, IDS, MASK)
    # the case is not degenerate: varied tokens, one row ends early with </s> (the rest padded)
    assert len(set(want[1].tolist())) >= 4 and (want[0] == 1).any() and not (want[1] == 1).any()
    got = greedy.generate(IDS, attention_mask=MASK, max_new_tokens=NEW)
    assert got.tolist() == want.tolist()
    # one row of a model compiled for two (the batch filled), and a prompt shorter than compiled
    short, short_mask = IDS[1:, :4], MASK[1:, :4]
    assert greedy.generate(short, attention_mask=short_mask, max_new_tokens=NEW).tolist() == \
        _hf_generate(hf, short, short_mask).tolist()
    # without max_new_tokens: transformers' default (max_length 20) cut to the compiled decoder length
    assert greedy.generate(IDS, attention_mask=MASK).tolist() == _hf_generate(hf, IDS, MASK, max_new_tokens=10).tolist()
    # a forced decoder prefix (3 of the 8 decoder positions), then 6 new tokens
    prefix = torch.tensor([[0, 5, 9], [0, 7, 7]])
    assert greedy.generate(IDS, attention_mask=MASK, decoder_input_ids=prefix, max_new_tokens=6).tolist() == \
        _hf_generate(hf, IDS, MASK, decoder_input_ids=prefix, max_new_tokens=6).tolist()


def test_beam_search_equals_transformers_tokens(beam, hf):
    want = _hf_generate(hf, IDS, MASK, num_beams=2)
    assert want.tolist() != _hf_generate(hf, IDS, MASK).tolist()       # beams change the answer here
    assert beam.generate(IDS, attention_mask=MASK, max_new_tokens=NEW).tolist() == want.tolist()
    assert beam.generate(IDS, attention_mask=MASK, max_new_tokens=NEW, num_beams=2).tolist() == want.tolist()


def _reference_logits(hf, decoder_ids, ids=IDS, mask=MASK):
    with torch.no_grad():
        hidden = hf.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        return hidden, hf(encoder_outputs=(hidden,), attention_mask=mask, decoder_input_ids=decoder_ids,
                          use_cache=False).logits


def test_cached_decoder_step_logits_equal_transformers_at_every_step(greedy, hf):
    """The decoder step with its static KV cache, one token a step for all 10 compiled decoder
    positions, on two rows of different input lengths: each step's logits equal transformers
    eager's at that position (1e-4); so do a cache-less call on a whole prefix and forward()."""
    assert greedy.kv_cache and greedy.cross is not None
    decoder_ids = torch.randint(2, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    decoder_ids[:, 0] = 0                                               # decoder_start_token_id
    hidden, want = _reference_logits(hf, decoder_ids)
    cache = greedy.new_cache()
    for t in range(10):
        got = greedy.decode(decoder_ids[:, t:t + 1], hidden, MASK, cache=cache)
        assert got.shape == (2, 1, 64) and cache.get_seq_length() == t + 1
        torch.testing.assert_close(got[:, 0], want[:, t], atol=1e-4, rtol=0, msg=f"step {t}")
    with pytest.raises(ValueError, match="decoder sequence of 11 tokens does not fit"):
        greedy.decode(decoder_ids[:, :1], hidden, MASK, cache=cache)
    torch.testing.assert_close(greedy.decode(decoder_ids[:, :7], hidden, MASK)[:, 0], want[:, 6], atol=1e-4, rtol=0)
    # the forward of the model as transformers calls it: the encoder run too
    out = greedy(input_ids=IDS, attention_mask=MASK, decoder_input_ids=decoder_ids[:, :5])
    torch.testing.assert_close(out.logits[:, 0], want[:, 4], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.encoder_last_hidden_state[MASK.bool()], hidden[MASK.bool()], atol=1e-5, rtol=1e-5)


def test_beam_rows_share_cross_attention_and_the_cache_follows_the_beams(beam, hf, monkeypatch):
    """Four rows (two inputs x two beams): the cross-attention keys run once per input, and
    beam search reorders the cache rows (not only in the identity order) on the way to
    transformers' tokens."""
    from kiln.optimum.neuron import seq2seq_cache
    hidden, _ = _reference_logits(hf, torch.zeros(2, 1, dtype=torch.int64))
    calls, orders, graph = [], [], beam.cross
    monkeypatch.setattr(beam, "cross", lambda h: calls.append(tuple(h.shape)) or graph(h))
    cross = beam.cross_attention(hidden.repeat_interleave(2, dim=0))
    assert calls == [(2, 8, 16)]                                       # one call on the two distinct rows
    assert len(cross) == 4 and cross[0].shape == (4, 2, 8, 8)           # 2 layers' keys and values, 4 rows
    torch.testing.assert_close(cross[1][0], cross[1][1])
    assert not torch.equal(cross[1][1], cross[1][2])
    reorder = seq2seq_cache.StaticSeq2SeqCache.reorder_cache
    monkeypatch.setattr(seq2seq_cache.StaticSeq2SeqCache, "reorder_cache",
                        lambda self, idx: orders.append(idx.tolist()) or reorder(self, idx))
    assert beam.generate(IDS, attention_mask=MASK, max_new_tokens=NEW).tolist() == \
        _hf_generate(hf, IDS, MASK, num_beams=2).tolist()
    assert len(orders) >= NEW - 1 and any(o != list(range(4)) for o in orders)


@pytest.fixture(scope="module")
def legacy_dir(greedy, hf, tmp_path_factory):
    """A model without the KV cache, as kiln exported them before it (and still does with
    ``decoder_kv_cache=False`` or for encoder-decoders other than T5): the greedy export's
    encoder and the decoder over the whole prefix, padded to 10 positions; saved, with the
    ``neuron`` section kiln wrote then (no format key)."""
    from kiln.compiler.api import trace
    from kiln.optimum.neuron.seq2seq_graphs import PaddedDecoderGraph
    example = (torch.randint(1, 64, (2, 10)), torch.randn(2, 8, 16), MASK, torch.tensor([3, 9]))
    decoder = trace(PaddedDecoderGraph(hf).eval(), example, optlevel=1, cache=False, quiet=True)
    section = {k: v for k, v in greedy.neuron.items() if k not in ("kiln_seq2seq_format", "decoder_kv_cache")}
    model = neuron.NeuronModelForSeq2SeqLM(greedy.encoder, decoder, greedy.config, section, greedy.generation_config)
    assert not model.kv_cache and model.cross is None
    out = tmp_path_factory.mktemp("legacy") / "t5-kiln"
    model.save_pretrained(out)
    assert not (out / "cross_attention").exists()
    assert "kiln_seq2seq_format" not in json.loads((out / "config.json").read_text())["neuron"]
    return out


def test_an_export_without_the_kv_cache_still_loads_and_generates(legacy_dir, hf, tmp_path):
    model = neuron.NeuronModelForSeq2SeqLM.from_pretrained(legacy_dir)
    assert not model.kv_cache and model.cross is None
    assert model.generate(IDS, attention_mask=MASK, max_new_tokens=NEW).tolist() == _hf_generate(hf, IDS, MASK).tolist()
    # its decoder sees every prefix padded on the right to 10 tokens: the padding never changes
    # the logits of the last real token
    decoder_ids = torch.randint(2, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    hidden, want = _reference_logits(hf, decoder_ids)
    for t in range(1, 11):
        got = model.decode(decoder_ids[:, :t], hidden, MASK)
        torch.testing.assert_close(got[:, 0], want[:, t - 1], atol=1e-5, rtol=1e-5, msg=f"position {t - 1}")
    with pytest.raises(ValueError, match="use_cache=True: this model's decoder graph has no KV cache"):
        model.generate(IDS, attention_mask=MASK, use_cache=True)
    newer = tmp_path / "newer"
    shutil.copytree(legacy_dir, newer)
    config = json.loads((newer / "config.json").read_text())
    config["neuron"]["kiln_seq2seq_format"] = 3
    (newer / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="saved in kiln_seq2seq_format 3; this kiln reads formats 1 to 2"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(newer)


def test_dynamic_batch_runs_a_larger_batch_in_chunks(greedy, beam, hf):
    three = torch.cat([IDS, torch.tensor([[9, 1, 0, 0, 0, 0, 0, 0]])])
    three_mask = (three != 0).to(torch.int64)
    want = _hf_generate(hf, three, three_mask)
    assert want[2].tolist() == [0, 1] + [0] * (NEW - 1)      # the second chunk is one token long: padded
    with pytest.raises(ValueError, match="Unable to pad 3 rows to the compiled batch_size 2: export with a larger "
                                         "batch_size \\(or dynamic_batch_size=True\\)"):
        greedy.generate(three, attention_mask=three_mask, max_new_tokens=NEW)
    # the same graphs with dynamic_batch_size=True: 2 rows, then 1, padded to one width as transformers pads
    dynamic = neuron.NeuronModelForSeq2SeqLM(greedy.encoder, greedy.decoder, greedy.config,
                                             dict(greedy.neuron, dynamic_batch_size=True), greedy.generation_config,
                                             cross=greedy.cross)
    assert dynamic.generate(three, attention_mask=three_mask, max_new_tokens=NEW).tolist() == want.tolist()
    # chunks are padded with what generate fills finished rows with: the call's pad_token_id, and under
    # beam search the end-of-sequence id for a pad id of 0 (they were padded with the config's pad id)
    assert (dynamic.generate(three, attention_mask=three_mask, max_new_tokens=NEW, pad_token_id=5).tolist()
            == _hf_generate(hf, three, three_mask, pad_token_id=5).tolist())
    beams = neuron.NeuronModelForSeq2SeqLM(beam.encoder, beam.decoder, beam.config,
                                           dict(beam.neuron, dynamic_batch_size=True), beam.generation_config,
                                           cross=beam.cross)
    want = _hf_generate(hf, three, three_mask, num_beams=2)
    assert beams.generate(three, attention_mask=three_mask, max_new_tokens=NEW).tolist() == want.tolist()
    # a forced decoder prefix is cut into the chunks' rows too (each chunk was given the whole batch's)
    prefix = torch.tensor([[0, 7, 9], [0, 9, 7], [0, 5, 6]])
    assert (dynamic.generate(three, attention_mask=three_mask, decoder_input_ids=prefix, max_new_tokens=NEW).tolist()
            == _hf_generate(hf, three, three_mask, decoder_input_ids=prefix).tolist())


def test_limits_fixed_at_export_are_clear_errors(greedy, beam, t5_dir, tmp_path):
    with pytest.raises(ValueError, match="num_beams=2: this model was exported with num_beams=1.*export with "
                                         "num_beams=2"):
        greedy.generate(IDS, attention_mask=MASK, num_beams=2)
    with pytest.raises(ValueError, match="num_beams=1: this model was exported with num_beams=2"):
        beam.generate(IDS, attention_mask=MASK, num_beams=1)
    long = torch.ones(1, 9, dtype=torch.int64)
    with pytest.raises(ValueError, match="Unable to pad 9 input tokens to the compiled sequence_length 8: export "
                                         "with a larger sequence_length"):
        greedy.generate(long)
    with pytest.raises(ValueError, match="max_new_tokens=11 exceeds the 10 new tokens the compiled "
                                         "decoder_sequence_length 10 allows: export with decoder_sequence_length=11"):
        greedy.generate(IDS, attention_mask=MASK, max_new_tokens=11)
    with pytest.raises(ValueError, match="max_new_tokens=9 exceeds the 8 new tokens the compiled "
                                         "decoder_sequence_length 8 allows"):
        beam.generate(IDS, attention_mask=MASK, max_new_tokens=9)
    with pytest.raises(ValueError, match="max_length=12 \\(11 new tokens\\) exceeds the 10 new tokens"):
        greedy.generate(IDS, attention_mask=MASK, max_length=12)
    # a generation_config given to generate asks as a keyword does (it was cut to fit without a word)
    with pytest.raises(ValueError, match="the generation_config's max_new_tokens=11 exceeds the 10 new tokens"):
        greedy.generate(IDS, attention_mask=MASK, generation_config=transformers.GenerationConfig(
            max_new_tokens=11, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0))
    with pytest.raises(ValueError, match="num_return_sequences=2 samples 4 decoder rows for 2 prompt"):
        greedy.generate(IDS, attention_mask=MASK, do_sample=True, num_return_sequences=2, max_new_tokens=2)
    prefix = torch.zeros(2, 3, dtype=torch.int64)       # a forced decoder prefix takes decoder positions too
    with pytest.raises(ValueError, match="max_new_tokens=9 exceeds the 8 new tokens.*decoder_sequence_length=11"):
        greedy.generate(IDS, attention_mask=MASK, decoder_input_ids=prefix, max_new_tokens=9)
    with pytest.raises(ValueError, match="decoder sequence of 11 tokens does not fit the compiled "
                                         "decoder_sequence_length 10"):
        greedy.decode(torch.zeros(1, 11, dtype=torch.int64), torch.zeros(1, 8, 16))
    with pytest.raises(CompilerArgsError, match="pass sequence_length"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(t5_dir, export=True, batch_size=1)
    with pytest.raises(CompilerArgsError, match="decoder_sequence_length must be a positive integer"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(t5_dir, export=True, decoder_sequence_length=0, **SHAPES)
    with pytest.raises(FileNotFoundError, match="pass export=True"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(t5_dir)
    bart = tmp_path / "bart"
    bart_config = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                          decoder_ffn_dim=32, max_position_embeddings=32)
    transformers.BartForConditionalGeneration(bart_config).save_pretrained(bart)
    with pytest.raises(CompilerArgsError, match="decoder_kv_cache=True: kiln builds the cached decoder step for T5"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(bart, export=True, decoder_kv_cache=True, **SHAPES)


RELOAD = """
import json, sys, torch
sys.modules["transformers.models.t5.modeling_t5"] = None      # T5's modeling code cannot be imported
import kiln.optimum.neuron.seq2seq_graphs as graphs
def no_compile(*a, **k):
    raise SystemExit("recompiled")
graphs.trace = no_compile
from kiln.optimum.neuron import NeuronModelForSeq2SeqLM
ids, mask = torch.tensor(json.loads(sys.argv[3])), torch.tensor(json.loads(sys.argv[4]))
out = {}
for name, path in (("greedy", sys.argv[1]), ("beam", sys.argv[2])):
    model = NeuronModelForSeq2SeqLM.from_pretrained(path)
    out[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8).tolist()
    out[name + "_tokenizer"] = [type(p).__name__ for p in model.preprocessors]
print(json.dumps(out))
"""


def test_save_pretrained_reloads_in_a_fresh_process(greedy, beam, cli_export, hf, tmp_path):
    out = tmp_path / "beam"
    beam.save_pretrained(out)
    files = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            os.path.join("encoder", "model.kiln"), os.path.join("encoder", "config.json"),
            os.path.join("cross_attention", "model.kiln"), os.path.join("cross_attention", "config.json"),
            os.path.join("decoder", "model.kiln"), os.path.join("decoder", "config.json")} <= files
    section = json.loads((out / "config.json").read_text())["neuron"]
    assert section["compiler_type"] == "kiln" and section["task"] == "text2text-generation"
    assert (section["static_batch_size"], section["static_sequence_length"], section["static_num_beams"],
            section["static_decoder_sequence_length"]) == (2, 8, 2, 8)
    assert section["input_names"] == ["input_ids", "attention_mask", "decoder_input_ids"]
    assert section["output_names"] == ["logits"]
    assert (section["kiln_seq2seq_format"], section["decoder_kv_cache"]) == (2, True)
    decoder = json.loads((out / "decoder" / "config.json").read_text())["neuron"]
    assert decoder["input_names"] == ["decoder_input_ids", "decoder_position", "encoder_attention_mask",
                                      "past_key_0", "past_key_1", "past_value_0", "past_value_1", "cross_key_0",
                                      "cross_key_1", "cross_value_0", "cross_value_1"]
    assert decoder["output_names"] == ["logits", "new_keys", "new_values"] and decoder["model_type"] == "t5-decoder"
    cross = json.loads((out / "cross_attention" / "config.json").read_text())["neuron"]
    assert cross["input_names"] == ["encoder_hidden_states"] and len(cross["output_names"]) == 4
    assert json.loads((out / "generation_config.json").read_text())["decoder_start_token_id"] == 0
    env = dict(os.environ, KILN_CACHE_URL="off")
    run = forkserver.run([sys.executable, "-c", RELOAD, cli_export[1], str(out), json.dumps(IDS.tolist()),
                          json.dumps(MASK.tolist())], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["greedy"] == _hf_generate(hf, IDS, MASK).tolist()
    assert got["beam"] == _hf_generate(hf, IDS, MASK, num_beams=2).tolist()
    assert got["greedy_tokenizer"] and got["beam_tokenizer"]          # the checkpoint's tokenizer came along


def test_a_directory_of_another_task_is_an_artifact_error(greedy, cli_export, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(cli_export[1], other)
    config = json.loads((other / "config.json").read_text())
    config["neuron"]["task"] = "text-classification"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="exported for task 'text-classification'.*not NeuronModelForSeq2SeqLM"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(other)
    # and the other way round: an encoder class on the seq2seq directory (encoder/, decoder/, no model.kiln)
    with pytest.raises(ArtifactError, match="exported for task 'text2text-generation'.*not "
                                            "NeuronModelForSequenceClassification"):
        neuron.NeuronModelForSequenceClassification.from_pretrained(cli_export[1])
    # a causal LM's directory (a Hugging Face config.json beside kiln's neuron_config.json): it
    # said "is a Hugging Face checkpoint ... pass export=True"
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "neuron"}))
    (causal / "neuron_config.json").write_text(json.dumps({"compiler": "kiln", "task": "text-generation"}))
    with pytest.raises(ArtifactError, match="by kiln as NeuronModelForCausalLM, not NeuronModelForSeq2SeqLM: load "
                                            "it with NeuronModelForCausalLM.from_pretrained"):
        neuron.NeuronModelForSeq2SeqLM.from_pretrained(causal)


def test_kiln_export_infers_the_task_and_validates(cli_export, t5_dir, tmp_path):
    run, out = cli_export
    assert run.returncode == 0, run.stderr[-3000:]
    assert "NeuronModelForSeq2SeqLM (text2text-generation) written to" in run.stdout
    section = json.loads(open(os.path.join(out, "config.json")).read())["neuron"]
    assert (section["static_num_beams"], section["static_decoder_sequence_length"]) == (1, 10)
    line = next(x for x in run.stdout.splitlines() if x.startswith("validated against the source model"))
    errors = json.loads(line[line.index("{"):])
    assert set(errors) == {"last_hidden_state", "logits"} and max(errors.values()) <= 1e-4
    assert exporter.infer_task(t5_dir) == "text2text-generation"
    # an encoder task of an encoder-decoder fitted nothing and failed inside T5 ("exactly one of input_ids...")
    with pytest.raises(CompilerArgsError, match="--task feature-extraction does not fit .*an encoder-decoder "
                                                "\\(T5ForConditionalGeneration\\).*--task text2text-generation"):
        exporter.export(t5_dir, str(tmp_path / "fe"), task="feature-extraction", batch_size=1, sequence_length=8)
    # a *ForConditionalGeneration that is not an encoder-decoder (LLaVA-style) is not taken for one
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"],
                                                   "is_encoder_decoder": False}))
    with pytest.raises(CompilerArgsError, match="cannot infer the task"):
        exporter.infer_task(str(llava))


def test_validation_fails_when_the_compiled_model_differs(greedy, t5_dir):
    """check_seq2seq compares against the source weights: a model whose weights changed fails."""
    report = exporter.check_seq2seq(greedy, t5_dir, 1e-4)
    assert report["passed"] and set(report["max_abs_difference"]) == {"last_hidden_state", "logits"}
    from kiln.errors import ValidationError
    with pytest.raises(ValidationError, match="differs from the source model by up to 0.01"):
        exporter.check_seq2seq(_perturbed(greedy), t5_dir, 1e-4)


def _perturbed(model):
    class Shifted:
        def __init__(self, graph):
            self.graph = graph

        def __call__(self, *args):
            out = self.graph(*args)
            return (out[0] if isinstance(out, (list, tuple)) else out) + 1e-2
    return neuron.NeuronModelForSeq2SeqLM(Shifted(model.encoder), model.decoder, model.config, model.neuron,
                                          model.generation_config, cross=model.cross)


@pytest.mark.parametrize("task", ["text2text-generation", "summarization", "translation"])
def test_pipeline_of_a_seq2seq_task_is_a_clear_error(task, cli_export):
    from transformers.pipelines import SUPPORTED_TASKS
    if task in SUPPORTED_TASKS:
        pytest.skip(f"the installed transformers has a {task} pipeline")
    with pytest.raises(ValueError, match=f"has no '{task}' pipeline.*NeuronModelForSeq2SeqLM.generate\\(\\)"):
        neuron.pipeline(task, model=cli_export[1])
