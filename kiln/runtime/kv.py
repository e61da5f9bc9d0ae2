"""The KV cache the runtime owns, and the context-bucket padding of prefill.

The cache is one preallocated ``[L, B, H_kv, S_max, D]`` pair; each step's new keys and
values are written into their positions in place (position ``p`` of a sequence is at
index ``p``), and a sequence's valid positions are its first ``length``. The loop that
fills it is :mod:`kiln.runtime.scheduler`.
"""
from __future__ import annotations

import torch



class KVCache:
    def __init__(self, shape: tuple, dtype=torch.float32):
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(shape[1], dtype=torch.int64)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def write_slot(self, slot: int, new_k, new_v):
        """Append ``[L, H_kv, n, D]`` new keys and values after slot ``slot``'s current length."""
        start, n = int(self.lengths[slot]), new_k.shape[2]
        if start + n > self.capacity:
            raise ValueError(f"sequence {slot} needs {start + n} cache positions; the cache holds "
                             f"{self.capacity}")
        self.k[:, slot, :, start:start + n] = new_k
        self.v[:, slot, :, start:start + n] = new_v
        self.lengths[slot] += n

    def reset(self, slot: int):
        """Free a slot: its length is 0, so nothing in it is attended to (the values stay)."""
        self.lengths[slot] = 0

    def valid(self) -> torch.Tensor:
        """``[B, S_max]`` bool: the slots each sequence may attend to."""
        return torch.arange(self.capacity).unsqueeze(0) < self.lengths.unsqueeze(1)


def padded(prefill, width: int):
    """``prefill`` compiled for prompts ``width`` tokens wide (a context bucket), called
    with narrower ones: ids padded on the right, positions continued. The padding comes
    after every real token, so causal attention never lets a real token see it."""
    def run(ids, positions, last):
        extra = width - ids.shape[1]
        if extra < 0:
            raise ValueError(f"prompt of {ids.shape[1]} tokens is longer than the context bucket ({width})")
        if extra:
            ids = torch.cat([ids, torch.zeros(ids.shape[0], extra, dtype=ids.dtype)], 1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1)], 1)
        return prefill(ids, positions, last)
    return run
