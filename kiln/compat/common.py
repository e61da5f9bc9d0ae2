"""What the two Neuron spellings share: input splitting, Neuron's cache settings, core names.

``torch_neuron`` and ``torch_neuronx`` take example inputs and cache settings
the same way, so both modules read them here rather than one importing the
other's helpers.
"""
from __future__ import annotations

import functools
import shlex

from kiln.host import cores
from kiln import config


def split_inputs(example_inputs):
    """Neuron's ``example_inputs`` (a tensor, a tuple, or a dict of keyword inputs) as
    kiln's ``(args, kwargs)``."""
    if isinstance(example_inputs, dict):
        return None, example_inputs
    return example_inputs, None


def neuron_cache_options() -> dict:
    """Neuron's cache settings, when kiln's own (KILN_CACHE_URL) are not given:
    ``NEURON_COMPILE_CACHE_URL``, and ``--cache_dir=`` / ``--retry_failed_compilation``
    in ``NEURON_CC_FLAGS``."""
    out: dict = {}
    flags = shlex.split(config.get("NEURON_CC_FLAGS"))
    if "--retry_failed_compilation" in flags:
        out["retry_failed"] = True
    if config.is_set("KILN_CACHE_URL"):
        return out
    url = config.get("NEURON_COMPILE_CACHE_URL")
    for i, flag in enumerate(flags):
        if flag.startswith("--cache_dir="):
            url = flag.split("=", 1)[1]
        elif flag == "--cache_dir" and i + 1 < len(flags):
            url = flags[i + 1]
    if url:
        out["cache"] = url
    return out


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
