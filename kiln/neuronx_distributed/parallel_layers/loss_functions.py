"""``neuronx_distributed.parallel_layers.loss_functions``."""
from kiln.distributed.loss import from_parallel_logits_to_logprobs, parallel_cross_entropy  # noqa: F401
