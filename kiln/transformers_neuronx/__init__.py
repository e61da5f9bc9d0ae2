"""``import kiln.transformers_neuronx``: transformers-neuronx's module paths
(``NeuronAutoModelForCausalLM``, ``fused_speculation.FusedSpeculativeDecoder``) over
:mod:`kiln.compat.transformers_neuronx` and :mod:`kiln.compat.fused_speculation`."""
from kiln.compat.fused_speculation import FusedSpeculativeDecoder
from kiln.compat.transformers_neuronx import NeuronAutoModelForCausalLM

__all__ = ["NeuronAutoModelForCausalLM", "FusedSpeculativeDecoder"]
