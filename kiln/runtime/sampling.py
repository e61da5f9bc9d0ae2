"""Choosing the next token from a step's logits: greedy, or sampled with temperature,
top-k, top-p and a repetition penalty, in Hugging Face's order and with its formulas
(``RepetitionPenaltyLogitsProcessor``, then ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``), so that a script's generation settings mean
what they meant under transformers. Seeded sampling draws from a per-request
``torch.Generator``: the same seed gives the same tokens whatever else runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1.0: off
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        checks = [(self.temperature > 0, "temperature must be > 0 (use do_sample=False for greedy)"),
                  (self.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0")]
        for ok, message in checks:
            if not ok:
                raise InputError(message)

    def generator(self):
        if self.seed is None:
            return None
        return torch.Generator().manual_seed(int(self.seed))


def process(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None) -> torch.Tensor:
    """``[B, V]`` float logits → the scores sampling draws from (-inf where excluded).
    ``history``: ``[B, N]`` token ids seen so far (prompt and generated), for the penalty."""
    scores = logits.float()
    if params.repetition_penalty != 1.0 and history is not None and history.numel():
        seen = torch.gather(scores, 1, history)
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        scores = scores.scatter(1, history, seen)
    if not params.do_sample:
        return scores
    scores = scores / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - params.top_p)
        drop[..., -1:] = False                      # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, index, drop), float("-inf"))
    return scores


def choose(logits: torch.Tensor, params: SamplingParams, history=None, generator=None) -> torch.Tensor:
    """The next token per row, ``[B]`` int64."""
    scores = process(logits, params, history)
    if not params.do_sample:
        return scores.argmax(-1)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
