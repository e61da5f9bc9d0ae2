"""``neuronx_distributed_inference.models.llama.modeling_llama``."""
from kiln.compat.nxdi.api import LlamaInferenceConfig, NeuronLlamaForCausalLM

__all__ = ["LlamaInferenceConfig", "NeuronLlamaForCausalLM"]
