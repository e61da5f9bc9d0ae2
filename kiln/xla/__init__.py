"""torch_xla's module paths over kiln's lazy device: swap ``torch_xla`` for ``kiln.xla``
in a torch-neuronx training script's imports, or run it unchanged with
``kiln run-xla script.py``.

* ``kiln.xla.core.xla_model``: ``xla_device``, ``mark_step``, ``optimizer_step``, ``save``,
  ``get_ordinal``, ``xrt_world_size``, ``is_master_ordinal``, ``master_print``,
  ``add_step_closure``, ``rendezvous``, ``all_reduce``, ``reduce_scatter``, ``all_to_all``
  (:mod:`kiln.compat.xla_model`).
* ``kiln.xla.distributed.fsdp``: not provided; importing it raises ImportError naming
  FSDP2 (``torch.distributed.fsdp.fully_shard``), which runs on kiln's device.
* ``kiln.xla.distributed.parallel_loader``: ``MpDeviceLoader``, ``ParallelLoader``.
* ``kiln.xla.distributed.xla_backend``: importing it registers the ``"xla"``
  ``torch.distributed`` backend (gloo on the device's host memory).
* ``kiln.xla.debug.metrics``: ``metrics_report()`` and the counters.
* ``kiln.xla.runtime``: ``world_size``, ``global_ordinal``, ``local_ordinal``.
* ``kiln.xla.device()``, ``devices()``, ``device_count()``, ``sync()``, ``step()``,
  ``compile()``, ``manual_seed()``, ``launch()``: torch_xla 2.x's top-level API.
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


def devices() -> list:
    """The devices this process drives: one, kiln's (one NeuronCore per process)."""
    return [device()]


def real_devices() -> list:
    return ["NEURON:0"]


def device_count() -> int:
    return len(real_devices())


def sync(wait: bool = False, reset_scope: bool = True):
    from kiln.compat import xla_model
    xla_model.mark_step(wait)


def manual_seed(seed, device=None):
    """Seed the generator the device draws from (the CPU's), every time: the stream restarts."""
    import torch
    torch.manual_seed(int(seed))


def compile(f=None, full_graph: bool = False, name=None, max_different_graphs=None):
    """torch_xla 2.x's ``torch_xla.compile``: the region (a context, or calls of ``f``) is one
    step, with the step before it ended first and the region's own ended after it, as
    torch_xla does. kiln's lazy mode records it as one program; ``full_graph`` and
    ``max_different_graphs`` (torch_xla's checks that the region ran as one program, and
    how many programs it may make) are not checked here, and say so."""
    import contextlib
    import functools
    import warnings
    if full_graph or max_different_graphs is not None:
        warnings.warn("kiln: torch_xla.compile(full_graph=..., max_different_graphs=...) is not checked on "
                      "kiln's device; the region runs as one step (kiln.device.metrics counts its programs)",
                      RuntimeWarning, stacklevel=2)

    @contextlib.contextmanager
    def region():
        sync()
        try:
            yield
        finally:
            sync()

    if f is None:
        return region()

    @functools.wraps(f)
    def run(*args, **kwargs):
        with region():
            return f(*args, **kwargs)
    return run


def step():
    """``with torch_xla.step(): ...``: the body as one step (:func:`compile`)."""
    return compile()


def launch(fn, args=(), start_method=None, debug_single_process: bool = False):
    """torch_xla's ``launch``: ``fn(index, *args)`` in each rank. Under torchrun, in this
    process with its local rank; otherwise through ``xmp.spawn`` (one rank per kiln core, or
    one with ``debug_single_process``). torch_xla starts them with ``"spawn"``; kiln forks
    unless asked (a spawned child would not have ``kiln run-xla``'s alias), see
    :mod:`kiln.compat.xla_spawn`."""
    import os
    import torch.distributed as dist
    from kiln.compat import xla_spawn
    if dist.is_torchelastic_launched():
        return fn(int(os.environ.get("LOCAL_RANK", "0")), *args)
    return xla_spawn.spawn(fn, args=args, nprocs=1 if debug_single_process else None, start_method=start_method)
