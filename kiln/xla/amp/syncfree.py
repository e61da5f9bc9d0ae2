"""``torch_xla.amp.syncfree``: ``SGD``, ``Adam`` and ``AdamW`` whose ``step`` takes
``found_inf`` (:mod:`kiln.compat.xla_amp`)."""
from kiln.compat.xla_amp import SGD, Adam, AdamW

__all__ = ["SGD", "Adam", "AdamW"]
