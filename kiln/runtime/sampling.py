"""Choosing the next token from a step's logits: greedy, or sampled with temperature,
top-k, top-p and a repetition penalty, in Hugging Face's order and with its formulas
(``RepetitionPenaltyLogitsProcessor``, then ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``), so that a script's generation settings mean
what they meant under transformers. Seeded sampling draws from a per-request
``torch.Generator``: the same seed gives the same tokens whatever else runs.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import InputError, KilnError


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0                  # 0: off
    top_p: float = 1.0              # 1.0: off
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        # the types first: a string or a float top_k used to pass here and fail in a draw
        # (a TypeError in topk), a float seed was cut to an int, 2**64 overflowed
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise InputError(f"{name} must be a number; got {value!r} ({type(value).__name__})")
        if not _integer(self.top_k):
            raise InputError(f"top_k must be an integer (0 turns it off); got {self.top_k!r} "
                             f"({type(self.top_k).__name__})")
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.seed is not None:
            if not _integer(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64:
                raise InputError(f"seed must be an integer in [-2**63, 2**64) (a torch.Generator's seed) or None; "
                                 f"got {self.seed!r} ({type(self.seed).__name__})")
            object.__setattr__(self, "seed", int(self.seed))
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


def checked(params) -> SamplingParams:
    """``params`` as ``generate`` takes it: a :class:`SamplingParams` (None: greedy), or
    :class:`InputError` (a dict failed later with an AttributeError)."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        hint = " (SamplingParams(**params) makes one of a dict)" if isinstance(params, dict) else ""
        raise InputError(f"params must be a kiln.runtime.sampling.SamplingParams or None; got "
                         f"{type(params).__name__}{hint}")
    return params


def _integer(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def process(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None) -> torch.Tensor:
    """``[B, V]`` float logits → the scores sampling draws from (-inf where excluded),
    computed as transformers computes them (the reference :func:`distribution` is tested
    against). ``history``: ``[B, N]`` token ids seen so far (prompt and generated), for the
    penalty."""
    scores = _penalized(logits.float(), params, history)
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


def _penalized(scores, params, history):
    if params.repetition_penalty != 1.0 and history is not None and history.numel():
        seen = torch.gather(scores, 1, history)
        seen = torch.where(seen < 0, seen * params.repetition_penalty, seen / params.repetition_penalty)
        scores = scores.scatter(1, history, seen)
    return scores


def distribution(logits: torch.Tensor, params: SamplingParams, history=None) -> tuple:
    """One row's sampling distribution as ``(token ids, probabilities)``, tokens outside it
    left out (most likely first when top-k or top-p chose them; the whole vocabulary in id
    order otherwise): the distribution ``softmax(process(...))`` gives, without its cost. transformers' top-p sorts the whole vocabulary (5.7 ms per row for
    SmolLM2's 49,152 tokens on this project's 2-core machine, a quarter of a decode step);
    here top-k takes its ``k`` candidates with ``torch.topk`` (ties with the k-th kept, as
    transformers keeps them), and top-p alone looks at the most likely 64 tokens, then 256,
    1024... until they hold ``top_p`` of the probability (normalized over the whole
    vocabulary), which for a language model's peaked distribution is almost always the
    first try. The kept set can differ from transformers' only where a token's cumulative
    probability is within float rounding of ``top_p``. ``logits``: ``[1, V]``."""
    scores = _tempered(_penalized(logits.float(), params, history)[0], params.temperature)
    vocab = scores.shape[0]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(scores, params.top_k)[0][-1]
        values, index = torch.topk(scores, int((scores >= kth).sum()))
        total = torch.logsumexp(values, 0)
    elif params.top_p < 1.0:
        values, index = _nucleus_candidates(scores, params.top_p)
        total = torch.logsumexp(scores, 0)
    else:
        return torch.arange(vocab), scores.softmax(0)
    probs = (values - total).exp()
    if params.top_p < 1.0:
        # transformers drops a token when the tokens at least as unlikely hold at most
        # 1 - top_p; in descending order: keep while the mass before it is under top_p
        before = torch.cumsum(probs, 0) - probs
        keep = max(1, int((before < params.top_p).sum()))
        values, index = values[:keep], index[:keep]
    return index, values.softmax(0)


def _tempered(scores, temperature):
    """``scores / temperature``, the distribution's logits. Where that overflows (a
    temperature so far below 1 that the largest score passes float32's range:
    ``temperature=1e-45``) the scores are shifted by their maximum first, which leaves the
    softmax as it is and cannot overflow: the limit, all the probability on the most
    likely tokens. Unshifted, the largest scores became inf, the softmax NaN, and the
    draw picked the last token of the vocabulary. Below float32's smallest number
    (``1e-46``) the temperature is 0 in the scores' type and the shifted maximum 0 / 0: the
    most likely tokens are kept at 0 and the rest at -inf, the same limit (until 12-03 a
    KilnError, "the sampling distribution holds NaN", and the server's 500)."""
    scaled = scores / temperature
    if temperature < 1 and scores.numel() and not math.isfinite(float(scaled.max())):
        shifted = scores - scores.max()
        scaled = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)
    return scaled


def _nucleus_candidates(scores, top_p):
    """The most likely tokens, enough of them to hold ``top_p`` of the probability."""
    vocab, total, k = scores.shape[0], torch.logsumexp(scores, 0), 64
    while True:
        values, index = torch.topk(scores, min(k, vocab))
        if k >= vocab or float((values[:-1] - total).exp().sum()) >= top_p:
            return values, index
        k *= 4


_NUMPY_ARGMAX = (torch.float32, torch.float64, torch.float16)


def greedy(scores: torch.Tensor) -> torch.Tensor:
    """The index of the largest score along the last dim (int64), as ``torch.argmax`` gives
    it: the first of equal scores, the first NaN where there is one. A CPU tensor is reduced
    by NumPy: over SmolLM2's 49,152 logits ``torch.argmax`` took 74 µs a row and NumPy's
    2.7 µs (2-core Xeon, 11-28), with the engine's call a greedy decode step's largest host
    cost, once per row."""
    if scores.device.type == "cpu" and scores.dtype in _NUMPY_ARGMAX and scores.numel() and scores.dim():
        return torch.from_numpy(np.asarray(scores.detach().numpy().argmax(-1), dtype=np.int64))
    return scores.argmax(-1)


def choose(logits: torch.Tensor, params: SamplingParams, history=None, generator=None) -> torch.Tensor:
    """The next token per row, ``[B]`` int64: greedy, or one draw per row from
    :func:`distribution` by inverting its cumulative distribution at one uniform number
    from ``generator`` (``torch.multinomial`` over a whole vocabulary took 1.2 ms)."""
    if not params.do_sample:
        return greedy(process(logits, params, history))
    out = []
    for row in range(logits.shape[0]):
        index, probs = distribution(logits[row:row + 1], params,
                                    None if history is None else history[row:row + 1])
        cdf = probs.double().cumsum(0)
        if not (torch.isfinite(cdf[-1]) and cdf[-1] > 0):
            # transformers' torch.multinomial raises here too; a search of a NaN CDF picked the last id
            raise KilnError("the sampling distribution holds NaN or no probability (the model's logits are NaN, "
                            "or all -inf): no token can be drawn from it")
        u = torch.rand((), dtype=torch.float64, generator=generator)
        pick = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), len(index) - 1)
        out.append(index[pick])
    return torch.stack(out)


def logprobs(logits: torch.Tensor, token: int, top: int = 0) -> tuple:
    """``(logprob of token, [(id, logprob)] of the ``top`` most likely)`` from one row of raw
    logits: the model's own distribution, before temperature, penalties or truncation (what
    OpenAI's ``logprobs`` and vLLM's default report), so they do not depend on sampling
    settings."""
    row = torch.log_softmax(logits.reshape(-1).float(), dim=-1)
    best = []
    if top > 0:
        values, ids = torch.topk(row, min(top, row.numel()))
        best = [(int(i), float(v)) for i, v in zip(ids, values)]
    return float(row[token]), best
