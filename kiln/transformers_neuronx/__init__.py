"""``import kiln.transformers_neuronx``: transformers-neuronx's module paths
(``NeuronAutoModelForCausalLM``, the per-family ``LlamaForSampling`` and its kin with their
``<family>.model`` modules, ``module.save_pretrained_split``,
``generation_utils.HuggingFaceGenerationModelAdapter``, ``fused_speculation.FusedSpeculativeDecoder``,
``config.NeuronConfig`` and its parts)
over :mod:`kiln.compat.transformers_neuronx` and :mod:`kiln.compat.fused_speculation`."""
from kiln.compat.fused_speculation import FusedSpeculativeDecoder
from kiln.compat.tnx_config import GQA, ContinuousBatchingConfig, GenerationConfig, NeuronConfig, QuantizationConfig
from kiln.compat.transformers_neuronx import (GPT2ForSampling, LlamaForSampling, MistralForSampling,
                                              NeuronAutoModelForCausalLM, Qwen2ForSampling)

__all__ = ["NeuronAutoModelForCausalLM", "LlamaForSampling", "MistralForSampling", "Qwen2ForSampling",
           "GPT2ForSampling", "FusedSpeculativeDecoder", "NeuronConfig", "QuantizationConfig",
           "ContinuousBatchingConfig", "GenerationConfig", "GQA"]
