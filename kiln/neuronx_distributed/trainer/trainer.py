"""``neuronx_distributed.trainer.trainer``."""
import kiln.neuronx_distributed.trainer  # noqa: F401  (installs the training device)
from kiln.distributed.trainer import (  # noqa: F401
    initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config,
)
