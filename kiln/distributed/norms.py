"""NxD's norms for sequence parallelism: LayerNorm and RMSNorm whose parameters are tagged
``sequence_parallel_enabled``. Under sequence parallelism each TP rank normalizes its own
slice of the sequence, so these (replicated) parameters get only a partial gradient on
each rank; the tag is how ``NxDOptimizer.step`` finds them to sum their gradients over TP.
The computation is the plain one."""
from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None,
                 sequence_parallel_enabled=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        for param in (self.weight, self.bias):
            if param is not None:
                param.sequence_parallel_enabled = sequence_parallel_enabled


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x²) + eps)`` computed in fp32 and cast back (Llama's)."""

    def __init__(self, normalized_shape, eps=1e-5, sequence_parallel_enabled=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.variance_epsilon = eps
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.weight.sequence_parallel_enabled = sequence_parallel_enabled

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)
