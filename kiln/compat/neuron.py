"""``torch_neuron`` (first generation) compatibility.

    import kiln.neuron as torch_neuron
    traced = torch_neuron.trace(model, example_inputs)

Neuron's defaults are kept: CPU fallback on, ``minimum_segment_size=2``.
Models traced or replicated through this module honour ``NEURON_RT_VISIBLE_CORES``
and ``NEURON_RT_NUM_CORES`` (``KILN_*`` win); importing it changes nothing.
"""
from __future__ import annotations

import logging
import os

import torch

from kiln.compat.common import as_model, neuron_cache_options, neuron_names, split_inputs, with_neuron_cc_flags
from kiln.compiler import api as compiler
from kiln.errors import CompilerArgsError
from kiln.host import cores
from kiln.host.cores import honour_neuron_env
from kiln.runtime import replicas
from kiln.runtime.torchscript import saving_torchscript

__all__ = ["DataParallel", "analyze_model", "honour_neuron_env", "trace"]
log = logging.getLogger("kiln")


class DataParallel(replicas.DataParallel):
    """Neuron's ``torch_neuron.DataParallel``: kiln's, with dynamic batching on
    (``.disable_dynamic_batching()``) and its cores chosen under Neuron's names."""

    def __init__(self, module, *args, **kwargs):
        with cores.neuron_names():
            super().__init__(as_model(module) or module, *args, **kwargs)


@neuron_names
def trace(model, example_inputs, *, compiler_args=None, compiler_timeout=None, compiler_workdir=None,
          subgraph_builder_function=None, minimum_segment_size=2, single_fusion_ratio_threshold=0.6,
          fallback=True, dynamic_batch_size=False, optimizations=None, separate_weights=False,
          **kiln_options):
    """Neuron's ``trace``: ``kiln.trace`` with fallback on, Neuron's segment size and cache
    settings, and the model saved in ``compiler_workdir``. As Neuron's TorchScript module, the
    model's ``save(path)`` writes what ``torch.jit.load`` reads (a ``.kiln`` path: kiln's artifact)."""
    if dynamic_batch_size:
        kiln_options["dynamic_batch"] = True
    if subgraph_builder_function is not None:
        raise CompilerArgsError("subgraph_builder_function is not supported; use "
                                "kiln.trace(..., ops_on_host={...}) to keep ops on the CPU")
    if optimizations:
        raise CompilerArgsError("optimizations= is not supported; use compiler_args=['-O1'|'-O2'|'-O3']")
    for name, given, default, why in (
            ("compiler_timeout", compiler_timeout, None, "kiln's compiles have no hard time limit (compile_budget= "
             "bounds the engine search)"),
            ("separate_weights", separate_weights, False, "the weights are always stored in the artifact"),
            ("single_fusion_ratio_threshold", single_fusion_ratio_threshold, 0.6, "kiln's partitioner has no "
             "fusion ratio (min_partition_size= bounds the partitions)")):
        if given != default:
            log.warning("kiln.neuron.trace: %s=%r is accepted and has no effect: %s", name, given, why)
    args, kwargs = split_inputs(example_inputs)
    for k, v in neuron_cache_options().items():
        kiln_options.setdefault(k, v)
    compiled = compiler.trace(model, args, kwargs, compiler_args=with_neuron_cc_flags(compiler_args), fallback=fallback,
                              min_partition_size=max(1, int(minimum_segment_size)), **kiln_options)
    if compiler_workdir:
        os.makedirs(compiler_workdir, exist_ok=True)
        compiled.save(os.path.join(compiler_workdir, "model.kiln"))
    return saving_torchscript(compiled)


@neuron_names
def analyze_model(model, example_inputs, compiler_args=None, **kwargs):
    """Print supported/unsupported op counts the way torch_neuron does, and return the report."""
    args, kw = split_inputs(example_inputs)
    rep = compiler.analyze(model, args, kw, compiler_args=compiler_args)
    supported = sum(rep.supported_ops.values())
    print(f"{rep.support_percentage:.2f}% of all operations ({supported} of {rep.total_ops}) are supported")
    arithmetic = {op: n for op, n in rep.supported_ops.items() if _arithmetic(op)}
    missing = {u["op"]: u["count"] for u in rep.unsupported_ops if _arithmetic(u["op"])}
    total = sum(arithmetic.values()) + sum(missing.values())
    share = 100.0 * sum(arithmetic.values()) / total if total else 100.0
    print(f"{share:.2f}% of arithmetic operations ({sum(arithmetic.values())} of {total}) are supported")
    print(str(rep))
    return rep


def _arithmetic(op: str) -> bool:
    """Whether an operator computes (torch_neuron's "arithmetic operations"), rather than
    only viewing or moving data: an ATen op whose result aliases its input (a view,
    reshape, transpose) or that copies it whole is not."""
    if op.split("::")[-1] in ("clone", "contiguous", "_to_copy", "copy", "cat", "stack", "expand_copy", "lift_fresh_copy",
                              "_unsafe_view"):
        return False
    namespace, _, name = op.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
    functional = [o for o in (packet.overloads() if packet is not None else ()) if "out" not in o]
    if not functional:
        return True
    overload = getattr(packet, "default" if "default" in functional else functional[0])
    return not any(r.alias_info is not None for r in overload._schema.returns)
