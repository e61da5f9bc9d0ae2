"""NxD's tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, ParallelEmbedding.

Signatures, parameter shapes and weight initialization are NxD's (weights in torch's
``[out, in]`` layout; the full fp32 master built with ``init_method`` on every rank and
sliced). Biases are drawn the same way: the full bias, U(±1/√in) with the layer's whole
``input_size``, then this rank's slice, so every parameter's TP=N shards concatenate to the
TP=1 parameter of the same seed, and the random stream advances by the same amount at every
degree. NxD's own code differs there: it draws a column-parallel sharded bias at the local
size on each rank, and a row-parallel bias from U(±1/√(in/tp)). Parameters on another
device (``device="kiln"``, CUDA) are initialized the same way on the CPU and then moved,
so they are as deterministic as CPU ones; ``device="meta"`` only allocates.

Options NxD has that kiln does not implement (``tile_cc``, ``rank_ordering``,
``use_spmd_rank``, ``slice_indices``) are accepted at their defaults and are a
:class:`~kiln.distributed.mesh.UnsupportedOptionError` naming the option otherwise; any
other keyword is Python's own ``TypeError``, as in NxD.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import mappings, mesh, shard, state


def kaiming_init(weight):
    """NxD's default weight init: torch.nn.Linear's (kaiming uniform, a=sqrt(5))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class TensorParallelModule(nn.Module):
    """Group resolution and parameter creation shared by the layers."""

    def _bind_group(self, tensor_model_parallel_group):
        state.ensure_initialized()
        self.tensor_parallel_group = (tensor_model_parallel_group if tensor_model_parallel_group is not None
                                      else state.get_tensor_model_parallel_group())
        self._group_arg = tensor_model_parallel_group
        self.tp_size = state.group_size(tensor_model_parallel_group)
        self.tp_rank = state.group_rank(tensor_model_parallel_group)
        return self.tp_size

    def _sharded_param(self, shape, partition_dim, init_method, dtype, device, stride=1, keep_master=False):
        """A tensor-parallel parameter initialized NxD's CPU way, then moved to ``device``."""
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "meta":
            param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
            master = None
        else:
            param = nn.Parameter(torch.empty(*shape, dtype=dtype))
            master = shard.init_master_and_shard(param, partition_dim, init_method, dtype, stride,
                                                 self.tp_rank, self.tp_size, keep_master)
            if device is not None and device.type != "cpu":
                param = nn.Parameter(param.detach().to(device))
        shard.set_tensor_model_parallel_attributes(param, True, partition_dim, stride, self.tp_size)
        return param, master

    def _plain_param(self, shape, dtype, device, bound, partition_stride=None):
        """A bias U(±bound) of full ``shape``; with ``partition_stride``, this rank's dim-0
        slice of it (the full draw on every rank, as the weights)."""
        device = torch.device(device) if device is not None else None
        if device is not None and device.type == "meta":
            if partition_stride is not None:
                shape = (shape[0] // self.tp_size,) + tuple(shape[1:])
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
        full = torch.empty(*shape, dtype=dtype)
        nn.init.uniform_(full, -bound, bound)
        if partition_stride is not None:
            full = shard.create_local_weight(full, 0, shape[0] // self.tp_size, partition_stride,
                                             tp_rank=self.tp_rank, tp_size=self.tp_size)
        param = nn.Parameter(full)
        if device is not None and device.type != "cpu":
            param = nn.Parameter(param.detach().to(device))
        return param

    def _check_pad_mode(self):
        if self.pad and self.training:
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")


def _sequence_dimension(enabled: bool, dim):
    if enabled and dim is None:
        warnings.warn("`sequence_parallel_enabled` is set to `True`, but got `sequence_dimension` as `None`. "
                      "Defaulting `sequence_dimension` to 0.", UserWarning, stacklevel=3)
        return 0
    return dim


class BaseParallelLinear(TensorParallelModule):
    """NxD's common base of the two sharded linears: scripts find them with
    ``isinstance(module, BaseParallelLinear)`` (to exclude them from weight decay, to wrap
    them for LoRA)."""


class ColumnParallelLinear(BaseParallelLinear):
    """``Y = X Wᵀ + b`` with W's output rows split over the TP ranks (weight ``[out/tp,
    in]``, partition_dim 0). The input gradient is all-reduced (in ``reduce_dtype``); with
    ``gather_output`` the outputs are all-gathered on the last dim and the bias is full and
    added after the gather, otherwise the bias is this rank's shard. With sequence
    parallelism the input arrives sharded on ``sequence_dimension`` and is all-gathered
    (its gradient reduce-scattered)."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32,
                 device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
                 sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
                 pad_alignment_size_per_rank=1, keep_padded_output=False, tensor_model_parallel_group=None,
                 reduce_dtype=torch.float32, rank_ordering=None):
        super().__init__()
        mesh.unsupported("rank_ordering", rank_ordering, "custom rank orderings of shards are not implemented")
        world = self._bind_group(tensor_model_parallel_group)
        self.input_size, self.output_size = input_size, output_size
        self.add_bias, self.gather_output, self.pad = bias, gather_output, pad
        self.pad_size = shard.get_padding_length(output_size, world * pad_alignment_size_per_rank) if pad else 0
        self.output_size = output_size + self.pad_size
        self.keep_padded_output = keep_padded_output
        self.output_size_per_partition = shard.divide(self.output_size, world)
        self.dtype, self.stride, self.skip_bias_add = dtype, stride, skip_bias_add
        self.keep_master_weight, self.reduce_dtype = keep_master_weight, reduce_dtype
        self.arg_init_method = init_method
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = _sequence_dimension(sequence_parallel_enabled, sequence_dimension)
        if sequence_parallel_enabled and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel_enabled=True needs gather_output=False "
                             "(the output stays sharded for the next RowParallelLinear)")
        self.weight_partition_dim = 0
        self.weight, self.master_weight = self._sharded_param(
            (self.output_size_per_partition, input_size), 0, init_method or kaiming_init, dtype, device, stride,
            keep_master_weight)
        if bias:
            self.bias = self._plain_param((self.output_size,), dtype, device,
                                          1 / math.sqrt(input_size) if input_size else 0,
                                          None if gather_output else stride)
            if not gather_output:
                shard.set_tensor_model_parallel_attributes(self.bias, True, 0, stride, world)
        else:
            self.register_parameter("bias", None)
        self.async_tensor_model_parallel_allreduce = not sequence_parallel_enabled and world > 1

    def forward(self, input, slice_indices=None):
        mesh.unsupported("slice_indices", slice_indices, "output slicing inside the layer is not implemented")
        self._check_pad_mode()
        group = self._group_arg
        if self.sequence_parallel_enabled:
            x = mappings.gather_from_sequence_parallel_region(input, self.sequence_dimension, True, group)
        else:
            x = mappings.copy_to_region(input, group, self.reduce_dtype)
        local_bias = None if (self.gather_output or self.skip_bias_add) else self.bias
        out = F.linear(x, self.weight, local_bias)
        if self.gather_output:
            out = mappings.gather_from_tensor_model_parallel_region(out, group)
            if self.bias is not None and not self.skip_bias_add:
                out = out + self.bias
            if self.pad_size and not self.keep_padded_output:   # the bias is padded too: add, then narrow
                out = torch.narrow(out, -1, 0, self.output_size - self.pad_size)
        return (out, self.bias) if self.skip_bias_add else out

    def preshard_hook(self, model_state_dict, prefix):
        """Pad an unsharded checkpoint's weight the way the layer was padded, and its bias,
        which the layer pads too. NxD's hook pads the weight only, so a padded layer with a
        bias could not load an unpadded checkpoint: the bias failed the size check, or its
        odd size failed the sharding on one rank while the others waited."""
        if not self.pad or self.pad_size == 0:
            return
        size = model_state_dict[prefix].shape[0]
        if self.output_size != size + self.pad_size:
            raise RuntimeError(f"State dict {prefix} is of an unexpected size {size} expected "
                               f"{self.output_size - self.pad_size}")
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], (0, 0, 0, self.pad_size))
        bias = prefix[: -len("weight")] + "bias" if prefix.endswith("weight") else None
        if bias in model_state_dict and model_state_dict[bias].shape[0] == size:
            model_state_dict[bias] = F.pad(model_state_dict[bias], (0, self.pad_size))


class RowParallelLinear(BaseParallelLinear):
    """``Y = X Wᵀ + b`` with W's input columns split over the TP ranks (weight ``[out,
    in/tp]``, partition_dim 1). The input is split on its last dim unless
    ``input_is_parallel``; the partial outputs are all-reduced in ``reduce_dtype`` (or
    reduce-scattered on the sequence dim with sequence parallelism, or left partial with
    ``reduce_output=False``); the full bias is added after the reduction."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
                 device=None, stride=1, init_method=None, sequence_parallel_enabled=False,
                 sequence_dimension=None, keep_master_weight=False, skip_bias_add=False, pad=False,
                 reduce_output=True, tensor_model_parallel_group=None, reduce_dtype=torch.float32,
                 tile_cc=False, rank_ordering=None):
        super().__init__()
        mesh.unsupported("tile_cc", tile_cc, "tiled collectives are a Neuron scheduling option", False)
        mesh.unsupported("rank_ordering", rank_ordering, "custom rank orderings of shards are not implemented")
        world = self._bind_group(tensor_model_parallel_group)
        self.input_size, self.output_size = input_size, output_size
        self.add_bias, self.input_is_parallel, self.pad = bias, input_is_parallel, pad
        self.reduce_output, self.reduce_dtype, self.skip_bias_add = reduce_output, reduce_dtype, skip_bias_add
        self.pad_size = shard.get_padding_length(input_size, world) if pad else 0
        self.input_size = input_size + self.pad_size
        self.input_size_per_partition = shard.divide(self.input_size, world)
        self.dtype, self.stride, self.keep_master_weight = dtype, stride, keep_master_weight
        self.arg_init_method = init_method
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
        self.sequence_dimension = _sequence_dimension(sequence_parallel_enabled, sequence_dimension)
        self.weight_partition_dim = 1
        self.weight, self.master_weight = self._sharded_param(
            (output_size, self.input_size_per_partition), 1, init_method or kaiming_init, dtype, device, stride,
            keep_master_weight)
        if bias:
            self.bias = self._plain_param((output_size,), dtype, device, 1 / math.sqrt(input_size) if input_size else 0)
            self.bias.sequence_parallel_enabled = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)

    def forward(self, input_):
        self._check_pad_mode()
        group = self._group_arg
        if self.input_is_parallel:
            x = input_
        else:
            if self.pad_size:
                input_ = F.pad(input_, (0, self.pad_size))
            x = mappings.scatter_to_tensor_model_parallel_region(input_, group)
        out = F.linear(x, self.weight)
        if self.reduce_output and self.sequence_parallel_enabled:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, self.sequence_dimension, group,
                                                                      self.reduce_dtype)
        elif self.reduce_output:
            out = mappings.reduce_from_tensor_model_parallel_region(out, group, self.reduce_dtype)
        if self.skip_bias_add:
            return out, self.bias
        return out + self.bias if self.bias is not None else out

    def preshard_hook(self, model_state_dict, prefix):
        if not self.pad or self.pad_size == 0:
            return
        size = model_state_dict[prefix].shape[1]
        if self.input_size != size + self.pad_size:
            raise RuntimeError(f"State dict {prefix} is of an unexpected size {size} expected "
                               f"{self.input_size - self.pad_size}")
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], (0, self.pad_size))


class _ScaledGradient(torch.autograd.Function):
    """The identity forward; the gradient times ``scale`` (broadcast)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale, None


class ParallelEmbedding(TensorParallelModule):
    """An embedding whose vocabulary rows are split over the TP ranks (contiguous ranges,
    ``[V/tp, H]``): ids outside this rank's range look up row 0 and are zeroed, and the
    outputs are all-reduced (reduce-scattered on the sequence dim, after NxD's
    ``[B,S,H]→[S,B,H]`` transpose, with sequence parallelism). With
    ``shard_across_embedding`` the hidden dim is split instead (``[V, H/tp]``) and the
    outputs all-gathered. As in NxD, ``padding_idx=0`` counts as no padding index and the
    padding row is not zeroed at init."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, max_norm=None, norm_type=2.0,
                 scale_grad_by_freq=False, sparse=False, init_method=nn.init.normal_, device=None,
                 dtype=torch.float32, shard_across_embedding=False, pad=False, sequence_parallel_enabled=False,
                 tensor_model_parallel_group=None, use_spmd_rank=False, sequence_dimension=None,
                 tile_cc=False, rank_ordering=None, collect_output=True):
        super().__init__()
        mesh.unsupported("use_spmd_rank", use_spmd_rank, "ranks are known per process here", False)
        mesh.unsupported("tile_cc", tile_cc, "tiled collectives are a Neuron scheduling option", False)
        mesh.unsupported("rank_ordering", rank_ordering, "custom rank orderings of shards are not implemented")
        mesh.unsupported("collect_output", collect_output, "the output is always collected", True)
        world = self._bind_group(tensor_model_parallel_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.max_norm, self.norm_type = max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.shard_across_embedding, self.pad, self.stride = shard_across_embedding, pad, 1
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        self.init_method, self.dtype, self.pad_size = init_method, dtype, 0
        if shard_across_embedding:
            if pad:
                self.pad_size = shard.get_padding_length(embedding_dim, world)
                self.embedding_dim = embedding_dim + self.pad_size
            self.num_embeddings_per_partition = num_embeddings
            self.embedding_dim_per_partition = shard.divide(self.embedding_dim, world)
            self.padding_idx = padding_idx if padding_idx else None
            self.weight_partition_dim = 1
        else:
            if pad:
                self.pad_size = shard.get_padding_length(num_embeddings, world)
                self.num_embeddings = num_embeddings + self.pad_size
            self.start_index, self.end_index = shard.EmbeddingUtility.range_from_global_vocab_size(
                self.num_embeddings, self.tp_rank, world)
            self.num_embeddings_per_partition = self.end_index - self.start_index
            self.embedding_dim_per_partition = embedding_dim
            in_range = padding_idx and self.start_index <= padding_idx < self.end_index
            self.padding_idx = padding_idx - self.start_index if in_range else None
            self.weight_partition_dim = 0
        self.per_partition_size = (self.embedding_dim_per_partition if shard_across_embedding
                                   else self.num_embeddings_per_partition)
        self.weight, _ = self._sharded_param((self.num_embeddings_per_partition, self.embedding_dim_per_partition),
                                             self.weight_partition_dim, init_method, dtype, device)

    def _lookup(self, ids):
        return F.embedding(ids.long(), self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    def _sharded_lookup(self, ids, mask):
        """The vocabulary shard's rows for the ids in its range (the rest are row 0, masked
        out after). ``max_norm`` renormalises only the rows looked up in range, and
        ``scale_grad_by_freq`` counts only the ids in range: F.embedding on the remapped ids
        counted every other shard's id as a use of row 0, so row 0's gradient was divided by
        their number and row 0 was renormalised unused (NxD's own code does both; kiln until
        12-03 too)."""
        local = (ids.long() - self.start_index) * mask.long()
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, local[mask].contiguous(), self.max_norm, self.norm_type)
        out = F.embedding(local, self.weight, self.padding_idx, None, self.norm_type, False, self.sparse)
        if self.scale_grad_by_freq:
            counts = torch.bincount(local[mask], minlength=self.weight.shape[0]).clamp(min=1)
            out = _ScaledGradient.apply(out, (1.0 / counts[local]).to(out.dtype).unsqueeze(-1))
        return out

    def _renorm_across_ranks(self, ids):
        """``max_norm`` with the embedding dimension sharded: a row's norm is over every
        rank's slice (each rank's slice alone was renormalised by its own part of the norm)."""
        if not math.isfinite(self.norm_type) or self.norm_type <= 0:
            raise ValueError(f"ParallelEmbedding(max_norm=..., norm_type={self.norm_type}) with "
                             "shard_across_embedding=True: kiln computes the rows' norms across ranks "
                             "for a finite positive norm_type only")
        with torch.no_grad():
            rows = ids.long().reshape(-1).unique()
            part = self.weight[rows].float().abs().pow(self.norm_type).sum(-1)
            norm = mappings.reduce_from_tensor_model_parallel_region(part, self._group_arg).pow(1 / self.norm_type)
            scale = torch.where(norm > self.max_norm, self.max_norm / (norm + 1e-7), torch.ones_like(norm))
            self.weight[rows] = (self.weight[rows] * scale.unsqueeze(-1)).to(self.weight.dtype)

    def forward(self, input_):
        self._check_pad_mode()
        group = self._group_arg
        if self.shard_across_embedding:
            if self.max_norm is not None and self.tp_size > 1:
                self._renorm_across_ranks(input_)
                out = F.embedding(input_.long(), self.weight, self.padding_idx, None, self.norm_type,
                                  self.scale_grad_by_freq, self.sparse)
            else:
                out = self._lookup(input_)
            out = mappings.gather_from_tensor_model_parallel_region(out, group)
            if self.pad_size:
                out = torch.narrow(out, -1, 0, self.embedding_dim - self.pad_size)
            return out
        if self.tp_size > 1:
            mask = (input_ >= self.start_index) & (input_ < self.end_index)
            out = self._sharded_lookup(input_, mask)
            out = (out * mask.unsqueeze(-1).to(out.dtype)).to(self.dtype)
        else:
            out = self._lookup(input_)
        if self.sequence_parallel_enabled:
            return mappings.reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(),
                                                                       self.sequence_dimension, group)
        return mappings.reduce_from_tensor_model_parallel_region(out, group)

    def preshard_hook(self, model_state_dict, prefix):
        if not self.pad or self.pad_size == 0:
            return
        dim = self.weight_partition_dim
        size = model_state_dict[prefix].shape[dim]
        full = self.embedding_dim if self.shard_across_embedding else self.num_embeddings
        if full != size + self.pad_size:
            raise RuntimeError(f"State dict {prefix} is of an unexpected shape {size} expected {full - self.pad_size}")
        padding = (0, self.pad_size) if dim == 1 else (0, 0, 0, self.pad_size)
        model_state_dict[prefix] = F.pad(model_state_dict[prefix], padding)


def linear_with_async_allreduce(input, weight, bias, async_grad_allreduce, sequence_parallel_enabled,
                                sequence_dimension=0, autograd_func_class=None, save_for_backward=True,
                                process_group=None, reduce_dtype=torch.float32):
    """NxD's functional column-parallel matmul: ``input`` (all-gathered on
    ``sequence_dimension`` with sequence parallelism) times ``weightᵀ`` plus ``bias``, the
    input gradient all-reduced (``async_grad_allreduce``) or reduce-scattered (SP)."""
    mesh.unsupported("autograd_func_class", autograd_func_class, "custom autograd classes are not implemented")
    if sequence_parallel_enabled:
        x = mappings.gather_from_sequence_parallel_region(input, sequence_dimension, True, process_group)
    elif async_grad_allreduce:
        x = mappings.copy_to_region(input, process_group, reduce_dtype)
    else:
        x = input
    return F.linear(x, weight, bias)
