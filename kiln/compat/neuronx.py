"""``torch_neuronx`` compatibility: swap the import, keep the script.

    import kiln.neuronx as torch_neuronx
    traced = torch_neuronx.trace(model, example_inputs)

Neuron's defaults are kept: unsupported ops are an error unless a
``PartitionerConfig`` is given, which turns on CPU fallback. Models traced or
replicated through these functions honour ``NEURON_RT_VISIBLE_CORES`` and
``NEURON_RT_NUM_CORES`` (``KILN_*`` win); importing the module changes nothing.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from kiln.compat.common import as_model, neuron_cache_options, neuron_names, split_inputs, with_neuron_cc_flags
from kiln.compiler import api as compiler
from kiln.errors import CompilerArgsError, UnsupportedOpError
from kiln.host.cores import honour_neuron_env
from kiln.runtime import buckets, replicas
from kiln.runtime.torchscript import saving_torchscript

__all__ = ["DataParallel", "PartitionerConfig", "analyze", "async_load", "dynamic_batch", "honour_neuron_env",
           "lazy_load", "move_trace_to_device", "neuron_cache_options", "replace_weights", "trace"]


@neuron_names
def DataParallel(module, device_ids=None, dim=0, set_dynamic_batching=True, **kwargs):  # noqa: N802
    """Neuron's ``torch_neuronx.DataParallel``: one replica per kiln core."""
    return replicas.DataParallel(as_model(module) or module, device_ids=device_ids, dim=dim,
                                 dynamic_batching=set_dynamic_batching, **kwargs)


@dataclass
class PartitionerConfig:
    """Neuron's partitioner settings, mapped onto kiln's fallback options."""
    model_support_percentage_threshold: float = 0.5
    min_subgraph_size: int = -1
    max_subgraph_count: int = -1
    ops_to_partition: set | None = None   # ops forced onto the CPU


@neuron_names
def trace(func, example_inputs, *_, input_output_aliases=None, compiler_workdir=None,
          compiler_args=None, partitioner_config=None, inline_weights_to_neff=True,
          cpu_backend=False, **kiln_options):
    """Neuron's ``trace``: ``kiln.trace`` with fallback off unless ``partitioner_config`` is
    given, Neuron's cache settings, and the model and its report in ``compiler_workdir``.
    As Neuron's TorchScript module, the model's ``save(path)`` writes what ``torch.jit.load``
    reads (``torch.jit.save``'s file; a ``.kiln`` path gets kiln's artifact)."""
    if input_output_aliases:
        raise CompilerArgsError("input_output_aliases is not supported yet: kiln artifacts do not "
                                "alias inputs and outputs")
    if not inline_weights_to_neff:
        raise CompilerArgsError("inline_weights_to_neff=False (separately replaceable weights) is "
                                "not supported yet; weights are always stored in the artifact")
    args, kwargs = split_inputs(example_inputs)
    options = dict(fallback=False, **neuron_cache_options())
    pc = partitioner_config
    if pc is not None:
        options["fallback"] = True
        if pc.min_subgraph_size and pc.min_subgraph_size > 0:
            options["min_partition_size"] = pc.min_subgraph_size
        if pc.ops_to_partition:
            options["ops_on_host"] = set(pc.ops_to_partition)
    options.update(kiln_options)
    compiled = compiler.trace(func, args, kwargs, compiler_args=with_neuron_cc_flags(compiler_args), **options)
    if pc is not None:
        _check_partitioner(compiled, pc)
    if compiler_workdir:
        os.makedirs(compiler_workdir, exist_ok=True)
        compiled.save(os.path.join(compiler_workdir, "model.kiln"))
        with open(os.path.join(compiler_workdir, "report.json"), "w") as f:
            json.dump(compiled.report, f, indent=1)
    return saving_torchscript(compiled)


def _check_partitioner(compiled, pc):
    rep = compiled.report
    share = rep["support_percentage"] / 100.0
    if share < pc.model_support_percentage_threshold:
        raise UnsupportedOpError(
            f"only {share:.0%} of the model's ops are supported, below "
            f"model_support_percentage_threshold={pc.model_support_percentage_threshold}")
    n = len(rep["partitions"])
    if pc.max_subgraph_count and pc.max_subgraph_count > 0 and n > pc.max_subgraph_count:
        raise UnsupportedOpError(f"the model splits into {n} device partitions, more than "
                                 f"max_subgraph_count={pc.max_subgraph_count}")


@neuron_names
def analyze(func, example_inputs, compiler_workdir=None, additional_ignored_ops=None,
            max_workers=None, is_hf_transformers=False, cleanup=False):
    """Neuron's analyze(): a dict with support_percentage, supported_operators, unsupported_operators."""
    args, kwargs = split_inputs(example_inputs)
    rep = compiler.analyze(func, args, kwargs)
    unsupported = []
    for u in rep.unsupported_ops:
        for loc in u["locations"] or [None]:
            unsupported.append({"kind": u["op"], "failureAt": u["reason"], "call": loc})
    return {
        "torch_neuronx_version": None,
        "support_percentage": f"{rep.support_percentage:.2f}%",
        "supported_operators": dict(rep.supported_ops),
        "unsupported_operators": unsupported,
    }


@neuron_names
def dynamic_batch(traced):
    """Neuron's ``dynamic_batch``: split/pad dim 0 into trace-size chunks; ``save(path)``
    writes TorchScript, as :func:`trace`'s model does."""
    return saving_torchscript(buckets.dynamic_batch(as_model(traced) or traced))


@neuron_names
def move_trace_to_device(traced, device_id: int):
    """Neuron's ``move_trace_to_device``: the traced model runs on kiln core ``device_id``
    (numbered among the visible cores, ``NEURON_RT_VISIBLE_CORES`` honoured) from now on,
    its engines reloaded on that core's CPUs (``Model.to_core``)."""
    _require_model(traced, "move_trace_to_device").to_core(int(device_id))


def lazy_load(traced):
    """Neuron's ``lazy_load`` defers putting a model on its core until the first call. A
    kiln model is ready when ``trace`` or ``torch.jit.load`` returns it (its engines were
    built or read then), so there is nothing left to defer: this returns without a change,
    and the first call costs what every call does."""
    _require_model(traced, "lazy_load")


def async_load(traced):
    """Neuron's ``async_load`` loads on a background thread so the caller goes on. As for
    :func:`lazy_load`, a kiln model is loaded already when this is reachable: no change."""
    _require_model(traced, "async_load")


def replace_weights(traced, weights):
    """Neuron's ``replace_weights`` needs a model traced with ``inline_weights_to_neff=False``,
    which kiln's :func:`trace` refuses (its engines hold the weights they were built with):
    an error saying to trace again with the new weights."""
    _require_model(traced, "replace_weights")
    raise CompilerArgsError("replace_weights needs a model traced with inline_weights_to_neff=False, which kiln "
                            "does not support yet (its engines hold the weights they were built with): load the "
                            "new weights into the module and trace it again (the compile cache keys on the weights)")


def _require_model(traced, what: str):
    """The kiln model of a traced model or of one back from ``torch.jit.load``."""
    model = as_model(traced)
    if model is None:
        raise TypeError(f"{what}() takes a model returned by kiln.neuronx.trace or torch.jit.load; got "
                        f"{type(traced).__name__}")
    return model
