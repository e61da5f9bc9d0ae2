"""``neuronx_distributed.parallel_layers``: NxD's exports. ``load`` and ``save`` come from
``parallel_layers.checkpointing`` on first use."""
from __future__ import annotations

import importlib

from kiln.neuronx_distributed.parallel_layers import (  # noqa: F401
    grads, layer_norm, layers, loss_functions, mappings, pad, parallel_state, random, utils,
)
from kiln.neuronx_distributed.parallel_layers.grads import clip_grad_norm  # noqa: F401
from kiln.neuronx_distributed.parallel_layers.layers import (  # noqa: F401
    ColumnParallelLinear, ParallelEmbedding, RowParallelLinear,
)
from kiln.neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy  # noqa: F401
from kiln.neuronx_distributed.parallel_layers.mappings import (  # noqa: F401
    copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region,
)
from kiln.neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel  # noqa: F401
from kiln.neuronx_distributed.parallel_layers.random import (  # noqa: F401
    get_xla_rng_tracker, model_parallel_xla_manual_seed,
)
from kiln.neuronx_distributed.parallel_layers.utils import (  # noqa: F401
    copy_tensor_model_parallel_attributes, set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes, split_tensor_along_last_dim,
)
from kiln.neuronx_distributed.utils.model_utils import move_model_to_device  # noqa: F401

PARALLEL_MODULES = [ColumnParallelLinear, RowParallelLinear, ParallelEmbedding]
PARALLEL_FUNCTIONS = [
    copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
    parallel_cross_entropy, clip_grad_norm,
]


def __getattr__(name):
    if name in ("load", "save"):
        value = getattr(importlib.import_module(f"{__name__}.checkpointing"), name)
    elif name == "checkpointing":
        value = importlib.import_module(f"{__name__}.checkpointing")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (kiln's NxD does not provide it)")
    globals()[name] = value
    return value
