"""``neuronx_distributed.optimizer.zero_redundancy_optimizer``."""
from kiln.distributed.zero1 import NeuronZero1Optimizer  # noqa: F401
