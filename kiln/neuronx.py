"""``import kiln.neuronx``: the torch_neuronx spelling, kept where Neuron users look for it.

The code lives in :mod:`kiln.compat.neuronx`; this module *is* that module (not a copy of
its names), so attributes set on one are seen through the other.
"""
import sys

from kiln.compat import neuronx as _impl

sys.modules[__name__] = _impl
