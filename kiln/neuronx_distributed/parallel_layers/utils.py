"""``neuronx_distributed.parallel_layers.utils``."""
from kiln.distributed import state as _state
from kiln.distributed.shard import (  # noqa: F401
    EmbeddingUtility, copy_tensor_model_parallel_attributes, divide, get_padding_length,
    set_defaults_if_not_set_tensor_model_parallel_attributes, set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
)


def param_is_not_tensor_parallel_duplicate(param) -> bool:
    """A TP shard, or a replicated parameter on TP rank 0 (so each is counted once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or _state.get_tensor_model_parallel_rank() == 0
