"""``neuronx_distributed.parallel_layers.layers``."""
from kiln.distributed.layers import (  # noqa: F401
    BaseParallelLinear, ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, linear_with_async_allreduce,
)
from kiln.distributed.shard import (  # noqa: F401
    copy_tensor_model_parallel_attributes, create_local_weight, set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
