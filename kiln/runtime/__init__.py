"""The run side: a ``.kiln`` artifact loaded as a callable ``torch.nn.Module``.

``loader`` (artifact → model, by kind) · ``model`` (CompiledModel: checks inputs and
runs the host ``program`` of engine partitions and fallback ops) · ``buckets``
(Bucketed, DynamicBatch) · ``stages`` (Pipeline over kiln cores) · ``replicas``
(DataParallel worker processes) · ``workers`` (a process pinned to a core) ·
``torchscript``/``script_op`` (torch.jit.save / torch.jit.load bridge) · ``options``.
Nothing here imports the compiler: a machine that only runs artifacts needs none of it.
"""
from kiln.runtime import script_op  # noqa: F401  (declares kiln::run for torch.jit.load)
from kiln.runtime.loader import from_artifact, load
from kiln.runtime.model import CompiledModel, Model

__all__ = ["CompiledModel", "Model", "from_artifact", "load"]
