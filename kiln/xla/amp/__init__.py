"""``torch_xla.amp``: ``autocast(device, enabled=True, dtype=None)`` on kiln's device
(:mod:`kiln.compat.xla_amp`; bf16 by default), ``GradScaler`` (float16 loss scaling, as
``torch.amp.GradScaler`` does it on kiln's device) and ``syncfree`` (its optimizers)."""
from kiln.compat.xla_amp import GradScaler
from kiln.compat.xla_amp import xla_autocast as autocast

__all__ = ["GradScaler", "autocast"]
