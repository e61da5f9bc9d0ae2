"""Hugging Face accelerate (1.16 and later) beside kiln's device.

* **Its own choice of device.** accelerate asks ``torch.accelerator.current_accelerator()``
  for the machine's accelerator, and kiln's device is that accelerator wherever kiln is
  installed (device autoload). So a plain CPU script, which never asked for the device, had
  its model moved onto it by ``Accelerator.prepare``; a ``transformers.Trainer`` script
  failed at its first step ("Calculated loss must be on the original device: cpu but device
  in use is kiln:0": the Trainer's own device stayed the CPU). As with ``nn.DataParallel``
  (:mod:`kiln.device.data_parallel`) and FSDP2's default mesh (:mod:`kiln.device.fsdp_mesh`),
  a library that picks the accelerator by itself now sees none: such a script runs as on a
  machine without one. Training on the device through accelerate is its XLA path, under
  ``kiln run-xla`` (``is_torch_xla_available()``), which does not ask for the accelerator.
* **Its XLA path's optimizer.** Moving a model onto an XLA device makes new parameters, and
  ``prepare`` points the optimizer at them only where the device's type is ``xla`` or
  ``tpu``; kiln's is ``kiln`` (or ``neuron``), so the optimizer kept stepping the CPU
  copies and the model on the device never trained, without a word (every loss after the
  first differed from the CPU run's by up to 5 %). Under the XLA path the optimizer is now
  pointed at the device's parameters, as on a TPU.
"""
from __future__ import annotations

import functools
import sys

from kiln.device import import_patch

DISCOVERY = "accelerate.utils.imports"
ACCELERATOR = "accelerate.accelerator"


def install() -> None:
    import_patch.when_imported(DISCOVERY, _patch_discovery)
    import_patch.when_imported(ACCELERATOR, _patch_remap)


def _patch_discovery(module) -> None:
    original = getattr(module, "get_torch_accelerator_backend", None)
    if original is None or getattr(original, "_kiln", False):
        return              # an accelerate before 1.16 does not ask torch.accelerator

    @functools.wraps(original)
    def get_torch_accelerator_backend(*args, **kwargs):
        from kiln.device import tensor as dt
        kind, device_module = original(*args, **kwargs)
        if kind == dt.device_type():
            return None, None
        return kind, device_module

    get_torch_accelerator_backend._kiln = True
    # the device registered after accelerate was imported (autoload off): its modules hold
    # copies of the name (``from .utils import ...``), replaced too
    for name, other in list(sys.modules.items()):
        if (name == "accelerate" or name.startswith("accelerate.")) and \
                getattr(other, "get_torch_accelerator_backend", None) is original:
            other.get_torch_accelerator_backend = get_torch_accelerator_backend
    module.get_torch_accelerator_backend = get_torch_accelerator_backend


def _patch_remap(module) -> None:
    accelerator = module.Accelerator
    original = getattr(accelerator, "_get_parameters_to_remap", None)
    if original is None or getattr(original, "_kiln", False):
        return              # an accelerate before 1.16 remapped on its XLA path whatever the device type

    @functools.wraps(original)
    def _get_parameters_to_remap(self, *args):
        from kiln.device import tensor as dt
        got = original(self, *args)
        if not got and self.distributed_type == module.DistributedType.XLA and self.device.type == dt.device_type():
            return self._get_named_parameters(*args)
        return got

    _get_parameters_to_remap._kiln = True
    accelerator._get_parameters_to_remap = _get_parameters_to_remap
