"""``neuronx_distributed.pipeline``: NxD's pipeline-parallel model
(:mod:`kiln.distributed.pipeline`).

Importing it installs NxD's choice of device for the stages, as
``neuronx_distributed.trainer`` does for the whole model: ``neuronx_distributed.utils.get_device()``,
which is ``xm.xla_device()`` (kiln's device) or the CPU under ``NXD_CPU_MODE=1``.
"""
from __future__ import annotations

from kiln.distributed.pipeline import NxDPPModel, set_device_resolver  # noqa: F401
from kiln.neuronx_distributed.pipeline import model, partition, scheduler  # noqa: F401
from kiln.neuronx_distributed.utils import get_device

set_device_resolver(get_device)

__all__ = ["NxDPPModel"]
