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
    given = shlex.split(compiler_args) if isinstance(compiler_args, str) else [str(a) for a in compiler_args or []]
    given = neuron_env.neuron_flags(given, neuron_env.TRACE_FLAGS, "compiler_args", stacklevel=3)
    if not env:
        return given if compiler_args is not None else None
    try:
        parse_compiler_args(env)
    except CompilerArgsError as e:
        raise CompilerArgsError(f"NEURON_CC_FLAGS: {e}") from None
    return env + given


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
        return model_for(obj.artifact)      # the module's own model, as its kiln::run calls find it
    return None


def shape_problems(names: dict, batch_size, seq_len, max_context, context_buckets, token_buckets) -> list:
    """What is wrong with an LLM's compile shapes, in the spelling's own option names
    (``names``: ``batch_size``, ``seq_len``, ``max_context``, ``context_buckets``,
    ``token_buckets``), where kiln's compile_llm would say cache_length and context bucket.
    ``max_context`` None: checked as the context buckets."""
    def positive(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    scalars = [("batch_size", batch_size), ("seq_len", seq_len)] + ([("max_context", max_context)]
                                                                      if max_context is not None else [])
    problems = [f"{names[key]}={value!r}: must be a positive integer" for key, value in scalars if not positive(value)]
    if problems:
        return problems
    seq = names["seq_len"]
    if max_context is not None and max_context > seq_len:
        problems.append(f"{names['max_context']}={max_context} exceeds {seq}={seq_len}: the prompt's keys must fit "
                        f"in the KV cache's {seq} positions; raise {seq} or lower {names['max_context']}")
    for key, buckets in (("context_buckets", context_buckets), ("token_buckets", token_buckets)):
        bad = [b for b in buckets or () if not positive(b) or b > seq_len]
        if bad:
            problems.append(f"{names[key]}={list(buckets)}: each must lie in [1, {seq}={seq_len}]; {bad} do not")
    return problems


def length_problem(llm, longest: int, new: int, names: dict) -> str | None:
    """A prompt of ``longest`` tokens past the compiled context buckets, or prompt and ``new``
    tokens past the KV cache, said in the spelling's names (``context_bucket``,
    ``context_fix``, ``seq_len``); None when they fit."""
    if longest > llm.max_context and not llm.meta.get("prefill_chunk"):
        return (f"a prompt of {longest} tokens is longer than the largest {names['context_bucket']} "
                f"({llm.max_context}): {names['context_fix']}")
    cache = llm.meta["cache_shape"][3]
    if longest + new > cache:
        return (f"{longest} prompt tokens + {new} new ones exceed {names['seq_len']}={cache} (the KV cache the model "
                f"was compiled with): ask for fewer new tokens, or compile with a larger {names['seq_len']}")
    return None
