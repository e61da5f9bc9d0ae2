"""A transformers-neuronx script after swapping its import: from_pretrained on a saved
checkpoint, to_neuron(), sample() with top_k=1 giving Hugging Face's greedy tokens."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from tests.test_llm_decoder import _hf_greedy, _model  # noqa: E402


def test_transformers_neuronx_script_runs_after_swapping_the_import(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_URL", "off")
    from kiln.transformers_neuronx import NeuronAutoModelForCausalLM
    model = _model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    neuron = NeuronAutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), batch_size=1, n_positions=32,
                                                        tp_degree=1, amp="f32", context_length_estimate=8)
    with pytest.raises(InputError, match="to_neuron"):
        neuron.sample(torch.tensor([[1, 2]]), sequence_length=8)
    neuron.to_neuron()
    prompt = [5, 17, 3, 88]
    out = neuron.sample(torch.tensor([prompt]), sequence_length=20, top_k=1)
    assert out[0, :4].tolist() == prompt
    assert out[0, 4:].tolist() == _hf_greedy(model, prompt, 16)


@pytest.mark.parametrize("kw, msg", [({"tp_degree": 2}, "tensor parallelism"), ({"amp": "bf16"}, "fp32 today"),
                                     ({"fuse_qkv": True}, "does not know yet")])
def test_options_kiln_cannot_honour_are_clear_errors(kw, msg):
    from kiln.transformers_neuronx import NeuronAutoModelForCausalLM
    with pytest.raises(CompilerArgsError, match=msg):
        NeuronAutoModelForCausalLM.from_pretrained("unused", **kw)
