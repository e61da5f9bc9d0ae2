"""A transformers-neuronx script after swapping its import: from_pretrained on a saved
checkpoint, to_neuron(), sample() with top_k=1 giving Hugging Face's greedy tokens."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402


def test_transformers_neuronx_script_runs_after_swapping_the_import(tmp_path, monkeypatch):
    """The tutorials' spelling: save_pretrained_split, LlamaForSampling from its module,
    sample(), and transformers' generate through HuggingFaceGenerationModelAdapter."""
    monkeypatch.setenv("KILN_CACHE_URL", "off")
    from kiln.transformers_neuronx import GPT2ForSampling
    from kiln.transformers_neuronx.generation_utils import HuggingFaceGenerationModelAdapter
    from kiln.transformers_neuronx.llama.model import LlamaForSampling
    from kiln.transformers_neuronx.module import save_pretrained_split
    model = _model("llama")
    save_pretrained_split(model, str(tmp_path / "split"))
    with pytest.raises(CompilerArgsError, match="holds a 'llama' model: use LlamaForSampling"):
        GPT2ForSampling.from_pretrained(str(tmp_path / "split"))
    save_pretrained_split(_model("gpt2"), str(tmp_path / "gpt2"))
    with pytest.raises(CompilerArgsError, match="n_positions=300 exceeds the 128 positions .* n_positions <= 128"):
        GPT2ForSampling.from_pretrained(str(tmp_path / "gpt2"), n_positions=300)
    # n_positions as a list: token-generation buckets (the cache holds the largest)
    neuron = LlamaForSampling.from_pretrained(str(tmp_path / "split"), batch_size=1, n_positions=[16, 32],
                                              tp_degree=1, amp="f32", context_length_estimate=8)
    with pytest.raises(InputError, match="to_neuron"):
        neuron.sample(torch.tensor([[1, 2]]), sequence_length=8)
    neuron.to_neuron()
    assert neuron.compiled.meta["cache_shape"][3] == 32 and sorted(neuron.compiled.windows) == [16]
    prompt = [5, 17, 3, 88]
    out = neuron.sample(torch.tensor([prompt]), sequence_length=20, top_k=1)
    assert out[0, :4].tolist() == prompt
    assert out[0, 4:].tolist() == _hf_greedy(model, prompt, 16)
    streamer = _Streamer()
    assert torch.equal(neuron.sample(torch.tensor([prompt]), sequence_length=20, top_k=1, streamer=streamer), out)
    assert streamer.pieces == [[prompt]] + [[t] for t in out[0, 4:].tolist()] and streamer.ended
    adapter = HuggingFaceGenerationModelAdapter(model.config, neuron)
    adapter.reset_generation()
    ids, mask = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, do_sample=False, max_length=16, pad_token_id=0)
    assert torch.equal(adapter.generate(ids, attention_mask=mask, do_sample=False, max_length=16, pad_token_id=0),
                       want)
    # transformers' streamer through the adapter (an unknown setting before), one row as there
    streamer = _Streamer()
    one = adapter.generate(ids[1:], do_sample=False, max_new_tokens=6, pad_token_id=0, streamer=streamer)
    assert torch.equal(one, want[1:, :11])
    assert streamer.pieces == [ids[1:].tolist()] + [[t] for t in one[0, 5:].tolist()] and streamer.ended
    with pytest.raises(InputError, match="a streamer takes one sequence"):
        adapter.generate(ids, attention_mask=mask, max_new_tokens=2, streamer=_Streamer())


def test_a_neuron_config_save_and_load(tmp_path, monkeypatch):
    """transformers-neuronx's NeuronConfig (it had no such class: the tutorials' import failed)
    sets the rows decoded at once and sample()'s defaults, its layouts change nothing; save()
    and load() keep the compiled model, as on Neuron (they were AttributeErrors)."""
    monkeypatch.setenv("KILN_CACHE_URL", "off")
    from kiln.transformers_neuronx import NeuronAutoModelForCausalLM
    from kiln.transformers_neuronx.config import (GQA, ContinuousBatchingConfig, GenerationConfig, NeuronConfig,
                                                  QuantizationConfig)
    from transformers import AutoModelForCausalLM
    from transformers import GenerationConfig as HFGenerationConfig

    from kiln.errors import PlacementError
    from kiln.host import cores
    from kiln.transformers_neuronx.generation_utils import HuggingFaceGenerationModelAdapter
    model = _model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    # the checkpoint's generation_config.json: generate's defaults through the adapter, as in
    # transformers' generate (they were ignored); sample() reads none of it but the stop token
    HFGenerationConfig(repetition_penalty=1.3, max_new_tokens=8, eos_token_id=2,
                       pad_token_id=0).save_pretrained(tmp_path / "ckpt")
    config = NeuronConfig(continuous_batching=ContinuousBatchingConfig(max_num_seqs=2), fuse_qkv=True,
                          on_device_generation=GenerationConfig(top_k=1), group_query_attention=GQA.SHARD_OVER_HEADS)
    neuron = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), n_positions=32,
                                                        context_length_estimate=8, neuron_config=config)
    assert neuron.batch_size == 2
    neuron.to_neuron()
    prompt = [5, 17, 3, 88]
    out = neuron.sample(torch.tensor([prompt]), sequence_length=12)          # on_device_generation: greedy
    assert out[0, 4:].tolist() == _hf_greedy(model, prompt, 8)
    neuron.save(tmp_path / "compiled")
    again = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), n_positions=32,
                                                       context_length_estimate=8, neuron_config=config)
    again.load(tmp_path / "compiled").to_neuron()                            # read, not compiled
    assert torch.equal(again.sample(torch.tensor([prompt]), sequence_length=12), out)
    with pytest.raises(InputError, match=r"input_ids of shape \[batch, tokens\]"):
        again.sample(torch.tensor(prompt), sequence_length=12)
    with pytest.raises(InputError, match="longer than the largest context_length_estimate \\(8\\)"):
        again.sample(torch.tensor([list(range(3, 12))]), sequence_length=16)
    assert torch.equal(again.sample([prompt], sequence_length=12), out)      # a list, as the tutorials' ids
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    adapter, ids = HuggingFaceGenerationModelAdapter(hf.config, again), torch.tensor([[30, 31, 32, 33]])
    for kw in ({}, {"eos_token_id": None}, {"eos_token_id": 96}, {"eos_token_id": 96, "repetition_penalty": 1.0},
               {"max_new_tokens": None, "max_length": 10, "eos_token_id": 96},
               {"generation_config": HFGenerationConfig(max_length=6, eos_token_id=96)},
               {"generation_config": HFGenerationConfig(eos_token_id=91)}):
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        assert torch.equal(adapter.generate(ids, **kw), want), kw
    assert adapter.generate(ids, eos_token_id=None).shape[1] == 12              # eos 2 twice: no stop token
    # on_device_generation's stop token and length, and sample()'s eos_token_override, are honoured
    stops = NeuronConfig(continuous_batching=ContinuousBatchingConfig(max_num_seqs=2),
                         on_device_generation=GenerationConfig(top_k=1, eos_token_id=60, max_length=10))
    # other shapes given than compiled: the errors name the compiled ones, in transformers-neuronx's names
    other = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), n_positions=64,
                                                       context_length_estimate=[16], neuron_config=stops)
    other.load(tmp_path / "compiled").to_neuron()
    assert other.sample(torch.tensor([prompt]), sequence_length=30).tolist() == [prompt + want_head(out, 60)]
    assert other.sample(torch.tensor([prompt]), sequence_length=30, eos_token_override=65).tolist() == [prompt + [65]]
    with pytest.raises(InputError, match="longer than the largest context_length_estimate \\(8\\)"):
        other.sample(torch.tensor([list(range(3, 12))]), sequence_length=10)
    with pytest.raises(InputError, match="4 prompt tokens \\+ 36 new ones exceed n_positions=32"):
        again.sample(torch.tensor([prompt]), sequence_length=40)
    with pytest.raises(InputError, match="at least one token"):
        again.sample(torch.ones(1, 0, dtype=torch.long), sequence_length=12)
    with pytest.raises(InputError, match="no_repeat_ngram_size=2"):
        again.sample(torch.tensor([prompt]), sequence_length=12, no_repeat_ngram_size=2)
    for bad, named in ((GenerationConfig(do_sample=True, global_top_k=10), "global_top_k=10"),
                       (GenerationConfig(do_sample=True, deterministic=True), "deterministic=True")):
        with pytest.raises(CompilerArgsError, match=named):
            NeuronConfig(on_device_generation=bad)
    # more tensor-parallel ranks than cores: refused before the compile, not at the first sample()
    wide = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), n_positions=32,
                                                      tp_degree=len(cores.visible()) + 1)
    with pytest.raises(PlacementError, match=f"tp_degree={len(cores.visible()) + 1}"):
        wide.to_neuron()
    assert NeuronConfig(quant=QuantizationConfig(quant_dtype="s8")).compile_options() == {"quantize": "int8"}
    with pytest.raises(CompilerArgsError, match="quant_dtype='f8e4m3'"):
        NeuronConfig(quant=QuantizationConfig(quant_dtype="f8e4m3")).compile_options()
    with pytest.raises(CompilerArgsError, match="sparse attention changes the answer"):
        NeuronConfig(sparse_attn=object())
    with pytest.raises(CompilerArgsError, match="NeuronConfig options kiln does not know: \\['bogus'\\]"):
        NeuronConfig(bogus=1)


def want_head(out, eos):
    """The new tokens of ``out``'s first row up to ``eos`` (kept), at most 6 (max_length=10)."""
    new = out[0, 4:10].tolist()
    return new[:new.index(eos) + 1] if eos in new else new


@pytest.mark.parametrize("kw, msg", [({"tp_degree": 0}, "positive integer"), ({"amp": "bf16"}, "fp32 today"),
                                     ({"fuse_qkv": True}, "does not know yet"),
                                     ({"n_positions": []}, "n_positions=\\[\\]: give"),
                                     ({"n_positions": 32, "context_length_estimate": 64},
                                      "context_length_estimate=\\[64\\]: each must lie in \\[1, n_positions=32\\]")])
def test_options_kiln_cannot_honour_are_clear_errors(kw, msg):
    from kiln.transformers_neuronx import NeuronAutoModelForCausalLM
    with pytest.raises(CompilerArgsError, match=msg):
        NeuronAutoModelForCausalLM.from_pretrained("unused", **kw)


class _Streamer:
    """transformers' streamer protocol: put(tensor) per piece, end() once."""

    def __init__(self):
        self.pieces, self.ended = [], False

    def put(self, value):
        self.pieces.append(value.tolist())

    def end(self):
        self.ended = True


def test_fused_speculative_decoder_script_runs_after_swapping_the_import(tmp_path, monkeypatch):
    """transformers-neuronx's speculative script: draft and target to_neuron(), then
    FusedSpeculativeDecoder(draft, target, k).to_neuron() and sample(): the target's greedy
    tokens, streamed prompt first, stopping after eos_token_id."""
    monkeypatch.setenv("KILN_CACHE_URL", str(tmp_path / "cache"))     # the target's graphs are the draft's
    from kiln.transformers_neuronx import NeuronAutoModelForCausalLM
    from kiln.transformers_neuronx.fused_speculation import FusedSpeculativeDecoder
    model = _model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    kw = dict(batch_size=1, n_positions=32, context_length_estimate=8)
    draft = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), **kw)   # the target as its own draft
    target = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), **kw)
    draft.to_neuron()
    target.to_neuron()
    fsd = FusedSpeculativeDecoder(draft, target, 3)
    prompt = [5, 17, 3, 88]
    with pytest.raises(InputError, match="to_neuron"):
        fsd.sample(torch.tensor([prompt]), sequence_length=20)
    fsd.to_neuron()                                            # compiles the target's verify graph only
    assert target.compiled.meta["speculation_length"] == 3 and target.compiled.verify is not None
    streamer = _Streamer()
    out = fsd.sample(torch.tensor([prompt]), sequence_length=20, streamer=streamer)
    want = _hf_greedy(model, prompt, 16)
    assert out.tolist() == [prompt + want]
    assert streamer.pieces[0] == [prompt] and [p[0][0] for p in streamer.pieces[1:]] == want and streamer.ended
    assert fsd.stats.acceptance_rate == 1.0 and fsd.stats.rounds <= 4     # k + 1 tokens per round
    eos = want[1]
    stop = FusedSpeculativeDecoder(draft, target, 3, eos_token_id=eos)
    stop.to_neuron()
    assert stop.sample(torch.tensor([prompt]), sequence_length=20).tolist() == [prompt + want[:want.index(eos) + 1]]
    with pytest.raises(InputError, match="one sequence"):
        fsd.sample(torch.tensor([prompt, prompt]), sequence_length=20)
    for bad, msg in [({"buckets": [32]}, "buckets"), ({"output_scores": True}, "scores"), ({"k": 0}, "positive")]:
        with pytest.raises(CompilerArgsError, match=msg):
            FusedSpeculativeDecoder(draft, target, **{"k": 3, **bad})
