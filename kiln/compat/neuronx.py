"""``torch_neuronx`` compatibility: swap the import, keep the script.

    import kiln.neuronx as torch_neuronx
    traced = torch_neuronx.trace(model, example_inputs)

Neuron's defaults are kept: unsupported ops are an error unless a
``PartitionerConfig`` is given, which turns on CPU fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler import driver as compiler

from kiln.host import cores
from kiln.errors import CompilerArgsError, UnsupportedOpError
from kiln.runtime.replicas import DataParallel as _DataParallel

cores.neuron_env = True   # honour NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES


def DataParallel(module, device_ids=None, dim=0, set_dynamic_batching=True, **kwargs):  # noqa: N802
    """Neuron's ``torch_neuronx.DataParallel``: one replica per kiln core."""
    return _DataParallel(module, device_ids=device_ids, dim=dim,
                         dynamic_batching=set_dynamic_batching, **kwargs)


@dataclass
class PartitionerConfig:
    """Neuron's partitioner settings, mapped onto kiln's fallback options."""
    model_support_percentage_threshold: float = 0.5
    min_subgraph_size: int = -1
    max_subgraph_count: int = -1
    ops_to_partition: set | None = None   # ops forced onto the CPU


def _split_inputs(example_inputs):
    if isinstance(example_inputs, dict):
        return None, example_inputs
    return example_inputs, None


def trace(func, example_inputs, *_, input_output_aliases=None, compiler_workdir=None,
          compiler_args=None, partitioner_config=None, inline_weights_to_neff=True,
          cpu_backend=False, **kiln_options):
    if input_output_aliases:
        raise CompilerArgsError("input_output_aliases is not supported yet: kiln artifacts do not "
                                "alias inputs and outputs")
    if not inline_weights_to_neff:
        raise CompilerArgsError("inline_weights_to_neff=False (separately replaceable weights) is "
                                "not supported yet; weights are always stored in the artifact")
    args, kwargs = _split_inputs(example_inputs)
    options = dict(fallback=False, **neuron_cache_options())
    pc = partitioner_config
    if pc is not None:
        options["fallback"] = True
        if pc.min_subgraph_size and pc.min_subgraph_size > 0:
            options["min_partition_size"] = pc.min_subgraph_size
        if pc.ops_to_partition:
            options["ops_on_host"] = set(pc.ops_to_partition)
    options.update(kiln_options)
    compiled = compiler.trace(func, args, kwargs, compiler_args=compiler_args, **options)
    if pc is not None:
        _check_partitioner(compiled, pc)
    if compiler_workdir:
        import json
        import os
        os.makedirs(compiler_workdir, exist_ok=True)
        compiled.save(os.path.join(compiler_workdir, "model.kiln"))
        with open(os.path.join(compiler_workdir, "report.json"), "w") as f:
            json.dump(compiled.report, f, indent=1)
    return compiled


def neuron_cache_options() -> dict:
    """Neuron's cache settings, when kiln's own (KILN_CACHE_URL) are not given:
    ``NEURON_COMPILE_CACHE_URL``, and ``--cache_dir=`` / ``--retry_failed_compilation``
    in ``NEURON_CC_FLAGS``."""
    import os
    import shlex
    out: dict = {}
    flags = shlex.split(os.environ.get("NEURON_CC_FLAGS", ""))
    if "--retry_failed_compilation" in flags:
        out["retry_failed"] = True
    if os.environ.get("KILN_CACHE_URL") is not None:
        return out
    url = os.environ.get("NEURON_COMPILE_CACHE_URL")
    for i, flag in enumerate(flags):
        if flag.startswith("--cache_dir="):
            url = flag.split("=", 1)[1]
        elif flag == "--cache_dir" and i + 1 < len(flags):
            url = flags[i + 1]
    if url:
        out["cache"] = url
    return out


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


def analyze(func, example_inputs, compiler_workdir=None, additional_ignored_ops=None,
            max_workers=None, is_hf_transformers=False, cleanup=False):
    """Neuron's analyze(): a dict with support_percentage, supported_operators, unsupported_operators."""
    args, kwargs = _split_inputs(example_inputs)
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


def dynamic_batch(traced):
    """Neuron's ``dynamic_batch``: split/pad dim 0 into trace-size chunks."""
    from kiln.runtime.buckets import dynamic_batch as _dynamic_batch
    return _dynamic_batch(traced)
