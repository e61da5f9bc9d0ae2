"""Neuron's compiler environment as kiln's compile options, for every entry point a Neuron
script reaches: torch_xla's device (:mod:`kiln.compat.xla_model`), Neuron's traces
(:mod:`kiln.compat.neuron`, :mod:`kiln.compat.neuronx`) and Optimum Neuron's trainer
(:mod:`kiln.optimum.neuron.trainer`). Read once here, so that ``NEURON_CC_FLAGS="--auto-cast
all --auto-cast-type bf16"`` means the same under each of them (the trainer used to ignore
it, and a run meant to compute in bf16 computed in float32 without a word).

Honoured flags: ``-O1``..``-O3``, ``--optlevel``, ``--auto-cast``, ``--auto-cast-type``,
``--target``; the cache from ``--cache_dir`` or ``NEURON_COMPILE_CACHE_URL`` (when kiln's
own ``KILN_CACHE_URL`` is not set); ``--retry_failed_compilation``. Flags that mean
something only to Neuron's compiler (``--model-type``, ``--distribution-strategy``...) are
ignored with a warning; a bad value of an honoured one is a :class:`CompilerArgsError`.
"""
from __future__ import annotations

import shlex
import warnings

from kiln import config
from kiln.compiler.options import parse_compiler_args
from kiln.errors import CompilerArgsError

_KNOWN = ("-O1", "-O2", "-O3", "--optlevel", "-O", "--auto-cast", "--auto-cast-type", "--target")
# what a Neuron trace's own compiler_args may also set
TRACE_FLAGS = (*_KNOWN, "--neuroncore-pipeline-cores", "--compile-budget")


def device_options(stacklevel: int = 2) -> dict:
    """kiln.trace options for a device's graphs: optlevel 2 (neuronx-cc's default too),
    then ``NEURON_CC_FLAGS``' compile flags, then :func:`cache_options`."""
    options = {"optlevel": 2}
    try:
        options.update(parse_compiler_args(compile_flags(stacklevel + 1)))
    except CompilerArgsError as e:
        raise CompilerArgsError(f"NEURON_CC_FLAGS: {e}") from None
    options.update(cache_options())
    return options


def compile_flags(stacklevel: int = 2) -> list:
    """The flags of ``NEURON_CC_FLAGS`` kiln's compiler takes (the module doc's list), as
    tokens: a Neuron trace puts them before its own ``compiler_args``, which win. The
    others are ignored with a warning."""
    return neuron_flags(shlex.split(config.get("NEURON_CC_FLAGS")), _KNOWN, "NEURON_CC_FLAGS", stacklevel + 1)


def neuron_flags(tokens: list, known, source: str, stacklevel: int = 2) -> list:
    """The tokens of Neuron compiler flags in ``known`` (each with its value), warning that
    the others (``--model-type transformer``, ``--verbose 1``...: Neuron's compiler's own)
    are ignored; ``source`` names where they came from. Neuron's traces read their
    ``compiler_args`` so too: a ported script's ``--model-type=transformer`` raised."""
    flags, ignored = [], []
    i = 0
    while i < len(tokens):
        flag = tokens[i].split("=", 1)[0]
        takes_value = "=" not in tokens[i] and flag not in ("-O1", "-O2", "-O3") and i + 1 < len(tokens) \
            and not tokens[i + 1].startswith("-")
        group = tokens[i:i + 2] if takes_value else tokens[i:i + 1]
        if flag in known:
            flags += group
        elif not flag.startswith("--cache_dir") and flag != "--retry_failed_compilation":
            ignored += group
        i += len(group)
    if ignored:
        warnings.warn(f"kiln: {source} {' '.join(ignored)} mean nothing to kiln's compiler and are "
                      "ignored", RuntimeWarning, stacklevel=stacklevel + 1)
    return flags


def cache_options() -> dict:
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
