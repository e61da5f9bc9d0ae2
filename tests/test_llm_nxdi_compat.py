"""An NxD Inference script after swapping its package for kiln.neuronx_distributed_inference:
config, compile to a directory, load, generate through the Hugging Face adapter."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import ArtifactError, CompilerArgsError, InputError  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402


def test_nxd_inference_script_runs_after_swapping_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_URL", "off")
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig, OnDeviceSamplingConfig
    from kiln.neuronx_distributed_inference.models.llama.modeling_llama import (LlamaInferenceConfig,
                                                                               NeuronLlamaForCausalLM)
    from kiln.neuronx_distributed_inference.utils.hf_adapter import (HuggingFaceGenerationAdapter,
                                                                    load_pretrained_config)
    model = _model("llama")
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "compiled")
    model.save_pretrained(path)
    nc = NeuronConfig(tp_degree=1, batch_size=2, max_context_length=8, seq_len=32,
                      on_device_sampling_config=OnDeviceSamplingConfig(top_k=1))
    cfg = LlamaInferenceConfig(nc, load_config=load_pretrained_config(path))
    assert cfg.hf_config.num_hidden_layers == 2
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
    # NxD Inference's own examples pass a GenerationConfig and max_length (the prompt's padded
    # width and the new tokens together); max_length was an unknown setting before
    # and reload the compiled directory with no config, as their examples do
    gc = transformers.GenerationConfig(do_sample=False, top_k=1, pad_token_id=0, eos_token_id=None)
    reloaded = NeuronLlamaForCausalLM(out)
    reloaded.load(out)
    assert reloaded.config.neuron_config.max_length == 32 and reloaded.config.hf_config.num_hidden_layers == 2
    again = HuggingFaceGenerationAdapter(reloaded).generate(ids, generation_config=gc, attention_mask=mask,
                                                            max_length=14)
    assert torch.equal(again, got)
    with pytest.raises(InputError, match="holds no neuron_config.json"):
        NeuronLlamaForCausalLM(path)
    (tmp_path / "compiled" / "neuron_config.json").write_text('{"neuron_config": {"seq_len": "x", "bogus": 1}}')
    with pytest.raises(ArtifactError, match="is not the config compile\\(\\) writes"):
        NeuronLlamaForCausalLM(out)


@pytest.mark.parametrize("kw, msg", [({"tp_degree": 0}, "positive integer"), ({"quantized": True}, "quantized"),
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
    assert nc.max_length == 64 and NeuronConfig(seq_len=64, max_length=48).max_length == 48


def test_token_generation_buckets_become_sequence_buckets():
    from kiln.neuronx_distributed_inference.models.config import NeuronConfig
    assert NeuronConfig(seq_len=64).sequence_buckets() is None
    assert NeuronConfig(seq_len=64, enable_bucketing=True, token_generation_buckets=[32, 16]).sequence_buckets() == [16, 32]
    assert NeuronConfig(seq_len=1024, enable_bucketing=True).sequence_buckets() == [128, 256, 512]
