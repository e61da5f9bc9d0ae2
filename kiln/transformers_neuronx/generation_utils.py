"""``transformers_neuronx.generation_utils``."""
from kiln.compat.transformers_neuronx import HuggingFaceGenerationModelAdapter

__all__ = ["HuggingFaceGenerationModelAdapter"]
