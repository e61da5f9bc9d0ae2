"""``transformers_neuronx.config``: ``NeuronConfig`` and its parts (:mod:`kiln.compat.tnx_config`)."""
from kiln.compat.tnx_config import GQA, ContinuousBatchingConfig, GenerationConfig, NeuronConfig, QuantizationConfig

__all__ = ["NeuronConfig", "QuantizationConfig", "ContinuousBatchingConfig", "GenerationConfig", "GQA"]
