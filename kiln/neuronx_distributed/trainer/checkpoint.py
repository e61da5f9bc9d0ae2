"""``neuronx_distributed.trainer.checkpoint``."""
from kiln.distributed.checkpoint import (  # noqa: F401
    finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint,
)
