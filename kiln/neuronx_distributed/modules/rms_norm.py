"""``neuronx_distributed.modules.rms_norm``."""
from kiln.distributed.norms import RMSNorm  # noqa: F401
