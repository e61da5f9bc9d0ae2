"""An NxD Inference script after swapping its package for kiln.neuronx_distributed_inference:
config, compile to a directory, load, generate through the Hugging Face adapter."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import ArtifactError, CompilerArgsError, InputError  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Llama and the directory it is saved in."""
    model = _model("llama")
    path = str(tmp_path_factory.mktemp("nxdi") / "ckpt")
    model.save_pretrained(path)
    return model, path


def test_nxd_inference_script_runs_after_swapping_the_package(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_URL", "off")
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig
    from kiln.neuronx_distributed_inference.models.llama.modeling_llama import (LlamaInferenceConfig,
                                                                               NeuronLlamaForCausalLM)
    from kiln.neuronx_distributed_inference.utils.hf_adapter import (HuggingFaceGenerationAdapter,
                                                                    load_pretrained_config)
    model, path = checkpoint
    out = str(tmp_path / "compiled")
    # padding_side="left", as NxD Inference's adapter examples batch prompts (kiln refused it until 11-30)
    nc = NeuronConfig(tp_degree=1, batch_size=2, max_context_length=8, seq_len=32, padding_side="left",
                      on_device_sampling_config=OnDeviceSamplingConfig(top_k=1))
    cfg = LlamaInferenceConfig(nc, load_config=load_pretrained_config(path))
    assert cfg.num_hidden_layers == 2
    m = NeuronLlamaForCausalLM(path, cfg)
    with pytest.raises(InputError, match="compile"):
        m.load(out)
    m.compile(out)
    m.load(out)
    ids = torch.tensor([[0, 5, 17, 3], [11, 2, 9, 4]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    got = HuggingFaceGenerationAdapter(m).generate(ids, attention_mask=mask, max_new_tokens=10)
    assert got[0, 4:].tolist() == _hf_greedy(model, [5, 17, 3], 10)
    assert got[1, 4:].tolist() == _hf_greedy(model, [11, 2, 9, 4], 10)
    # a left-padded batch: Hugging Face's own batched generate, token for token
    left = torch.tensor([[0, 0, 0, 5, 17, 3, 88], [11, 2, 9, 4, 60, 61, 62]])
    left_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model.generate(left, attention_mask=left_mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(HuggingFaceGenerationAdapter(m).generate(left, attention_mask=left_mask,
                                                                max_new_tokens=12), want)
    # lengths past the compiled shapes name NxD Inference's options
    with pytest.raises(InputError, match="larger max_context_length"):
        HuggingFaceGenerationAdapter(m).generate(torch.tensor([list(range(3, 12))]), max_new_tokens=2)
    with pytest.raises(InputError, match="4 prompt tokens \\+ 40 new ones exceed seq_len=32"):
        HuggingFaceGenerationAdapter(m).generate(ids, attention_mask=mask, max_new_tokens=40)
    # NxD Inference's own examples pass a GenerationConfig and max_length (the prompt's padded
    # width and the new tokens together); max_length was an unknown setting before
    # and reload the compiled directory with no config, as their examples do
    gc = transformers.GenerationConfig(do_sample=False, top_k=1, pad_token_id=0, eos_token_id=None)
    reloaded = NeuronLlamaForCausalLM(out)
    reloaded.load(out)
    assert reloaded.config.neuron_config.max_length == 32 and reloaded.config.num_hidden_layers == 2
    assert reloaded.config.neuron_config.padding_side == "left"
    again = HuggingFaceGenerationAdapter(reloaded).generate(ids, generation_config=gc, attention_mask=mask,
                                                            max_length=14)
    assert torch.equal(again, got)
    # transformers' streamer through the adapter (an unknown setting before): the input, then each token
    pieces = []
    streamer = type("Streamer", (), {"put": lambda self, v: pieces.append(v.tolist()), "end": lambda self: None})()
    one = HuggingFaceGenerationAdapter(reloaded).generate(ids[1:], max_new_tokens=5, streamer=streamer)
    assert torch.equal(one, got[1:, :9]) and pieces == [ids[1:].tolist()] + [[t] for t in got[1, 4:9].tolist()]
    # eos_token_id=None given is no stop token, as in transformers' generate (kiln stopped at the
    # model's): here a model whose end-of-sequence token is the 1st row's 7th new token
    prompt = [5, 17, 3]
    reloaded.llm.meta["eos_token_ids"] = [_hf_greedy(model, prompt, 10)[6]]
    assert HuggingFaceGenerationAdapter(reloaded).generate(ids[:1], attention_mask=mask[:1], max_new_tokens=10,
                                                           eos_token_id=None)[0, 4:].tolist() == \
        _hf_greedy(model, prompt, 10)
    with pytest.raises(InputError, match="holds no neuron_config.json"):
        NeuronLlamaForCausalLM(path)
    saved = (tmp_path / "compiled" / "neuron_config.json")
    # a directory compiled before the checkpoint's fields were saved with the NeuronConfig
    saved.write_text(json.dumps({"neuron_config": json.loads(saved.read_text())["neuron_config"]}))
    assert NeuronLlamaForCausalLM(out).config.vocab_size == model.config.vocab_size
    (tmp_path / "compiled" / "neuron_config.json").write_text('{"neuron_config": {"seq_len": "x", "bogus": 1}}')
    with pytest.raises(ArtifactError, match="is not the config compile\\(\\) writes"):
        NeuronLlamaForCausalLM(out)


@pytest.mark.parametrize("kw, msg", [({"tp_degree": 0}, "positive integer"),
                                     # what to do instead (the message said 'no quantized weights yet' until 11-30)
                                     ({"quantized": True, "quantization_type": "per_channel_symmetric",
                                       "quantization_dtype": "int8"}, "compile_llm\\(model, quantize='int8'"),
                                     # NxD Inference's names, not compile_llm's context bucket / cache_length
                                     ({"max_context_length": 64, "seq_len": 32},
                                      "max_context_length=64 exceeds seq_len=32"),
                                     ({"enable_bucketing": True, "seq_len": 32, "token_generation_buckets": [16, 64]},
                                      "token_generation_buckets=\\[16, 64\\]: each must lie in \\[1, seq_len=32\\]"),
                                     ({"torch_dtype": "bfloat16"}, "float32 today"),
                                     ({"fused_qkv": True}, "Neuron kernel or layout kiln does not have"),
                                     ({"flash_decoding": True}, "does not know yet")])
def test_options_kiln_cannot_honour_are_clear_errors(kw, msg):
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig
    with pytest.raises(CompilerArgsError, match=msg):
        NeuronConfig(**kw)


def test_neuron_only_options_at_their_defaults_are_accepted():
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig
    nc = NeuronConfig(seq_len=64, flash_decoding_enabled=False, fused_qkv=False, padding_side="right")
    assert NeuronConfig(padding_side="left").padding_side == "left"
    assert NeuronConfig(quantization_type="per_channel_symmetric", quantization_dtype="int8").seq_len == 128
    with pytest.raises(CompilerArgsError, match="padding_side='middle'"):
        NeuronConfig(padding_side="middle")
    assert nc.max_length == 64 and NeuronConfig(seq_len=64, max_length=48).max_length == 48


def test_token_generation_buckets_become_sequence_buckets():
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig
    assert NeuronConfig(seq_len=64).sequence_buckets() is None
    assert NeuronConfig(seq_len=64, enable_bucketing=True, token_generation_buckets=[32, 16]).sequence_buckets() == [16, 32]
    assert NeuronConfig(seq_len=1024, enable_bucketing=True).sequence_buckets() == [128, 256, 512]


def test_inference_config_takes_the_checkpoint_fields_as_nxd_inference_does(checkpoint, tmp_path):
    """NxD Inference's contract: ``load_config(self)`` puts the Hugging Face fields on the
    config itself (not under ``hf_config``), keywords set more, required ones are checked,
    and save()/load() round-trip them with the NeuronConfig."""
    from kiln.neuronx_distributed_inference.models.config import (InferenceConfig, NeuronConfig,
                                                                  OnDeviceSamplingConfig)
    from kiln.neuronx_distributed_inference.models.llama.modeling_llama import LlamaInferenceConfig
    from kiln.neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config
    model, path = checkpoint
    nc = NeuronConfig(batch_size=2, seq_len=32, on_device_sampling_config=OnDeviceSamplingConfig(
        top_k=1, deterministic=True, global_topk=64, top_k_kernel_enabled=True, dynamic=True))
    cfg = LlamaInferenceConfig(nc, load_config=load_pretrained_config(path), max_batch_size=4)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.pad_token_id) == (2, model.config.vocab_size,
                                                                         model.config.pad_token_id)
    assert cfg.rope_theta == model.config.rope_parameters["rope_theta"] and cfg.max_batch_size == 4
    assert LlamaInferenceConfig(nc, load_config=load_pretrained_config(hf_config=model.config)).hidden_size == 32

    def own_loader(config):                 # a user's own hook, NxD Inference's signature
        config.hidden_size, config.vocab_size = 16, 50

    own = InferenceConfig(nc, load_config=own_loader)
    assert (own.hidden_size, own.vocab_size, own.neuron_config) == (16, 50, nc)
    with pytest.raises(CompilerArgsError, match="Config must define .*num_hidden_layers"):
        LlamaInferenceConfig(nc, load_config=own_loader)
    cfg.save(str(tmp_path))
    back = LlamaInferenceConfig.load(str(tmp_path))
    assert (back.num_hidden_layers, back.max_batch_size, back.neuron_config.seq_len) == (2, 4, 32)
    assert back.neuron_config.on_device_sampling_config.global_topk == 64
    with pytest.raises(CompilerArgsError, match="deterministic=True"):
        OnDeviceSamplingConfig(top_k=5, deterministic=True)
    with pytest.raises(CompilerArgsError, match="global_topk"):
        OnDeviceSamplingConfig(do_sample=True, top_k=300)
