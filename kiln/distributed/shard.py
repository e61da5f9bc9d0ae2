"""How tensor-parallel parameters are cut: NxD's parameter attributes, the slicing of a full
("master") tensor into one rank's shard, and the sharding of a whole unsharded state dict.

One function does the cutting for both initialization and checkpoint loading
(:func:`create_local_weight`, NxD's name), so a model initialized at TP=N holds exactly
the slices of the TP=1 model built from the same seed (weights and biases: the layers
draw every bias at its full size too), and an unsharded checkpoint loads into the same
slices.

``stride`` is Megatron's: the full tensor is split along ``partition_dim`` into chunks of
``per_partition / stride`` and rank r takes chunks ``r, r+tp, r+2tp, ...`` concatenated,
so a fused ``[gate; up]`` weight with ``stride=2`` gives each rank ``[gate_r; up_r]``.
"""
from __future__ import annotations

import torch

_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1,
                       "num_partitions": 1, "rank_ordering": None}


def divide(numerator: int, denominator: int) -> int:
    """Exact division (NxD's ``utils.divide``): a size that does not split is an error."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}: a tensor-parallel dimension must be "
                         "a multiple of the tensor-parallel degree (or use pad=True for inference)")
    return numerator // denominator


def get_padding_length(size: int, multiple: int) -> int:
    """How much to add to ``size`` to reach a multiple of ``multiple``."""
    return (-size) % multiple


def split_tensor_along_last_dim(tensor, num_partitions: int, contiguous_split_chunks: bool = False):
    """Split a tensor along its last dimension into ``num_partitions`` equal views."""
    last = tensor.dim() - 1
    chunks = torch.split(tensor, divide(tensor.size()[last], num_partitions), dim=last)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int = 1,
                                         num_partitions: int = -1, rank_ordering=None) -> None:
    """Tag a parameter as tensor-parallel along ``dim``: what clip_grad_norm, checkpointing
    and optimizers read to know a tensor is a shard."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride
    tensor.num_partitions = num_partitions
    tensor.rank_ordering = rank_ordering


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor) -> None:
    for name, value in _ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor, source_tensor) -> None:
    for name in _ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(param, tp_rank: int) -> bool:
    """True for a TP shard, or for a replicated parameter on TP rank 0 (count it once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def create_local_weight(full_weight, partition_dim: int, per_partition_size: int, stride: int,
                        out_weight=None, *, tp_rank: int | None = None, tp_size: int | None = None):
    """This rank's shard of ``full_weight`` (NxD's ``create_local_weight``; the rank and
    degree default to the parallel state's): chunks of ``per_partition_size / stride``
    along ``partition_dim``, taking every ``tp_size``-th from ``tp_rank``."""
    if tp_rank is None or tp_size is None:
        from kiln.distributed import state
        tp_rank, tp_size = state.get_tensor_model_parallel_rank(), state.get_tensor_model_parallel_size()
    if full_weight.shape[partition_dim] != per_partition_size * tp_size:
        raise ValueError(f"cannot shard a tensor of size {full_weight.shape[partition_dim]} along dim "
                         f"{partition_dim} into {tp_size} shards of {per_partition_size}")
    chunks = torch.split(full_weight, divide(per_partition_size, stride), dim=partition_dim)
    with torch.no_grad():
        if out_weight is None:
            return torch.cat(chunks[tp_rank::tp_size], dim=partition_dim)
        return torch.cat(chunks[tp_rank::tp_size], dim=partition_dim, out=out_weight)


def init_master_and_shard(param, partition_dim: int, init_method, dtype, stride: int, tp_rank: int,
                          tp_size: int, keep_master: bool = False):
    """NxD's CPU initialization: build the full fp32 master (``init_method`` on it, drawing
    from the global RNG identically on every rank), cast to ``dtype``, and copy this
    rank's slice into ``param``. Returns the master when ``keep_master``."""
    shape = list(param.shape)
    shape[partition_dim] *= tp_size
    master = torch.nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
    init_method(master)
    master = master.detach().to(dtype)
    with torch.no_grad():
        param.copy_(create_local_weight(master, partition_dim, param.shape[partition_dim], stride,
                                        tp_rank=tp_rank, tp_size=tp_size))
    return master if keep_master else None


def shard_state_dict(module, full_state_dict: dict, tp_rank: int, tp_size: int, prefix: str = "") -> dict:
    """Shard an unsharded state dict for ``module`` (what ``load(..., sharded=False)`` and
    NxD's ``get_sharded_model_dict`` do): each key whose parameter in ``module`` is tagged
    ``tensor_model_parallel`` is cut with :func:`create_local_weight` (partition dims 0 and
    1 only, as NxD), after the owning submodule's ``preshard_hook`` (which pads when the
    layer was built with ``pad=True``); every other entry is kept as it is. ``prefix`` is
    prepended to the module's own names when the state dict holds a larger model's keys."""
    out = dict(full_state_dict)
    params = dict(module.named_parameters())
    for name, sub in module.named_modules():
        hook = getattr(sub, "preshard_hook", None)
        if hook is None:
            continue
        key = prefix + (f"{name}.weight" if name else "weight")
        if key in out:      # NxD hands the hook the weight's key (it pads the weight)
            hook(out, key)
    for name, param in params.items():
        key = prefix + name
        if key not in out or not getattr(param, "tensor_model_parallel", False):
            continue
        dim = param.partition_dim
        if dim not in (0, 1):
            raise ValueError(f"{key}: partition_dim {dim} cannot be sharded from an unsharded checkpoint "
                             "(NxD shards along dims 0 and 1 only)")
        per_partition = divide(out[key].shape[dim], tp_size)
        out[key] = create_local_weight(out[key], dim, per_partition, getattr(param, "partition_stride", 1),
                                       tp_rank=tp_rank, tp_size=tp_size)
    return out


class EmbeddingUtility:
    """Vocabulary ranges of a vocab-parallel embedding (Megatron's VocabUtility)."""

    @staticmethod
    def range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int, world_size: int):
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int):
        per = divide(global_vocab_size, world_size)
        return EmbeddingUtility.range_from_per_partition_vocab_size(per, rank, world_size)
