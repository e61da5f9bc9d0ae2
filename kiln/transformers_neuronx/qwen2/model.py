"""``transformers_neuronx.qwen2.model``."""
from kiln.compat.transformers_neuronx import Qwen2ForSampling

__all__ = ["Qwen2ForSampling"]
