"""NxD's tensor-/sequence-parallel region mappings: autograd functions whose forward and
backward are collectives over the TP group (or the ``process_group`` given).

Every collective is a ``torch.ops.kiln.*`` operator (:mod:`kiln.distributed.ops`) naming
its group symbolically, not ``dist.all_reduce`` on a process-group handle: so
``torch.export`` of a tensor-parallel module keeps each collective as a graph node (what
``parallel_model_trace`` and kiln's compiled TP graphs rely on), and the same code runs
eagerly through the group bound to that name. Like NxD, a group of one rank skips the
collective entirely (no node is emitted).
"""
from __future__ import annotations

import torch

from kiln.distributed import mesh, ops, state


def _name_size(process_group):
    state.ensure_initialized()
    return state.group_name(process_group), state.group_size(process_group)


def _dim(x, dim: int) -> int:
    return dim % x.dim()


def _reduce(x, process_group=None, dtype=None):
    name, size = _name_size(process_group)
    if size == 1:
        return x
    if dtype is not None and x.dtype != dtype:
        return ops.all_reduce(x.to(dtype), name).to(x.dtype)
    return ops.all_reduce(x, name)


def _split(x, dim: int, process_group=None):
    name, size = _name_size(process_group)
    if size == 1:
        return x
    dim = _dim(x, dim)
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over {size} ranks: "
                         "it must be a multiple of the tensor-parallel degree")
    return torch.chunk(x, size, dim=dim)[state.group_rank(process_group)].contiguous()


def _gather(x, dim: int, process_group=None):
    name, size = _name_size(process_group)
    if size == 1:
        return x
    return ops.all_gather(x.contiguous(), _dim(x, dim), size, name)


def _reduce_scatter(x, dim: int, process_group=None, dtype=None):
    name, size = _name_size(process_group)
    if size == 1:
        return x
    dim = _dim(x, dim)
    if x.shape[dim] % size != 0:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {size} ranks: "
                         "it must be a multiple of the tensor-parallel degree")
    if dtype is not None and x.dtype != dtype:
        return ops.reduce_scatter(x.to(dtype).contiguous(), dim, size, name).to(x.dtype)
    return ops.reduce_scatter(x.contiguous(), dim, size, name)


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (the input fans out to every rank)."""

    @staticmethod
    def forward(ctx, x, group, dtype):
        ctx.group, ctx.dtype = group, dtype
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group, ctx.dtype), None, None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group, dtype):
        return _reduce(x, group, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk of ``dim``; all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along ``dim``; the gradient is split back to this rank's chunk."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence dim; backward reduce-scatters (into a TP region) or
    splits (when the consumer is not model-parallel)."""

    @staticmethod
    def forward(ctx, x, dim, to_model_parallel, group):
        ctx.dim, ctx.to_mp, ctx.group = dim, to_model_parallel, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.to_mp:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Reduce-scatter along ``dim`` (optionally in ``dtype``); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, dim, group, dtype):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group, dtype)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None, None


# -- NxD's helper functions ----------------------------------------------------------------
def copy_to_tensor_model_parallel_region(input_, process_group=None):
    return _CopyToRegion.apply(input_, process_group, None)


def copy_to_region(input_, process_group=None, reduce_dtype=None):
    """:func:`copy_to_tensor_model_parallel_region` whose gradient all-reduce runs in
    ``reduce_dtype`` (ColumnParallelLinear's input-gradient reduction, fp32 by default)."""
    return _CopyToRegion.apply(input_, process_group, reduce_dtype)


def reduce_from_tensor_model_parallel_region(input_, process_group=None, dtype=None):
    """Sum over the group (in ``dtype`` if given, e.g. RowParallelLinear's fp32 reduce)."""
    return _ReduceFromRegion.apply(input_, process_group, dtype)


def scatter_to_tensor_model_parallel_region(input_, process_group=None):
    return _ScatterToRegion.apply(input_, -1, process_group)


def gather_from_tensor_model_parallel_region(input_, process_group=None):
    return _GatherFromRegion.apply(input_, -1, process_group)


def scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None):
    return _ScatterToRegion.apply(input_, sequence_dimension, process_group)


def gather_from_sequence_parallel_region(input_, sequence_dimension=0, to_model_parallel=True,
                                         process_group=None, tile_cc=False):
    _no_tile_cc(tile_cc)
    return _GatherFromSequenceRegion.apply(input_, sequence_dimension, to_model_parallel, process_group)


def reduce_scatter_to_sequence_parallel_region(input_, sequence_dimension=0, process_group=None, dtype=None):
    return _ReduceScatterToRegion.apply(input_, sequence_dimension, process_group, dtype)


def gather_from_tensor_model_parallel_region_with_dim(input_, gather_dim, process_group=None):
    return _GatherFromRegion.apply(input_, gather_dim, process_group)


def reduce_scatter_to_tensor_model_parallel_region_with_dim(input_, partition_dim, process_group=None,
                                                            dtype=None):
    return _ReduceScatterToRegion.apply(input_, partition_dim, process_group, dtype)


def scatter_input_channels_to_tensor_model_parallel_region(input_, process_group=None):
    """Split dim 1 ([N, C, H, W] channels) across the group; all-gather the gradient."""
    return _ScatterToRegion.apply(input_, 1, process_group)


def _no_tile_cc(tile_cc):
    mesh.unsupported("tile_cc", tile_cc, "tiled collectives are a Neuron scheduling option", False)


def enter_expert_parallel_region(*args, **kwargs):
    raise mesh.UnsupportedOptionError("expert parallelism (NxD MoE regions) is not supported by "
                                      "kiln.neuronx_distributed")


exit_expert_parallel_region = enter_expert_parallel_region
