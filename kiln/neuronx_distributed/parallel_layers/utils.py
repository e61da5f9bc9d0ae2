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


def is_pjrt_device() -> bool:
    """NxD's test for torch_xla's PJRT runtime on Neuron (``PJRT_DEVICE=NEURON``)."""
    import os
    return os.environ.get("PJRT_DEVICE") == "NEURON"


def requires_init_pg_override() -> bool:
    """NxD's test for torch 2.0 with PJRT, whose ``init_process_group("xla")`` needed
    ``init_method="pjrt://"``: never on kiln's torch, so a script takes its plain
    ``init_process_group`` branch."""
    import torch
    return torch.__version__.startswith("2.0") and is_pjrt_device()
