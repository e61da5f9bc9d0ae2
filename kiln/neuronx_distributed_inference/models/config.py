"""``neuronx_distributed_inference.models.config``."""
from kiln.compat.nxdi.api import InferenceConfig, NeuronConfig, OnDeviceSamplingConfig

__all__ = ["InferenceConfig", "NeuronConfig", "OnDeviceSamplingConfig"]
