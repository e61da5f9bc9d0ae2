"""NeuronX Distributed (NxD) under its own module paths: a script runs after
``neuronx_distributed`` -> ``kiln.neuronx_distributed`` in its imports.

The implementation is kiln's (:mod:`kiln.distributed`); these modules only put it at
NxD's names. Names implemented by modules that load heavier machinery (the trainer,
checkpoints, pipeline, trace) are imported on first use.
"""
from __future__ import annotations

import importlib

from kiln.neuronx_distributed import modules, parallel_layers, utils  # noqa: F401

_LAZY = {
    "neuronx_distributed_config": ("kiln.neuronx_distributed.trainer", "neuronx_distributed_config"),
    "initialize_parallel_model": ("kiln.neuronx_distributed.trainer", "initialize_parallel_model"),
    "initialize_parallel_optimizer": ("kiln.neuronx_distributed.trainer", "initialize_parallel_optimizer"),
    "save_checkpoint": ("kiln.distributed.checkpoint", "save_checkpoint"),
    "load_checkpoint": ("kiln.distributed.checkpoint", "load_checkpoint"),
    "has_checkpoint": ("kiln.distributed.checkpoint", "has_checkpoint"),
    "finalize_checkpoint": ("kiln.distributed.checkpoint", "finalize_checkpoint"),
}
_SUBMODULES = ("trace", "pipeline", "optimizer", "trainer", "kernels", "lightning")
# NxD's names kiln does not provide, with what to use instead: an AttributeError that says so
_ABSENT = {name: "NxD's ModelBuilder v2 inference flow (ModelBuilder, NxDModel, shard_checkpoint, "
                 "NxDParallelState) is not provided: trace a tensor-parallel model with "
                 "neuronx_distributed.trace.parallel_model_trace (kiln.compat.nxd_trace), or compile a decoder "
                 "LLM with kiln's LLM path (kiln.llm.build.compile_llm, tp_degree=)"
           for name in ("ModelBuilder", "NxDModel", "shard_checkpoint", "NxDParallelState", "BaseNxDModel",
                        "TorchScriptNxDModel", "convert_nxd_model_to_torchscript_model")}


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _ABSENT:
        raise AttributeError(f"neuronx_distributed.{name}: {_ABSENT[name]}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (kiln's NxD does not provide it)")
    globals()[name] = value
    return value
