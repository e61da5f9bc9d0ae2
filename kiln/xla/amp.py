"""``torch_xla.amp``: ``autocast(device, enabled=True, dtype=None)`` on kiln's device
(:mod:`kiln.compat.xla_amp`; bf16 by default)."""
from kiln.compat.xla_amp import xla_autocast as autocast

__all__ = ["autocast"]
