"""NxD's ``GQAQKVColumnParallelLinear``: the Q, K and V projections of grouped-query
attention as one column-parallel layer, with KV heads replicated when there are fewer KV
heads than TP ranks.

``kv_size_multiplier`` m repeats the K and V weights m times along their output rows
(``[K; K; ...]``) before sharding, so with TP 2 and one KV head both ranks hold it. The
ranks holding the same KV heads form NxD's kv-shared group (interleaved: TP 4, m 2 ->
``[[0, 2], [1, 3]]``, exactly the ranks the repetition gives the same rows). In backward
the K/V output gradients are summed over that group before the weight gradients (each
replica then holds the whole gradient of the unreplicated head), and the K/V part of the
input gradient is divided by m before the TP all-reduce, which would otherwise count each
head m times. Fused (``weight_qkv``, rows ``[q; k; v]`` of this rank) or not
(``weight_q/k/v``). The replicated K/V rows are tagged ``row_replicas`` so that the
gradient norm (clipping) counts each once, as the one-process model does
(:mod:`kiln.distributed.grads`; NxD counts them m times). Biases are U(±1/√in) on the unreplicated sizes, repeated and sliced
like the weights (NxD's own bias code mis-sizes replicated K/V biases; kiln does not).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import mappings, ops, shard, state
from kiln.distributed.layers import TensorParallelModule, kaiming_init
from kiln.errors import KilnError


class QKVConfigError(KilnError, ValueError):
    """Head counts that the TP degree and kv_size_multiplier cannot shard."""


class _GQAProject(torch.autograd.Function):
    """q, k, v = x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv with NxD's GQA backward (module doc)."""

    @staticmethod
    def forward(ctx, x, w_q, w_k, w_v, b_q, b_k, b_v, kv_group, m):
        ctx.save_for_backward(x, w_q, w_k, w_v)
        ctx.kv_group, ctx.m, ctx.biases = kv_group, m, (b_q is not None, b_k is not None, b_v is not None)
        return F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v)

    @staticmethod
    def backward(ctx, g_q, g_k, g_v):
        x, w_q, w_k, w_v = ctx.saved_tensors
        if ctx.m > 1:
            g_k, g_v = ops.all_reduce(g_k.contiguous(), ctx.kv_group), ops.all_reduce(g_v.contiguous(), ctx.kv_group)
        d_x = g_q.matmul(w_q) + (g_k.matmul(w_k) + g_v.matmul(w_v)) / ctx.m
        x2 = x.reshape(-1, x.shape[-1])

        def wgrad(g):
            return g.reshape(-1, g.shape[-1]).t().matmul(x2)

        def bgrad(g, has):
            return g.reshape(-1, g.shape[-1]).sum(0) if has else None
        hq, hk, hv = ctx.biases
        return (d_x, wgrad(g_q), wgrad(g_k), wgrad(g_v), bgrad(g_q, hq), bgrad(g_k, hk), bgrad(g_v, hv),
                None, None)


class GQAQKVColumnParallelLinear(TensorParallelModule):
    def __init__(self, input_size, output_sizes, bias=True, gather_output=True, dtype=torch.float32, device=None,
                 init_method=None, sequence_parallel_enabled=False, keep_master_weight=False, kv_size_multiplier=1,
                 fuse_qkv=True, reduce_dtype=torch.float32):
        super().__init__()
        world = self._bind_group(None)
        q_out, kv_out = output_sizes
        if world % kv_size_multiplier != 0:
            raise QKVConfigError(f"tp_world_size should be divisible by kv_size_multiplier: tensor parallel size "
                                 f"{world}, kv_size_multiplier {kv_size_multiplier}")
        if (kv_out * kv_size_multiplier) % world != 0:
            raise QKVConfigError(f"kv_output_dim*kv_size_multiplier should be divisible by tp_world_size: KV output "
                                 f"size {kv_out} x kv_size_multiplier {kv_size_multiplier} does not divide over "
                                 f"{world} ranks; set kv_size_multiplier so that the replicated KV heads do")
        state.initialize_kv_group(kv_size_multiplier)
        self.input_size, self.output_sizes, self.gather_output = input_size, list(output_sizes), gather_output
        self.kv_size_multiplier, self.fuse_qkv, self.use_bias = kv_size_multiplier, fuse_qkv, bias
        self.dtype, self.reduce_dtype, self.arg_init_method = dtype, reduce_dtype, init_method
        self.q_output_size_per_partition = shard.divide(q_out, world)
        self.kv_output_size_per_partition = shard.divide(kv_out * kv_size_multiplier, world)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and gather_output:
            raise ValueError("GQAQKVColumnParallelLinear: sequence_parallel_enabled=True needs gather_output=False")
        self._build(init_method or kaiming_init, device, keep_master_weight)

    def _part(self, full_rows, m, init, device, keep):
        """This rank's rows of a [full_rows, in] weight repeated m times (NxD's init)."""
        master = torch.empty(full_rows, self.input_size, dtype=torch.float32)
        init(master)
        rep = master.repeat(m, 1).to(self.dtype)
        local = shard.create_local_weight(rep, 0, rep.shape[0] // self.tp_size, 1, tp_rank=self.tp_rank,
                                          tp_size=self.tp_size)
        return local, (master if keep else None)

    def _bias(self, full, m, gathered):
        bound = 1 / math.sqrt(self.input_size) if self.input_size else 0
        master = torch.empty(full, dtype=self.dtype).uniform_(-bound, bound).repeat(m)
        if gathered:
            return master
        return shard.create_local_weight(master, 0, master.shape[0] // self.tp_size, 1, tp_rank=self.tp_rank,
                                         tp_size=self.tp_size)

    def _param(self, t, device, sharded, parts=None):
        """``parts``: which of q, k, v the rows are, in order (K/V rows are copies on m ranks)."""
        device = torch.device(device) if device is not None else None
        p = nn.Parameter(t.to(device) if device is not None and device.type not in ("cpu", "meta") else t)
        if sharded:
            shard.set_tensor_model_parallel_attributes(p, True, 0, 1, self.tp_size)
            m = self.kv_size_multiplier
            if m > 1 and parts and set(parts) != {"q"}:
                rows = {"q": self.q_output_size_per_partition, "k": self.kv_output_size_per_partition,
                        "v": self.kv_output_size_per_partition}
                p.row_replicas = tuple((rows[part], 1 if part == "q" else m) for part in parts)
        return p

    def _build(self, init, device, keep):
        q_out, kv_out = self.output_sizes
        m = self.kv_size_multiplier
        wq, mq = self._part(q_out, 1, init, device, keep)
        wk, mk = self._part(kv_out, m, init, device, keep)
        wv, mv = self._part(kv_out, m, init, device, keep)
        biases = None
        if self.use_bias:
            biases = [self._bias(q_out, 1, self.gather_output), self._bias(kv_out, m, self.gather_output),
                      self._bias(kv_out, m, self.gather_output)]
        if self.fuse_qkv:
            self.weight_qkv = self._param(torch.cat([wq, wk, wv]), device, True, "qkv")
            self.bias_qkv = self._param(torch.cat(biases), device, not self.gather_output, "qkv") if biases else None
            self.master_weight_qkv = torch.cat([mq, mk, mv]) if keep else None
        else:
            self.weight_q, self.weight_k, self.weight_v = (self._param(w, device, True, part)
                                                           for w, part in zip((wq, wk, wv), "qkv"))
            names = ("bias_q", "bias_k", "bias_v")
            for name, part, b in zip(names, "qkv", biases or (None, None, None)):
                setattr(self, name, self._param(b, device, not self.gather_output, part) if b is not None else None)
            self.master_weight_q, self.master_weight_k, self.master_weight_v = mq, mk, mv

    def _weights_and_biases(self):
        sizes = [self.q_output_size_per_partition, self.kv_output_size_per_partition, self.kv_output_size_per_partition]
        if self.fuse_qkv:
            weights = torch.split(self.weight_qkv, sizes, dim=0)
            if self.bias_qkv is None:
                return weights, (None, None, None)
            q_out, kv_out = self.output_sizes
            m = self.kv_size_multiplier
            bsizes = [q_out, kv_out * m, kv_out * m] if self.gather_output else sizes
            return weights, torch.split(self.bias_qkv, bsizes, dim=0)
        return (self.weight_q, self.weight_k, self.weight_v), (self.bias_q, self.bias_k, self.bias_v)

    def forward(self, input):
        if self.sequence_parallel_enabled:
            x = mappings.gather_from_sequence_parallel_region(input, 0, True, None)
        else:
            x = mappings.copy_to_region(input, None, self.reduce_dtype)
        (wq, wk, wv), biases = self._weights_and_biases()
        kv_group = state.group_name(state.get_kv_shared_group()) if self.kv_size_multiplier > 1 else "tp"
        local_b = (None, None, None) if self.gather_output else biases
        q, k, v = _GQAProject.apply(x, wq, wk, wv, *local_b, kv_group, self.kv_size_multiplier)
        if self.gather_output:
            q, k, v = (mappings.gather_from_tensor_model_parallel_region(t) for t in (q, k, v))
            q, k, v = (t + b if b is not None else t for t, b in zip((q, k, v), biases))
        return q, k, v
