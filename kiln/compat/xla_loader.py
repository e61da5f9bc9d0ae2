"""torch_xla's ``parallel_loader`` (``MpDeviceLoader``, ``ParallelLoader``) on kiln's
device: batches moved to the device as they are taken, and ``mark_step`` between
batches, so each training step is one program without the script calling it.
"""
from __future__ import annotations

from kiln.compat import xla_model as xm


class PerDeviceLoader:
    """Iterates ``loader`` with each batch on ``device``; marks the step before taking the
    next batch (as torch_xla does: the step that used the last batch ends there) and
    once more when the loader is exhausted."""

    def __init__(self, loader, device, batches_per_execution: int = 1):
        self._loader = loader
        self._device = device
        self._per = max(1, int(batches_per_execution))

    def __iter__(self):
        taken = 0
        for batch in self._loader:
            if taken and taken % self._per == 0:
                xm.mark_step()
            taken += 1
            yield xm.to_device(batch, self._device)
        xm.mark_step()

    def __len__(self):
        return len(self._loader)


class ParallelLoader:
    def __init__(self, loader, devices, batchdim=0, batches_per_execution=1, loader_prefetch_size=8,
                 device_prefetch_size=4, host_to_device_transfer_threads=1, input_sharding=None):
        self._loader = loader
        self._per = batches_per_execution

    def per_device_loader(self, device):
        return PerDeviceLoader(self._loader, device, self._per)


class MpDeviceLoader:
    """``for x, y in MpDeviceLoader(loader, device)``: batches on the device, a step each.
    A class with torch_xla's attributes (``_loader``, ``_device``), as libraries subclass it
    (accelerate's ``MpDeviceLoaderWrapper``, defined when accelerate sees torch_xla: under
    ``kiln run-xla`` a function here made ``import transformers`` fail)."""

    def __init__(self, loader, device, **kwargs):
        self._loader = loader
        self._device = device
        self._parallel_loader_kwargs = kwargs

    def __iter__(self):
        return iter(PerDeviceLoader(self._loader, self._device,
                                    self._parallel_loader_kwargs.get("batches_per_execution", 1)))

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        """The wrapped loader's attributes (``dataset``, ``sampler``, ``batch_size``), which
        libraries read through the wrapper (accelerate's ``save_state`` reads ``dataset``)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)
