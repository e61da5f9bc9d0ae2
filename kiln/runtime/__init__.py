"""The run side: a ``.kiln`` artifact loaded as a callable ``torch.nn.Module``.

``loader`` (artifact → model, by kind) · ``model`` (CompiledModel: checks inputs and
runs the host ``program`` of engine partitions and fallback ops) · ``buckets``
(Bucketed, DynamicBatch) · ``stages`` (Pipeline over kiln cores) · ``replicas``
(DataParallel worker processes) · ``workers`` (a process pinned to a core) ·
``torchscript``/``script_op`` (torch.jit.save / torch.jit.load bridge) · ``options``.
Nothing here imports the compiler: a machine that only runs artifacts needs none of it.
"""
import importlib

from kiln.runtime import script_op  # noqa: F401  (declares kiln::run for torch.jit.load)

__all__ = ["CompiledModel", "Model", "from_artifact", "load"]
# the loader and the model on first use (PEP 562): ``import kiln`` (which every ``import torch``
# reaches through kiln's device autoload) declares ``kiln::run`` through this package, and
# should not pay for the engines' imports to do it
_LAZY = {"from_artifact": "kiln.runtime.loader", "load": "kiln.runtime.loader",
         "CompiledModel": "kiln.runtime.model", "Model": "kiln.runtime.model"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
