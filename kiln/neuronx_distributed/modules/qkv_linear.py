"""``neuronx_distributed.modules.qkv_linear``."""
from kiln.distributed.qkv import GQAQKVColumnParallelLinear  # noqa: F401
