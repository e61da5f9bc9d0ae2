"""NxD's head padding: make a model whose head count does not divide by the TP degree
shardable by padding every Column/RowParallelLinear's sharded dimension to the size it
would have with ``n_heads`` rounded up to a multiple of the degree (extra heads are
zero-weighted: a padded Column output row is 0, and a padded Row input column multiplies
that 0, so the model's outputs are unchanged)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from kiln.distributed import shard
from kiln.distributed.layers import ColumnParallelLinear, RowParallelLinear


def get_number_of_extra_heads(n_head: int, tp_degree: int) -> int:
    """Heads to add so that ``n_head`` divides by ``tp_degree``."""
    return 0 if n_head % tp_degree == 0 else tp_degree - n_head % tp_degree


def _padded(param, padding):
    new = nn.Parameter(F.pad(param.data, padding), requires_grad=param.requires_grad)
    shard.copy_tensor_model_parallel_attributes(new, param)
    return new


def _pad_one(module, ratio: float) -> None:
    if isinstance(module, ColumnParallelLinear):
        extra = int(module.weight.shape[0] * ratio - module.weight.shape[0])
        module.weight = _padded(module.weight, (0, 0, 0, extra))
        if module.bias is not None:
            module.bias = _padded(module.bias, (0, extra))
    elif isinstance(module, RowParallelLinear):
        extra = int(module.weight.shape[1] * ratio - module.weight.shape[1])
        module.weight = _padded(module.weight, (0, extra))


def pad_model(model, tp_degree: int, n_heads: int, wrapped_classes=(), pad_hook_fn=None):
    """Pad ``model`` in place (and return it) for ``tp_degree``. Only ``wrapped_classes``
    and their submodules are padded when given; ``pad_hook_fn(module, tgt_src_ratio)`` is
    called on each padded module (children first), e.g. to fix a ``split_size``. The
    attention code must size its heads with :func:`get_number_of_extra_heads` too."""
    wrapped_classes = tuple(wrapped_classes)
    ratio = (n_heads + get_number_of_extra_heads(n_heads, tp_degree)) / n_heads

    def walk(module, should_pad):
        for _, child in module.named_children():
            walk(child, should_pad or (bool(wrapped_classes) and isinstance(child, wrapped_classes)))
        if should_pad:
            if pad_hook_fn:
                pad_hook_fn(module, ratio)
            _pad_one(module, ratio)
        return module

    return walk(model, not wrapped_classes or isinstance(model, wrapped_classes))
