"""``neuronx_distributed.parallel_layers.pad``."""
from kiln.distributed.pad import get_number_of_extra_heads, pad_model  # noqa: F401
