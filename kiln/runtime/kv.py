"""The KV cache the runtime owns, and the prefill/decode loop over step functions.

The cache is one preallocated ``[L, B, H_kv, S_max, D]`` pair; each step's new keys and
values are written into their slots in place (slot ``s`` holds position ``s``), and a
sequence's valid slots are its first ``length``. A step function is anything with
:class:`kiln.llm.decoder.DecoderStep`'s signature: the eager module (the reference) or
its compiled graph; the loop is the same, which is what makes the comparison honest.
"""
from __future__ import annotations

import torch

from kiln.runtime import sampling


class KVCache:
    def __init__(self, shape: tuple, dtype=torch.float32):
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.lengths = torch.zeros(shape[1], dtype=torch.int64)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def write(self, new_k, new_v, counts):
        """Append each row's first ``counts[b]`` new positions after its current length."""
        for b, n in enumerate(counts.tolist()):
            start = int(self.lengths[b])
            if start + n > self.capacity:
                raise ValueError(f"sequence {b} needs {start + n} cache positions; the cache holds "
                                 f"{self.capacity}")
            self.k[:, b, :, start:start + n] = new_k[:, b, :, :n]
            self.v[:, b, :, start:start + n] = new_v[:, b, :, :n]
        self.lengths += counts

    def valid(self) -> torch.Tensor:
        """``[B, S_max]`` bool: the slots each sequence may attend to."""
        return torch.arange(self.capacity).unsqueeze(0) < self.lengths.unsqueeze(1)


def greedy(prefill, decode, prompts: list, max_new_tokens: int, cache_shape: tuple, pad_id: int = 0) -> list:
    """Greedy continuation of each prompt, ``max_new_tokens`` long (no stop tokens)."""
    return generate(prefill, decode, prompts, max_new_tokens, cache_shape, pad_id=pad_id)


def generate(prefill, decode, prompts: list, max_new_tokens: int, cache_shape: tuple, *, params=None,
             eos_token_ids=(), pad_id: int = 0) -> list:
    """The new tokens of each prompt (lists of token ids), batched with right padding.
    ``params``: :class:`kiln.runtime.sampling.SamplingParams` (greedy when None). A row
    ends after it emits one of ``eos_token_ids`` (kept, as Hugging Face keeps it) or
    after ``max_new_tokens``; the batch stops when every row has ended."""
    params = params or sampling.SamplingParams()
    rng = params.generator()
    batch = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    ids = torch.full((batch, width), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    positions = torch.arange(width).unsqueeze(0).expand(batch, -1).contiguous()
    cache = KVCache(cache_shape)
    out = [[] for _ in prompts]
    done = [max_new_tokens <= 0] * batch
    stop = set(eos_token_ids)
    with torch.no_grad():
        logits, new_k, new_v = prefill(ids, positions, lengths - 1)
        cache.write(new_k, new_v, lengths)
        while not all(done):
            token = sampling.choose(logits[:, -1], params, _history(prompts, out), rng)
            for b in range(batch):
                if not done[b]:
                    out[b].append(int(token[b]))
                    done[b] = len(out[b]) >= max_new_tokens or int(token[b]) in stop
            if all(done):
                break
            logits, new_k, new_v = decode(token.unsqueeze(1), cache.lengths.unsqueeze(1).clone(),
                                          cache.k, cache.v, cache.valid())
            cache.write(new_k, new_v, torch.ones(batch, dtype=torch.int64))
    return out


def _history(prompts, out) -> torch.Tensor:
    """``[B, N]`` ids each row has seen, padded by repeating its last id (a repeat changes
    nothing in the repetition penalty, which looks only at which ids occur)."""
    rows = [list(p) + o for p, o in zip(prompts, out)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows])


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
