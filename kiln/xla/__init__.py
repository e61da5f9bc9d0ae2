"""torch_xla's module paths over kiln's lazy device: swap ``torch_xla`` for ``kiln.xla``
in a torch-neuronx training script's imports, or run it unchanged with
``kiln run-xla script.py``.

* ``kiln.xla.core.xla_model``: ``xla_device``, ``mark_step``, ``optimizer_step``, ``save``,
  ``get_ordinal``, ``xrt_world_size``, ``is_master_ordinal``, ``master_print``,
  ``add_step_closure``, ``rendezvous``, ``all_reduce`` (:mod:`kiln.compat.xla_model`).
* ``kiln.xla.distributed.parallel_loader``: ``MpDeviceLoader``, ``ParallelLoader``.
* ``kiln.xla.distributed.xla_backend``: importing it registers the ``"xla"``
  ``torch.distributed`` backend (gloo on the device's host memory).
* ``kiln.xla.debug.metrics``: ``metrics_report()`` and the counters.
* ``kiln.xla.runtime``: ``world_size``, ``global_ordinal``, ``local_ordinal``.
* ``kiln.xla.device()`` and ``kiln.xla.sync()``: torch_xla 2.x's shorter spellings.
* ``kiln.xla.amp.autocast(device)``, and ``torch.autocast("xla", ...)`` once this package is
  imported: bf16 autocast on kiln's device (:mod:`kiln.compat.xla_amp`); ``amp.GradScaler``,
  ``amp.syncfree``.
* ``kiln.xla.distributed.xla_multiprocessing``: ``spawn`` (:mod:`kiln.compat.xla_spawn`).
* ``kiln.xla.utils.utils``: ``SampleGenerator``; ``kiln.xla.utils.serialization``: ``save``,
  ``load`` (:mod:`kiln.compat.xla_serialization`).
* ``kiln.xla.debug.profiler``: ``StepTrace``, ``Trace``, ``start_server``.
"""
from kiln.compat import xla_amp as _amp

# the torch_xla release whose API these modules follow; libraries read it to pick code paths
# (transformers' Trainer imports it when it sees torch_xla, as it does under ``kiln run-xla``)
__version__ = "2.9.0+kiln"

_amp.install()


def device(index=None):
    from kiln.compat import xla_model
    return xla_model.xla_device(index)


def sync(wait: bool = False):
    from kiln.compat import xla_model
    xla_model.mark_step(wait)
