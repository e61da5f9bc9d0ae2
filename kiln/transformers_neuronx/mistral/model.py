"""``transformers_neuronx.mistral.model``."""
from kiln.compat.transformers_neuronx import MistralForSampling

__all__ = ["MistralForSampling"]
