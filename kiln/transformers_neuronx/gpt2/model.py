"""``transformers_neuronx.gpt2.model``."""
from kiln.compat.transformers_neuronx import GPT2ForSampling

__all__ = ["GPT2ForSampling"]
