"""``neuronx_distributed.trainer``: NxD's trainer API (:mod:`kiln.distributed.trainer`,
:mod:`kiln.distributed.checkpoint`).

Importing it installs NxD's choice of training device: ``initialize_parallel_model``
moves the model to ``neuronx_distributed.utils.get_device()``, which is
``xm.xla_device()`` (kiln's device, lazy mode) or the CPU under ``NXD_CPU_MODE=1``.
"""
from __future__ import annotations

from kiln.distributed.checkpoint import (  # noqa: F401
    finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint,
)
from kiln.distributed.nxd_wrappers import NxDModel, NxDOptimizer  # noqa: F401
from kiln.distributed.trainer import (  # noqa: F401
    initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config, set_device_resolver,
)
from kiln.neuronx_distributed.utils import get_device

set_device_resolver(get_device)
