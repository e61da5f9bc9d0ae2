"""``import kiln.neuron``: the torch_neuron spelling, kept where Neuron users look for it.

The code lives in :mod:`kiln.compat.neuron`; this module *is* that module (not a copy of
its names), so attributes set on one are seen through the other.
"""
import sys

from kiln.compat import neuron as _impl

sys.modules[__name__] = _impl
