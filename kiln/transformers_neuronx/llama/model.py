"""``transformers_neuronx.llama.model``."""
from kiln.compat.transformers_neuronx import LlamaForSampling

__all__ = ["LlamaForSampling"]
