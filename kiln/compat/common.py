"""What the two Neuron spellings share: input splitting, Neuron's cache settings, core names.

``torch_neuron`` and ``torch_neuronx`` take example inputs and cache settings
the same way, so both modules read them here rather than one importing the
other's helpers.
"""
from __future__ import annotations

import functools

from kiln.compiler import neuron_env
from kiln.host import cores


def split_inputs(example_inputs):
    """Neuron's ``example_inputs`` (a tensor, a tuple, or a dict of keyword inputs) as
    kiln's ``(args, kwargs)``."""
    if isinstance(example_inputs, dict):
        return None, example_inputs
    return example_inputs, None


def neuron_cache_options() -> dict:
    """Neuron's cache settings (:func:`kiln.compiler.neuron_env.cache_options`)."""
    return neuron_env.cache_options()


def neuron_names(fn):
    """Run ``fn`` with Neuron's core variables (``NEURON_RT_VISIBLE_CORES``,
    ``NEURON_RT_NUM_CORES``) honoured, so a model traced or replicated through a Neuron
    spelling lands where Neuron would put it, without changing placement for the rest of
    the process (``kiln.host.cores.honour_neuron_env()`` does that, on request)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with cores.neuron_names():
            return fn(*args, **kwargs)
    return call
