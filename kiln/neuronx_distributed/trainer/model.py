"""``neuronx_distributed.trainer.model``."""
from kiln.distributed.nxd_wrappers import NxDModel  # noqa: F401
