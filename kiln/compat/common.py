"""What the two Neuron spellings share: input splitting, Neuron's cache settings, core names.

``torch_neuron`` and ``torch_neuronx`` take example inputs and cache settings
the same way, so both modules read them here rather than one importing the
other's helpers.
"""
from __future__ import annotations

import functools
import shlex

from kiln.compiler import neuron_env
from kiln.compiler.options import parse_compiler_args
from kiln.errors import CompilerArgsError
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


def with_neuron_cc_flags(compiler_args) -> list | None:
    """``compiler_args`` after ``NEURON_CC_FLAGS``' compile flags, as Neuron's traces read
    both (the given ones come later, so they win). A trace that ignored the variable
    computed in fp32 where the script's environment asked for fp16. A bad value in the
    variable is an error naming the variable, as the device's is (parsed together with
    ``compiler_args``, it read as if the script's own arguments were wrong)."""
    env = neuron_env.compile_flags(stacklevel=3)
    if not env:
        return compiler_args
    try:
        parse_compiler_args(env)
    except CompilerArgsError as e:
        raise CompilerArgsError(f"NEURON_CC_FLAGS: {e}") from None
    given = shlex.split(compiler_args) if isinstance(compiler_args, str) else list(compiler_args or [])
    return env + [str(a) for a in given]


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


def as_model(obj):
    """The kiln model behind ``obj``: ``obj`` itself, or for a TorchScript module kiln wrote
    (``torch.jit.save`` of a traced model, back from ``torch.jit.load``: Neuron scripts hand
    it to ``DataParallel``) the model its ``kiln::run`` operator runs, loaded once per
    process; None for anything else."""
    import torch
    from kiln.runtime.model import Model
    if isinstance(obj, Model):
        return obj
    if (isinstance(obj, torch.jit.ScriptModule) and isinstance(getattr(obj, "artifact", None), torch.Tensor)
            and "ops.kiln.run" in obj.code):
        from kiln.runtime.script_op import model_for
        return model_for(obj.artifact)      # keyed by the bytes' sha256, as its kiln::run calls are
    return None
