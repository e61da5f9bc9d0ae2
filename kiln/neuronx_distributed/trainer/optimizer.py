"""``neuronx_distributed.trainer.optimizer``."""
from kiln.distributed.nxd_wrappers import NxDOptimizer  # noqa: F401
