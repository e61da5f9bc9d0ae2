"""``neuronx_distributed.parallel_layers.mappings``."""
from kiln.distributed.mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region, enter_expert_parallel_region, exit_expert_parallel_region,
    gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region_with_dim, reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, reduce_scatter_to_tensor_model_parallel_region_with_dim,
    scatter_input_channels_to_tensor_model_parallel_region, scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
