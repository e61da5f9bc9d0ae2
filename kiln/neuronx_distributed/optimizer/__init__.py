"""``neuronx_distributed.optimizer``: ZeRO-1 (:mod:`kiln.distributed.zero1`)."""
from kiln.distributed.zero1 import NeuronZero1Optimizer  # noqa: F401
