"""``import kiln.transformers_neuronx``: transformers-neuronx's spelling (``NeuronAutoModelForCausalLM``).

The code lives in :mod:`kiln.compat.transformers_neuronx`; this module *is* that module.
"""
import sys

from kiln.compat import transformers_neuronx as _impl

sys.modules[__name__] = _impl
