"""The accuracy gate for a quantized LLM: perplexity on a fixed text and greedy agreement,
against the float32 model, before the artifact is accepted.

Both models read the same token ids, teacher-forced, each position's logits predicting
the next token. The quantized model reads them as it will run when served: the first
token through prefill, then one decode step per token. The float32 reference reads them
in one forward pass (the causal mask gives each position its prefix alone: the logits a
step at a time would give, to float rounding), which costs a tenth or less of 63 eager decode
steps over the whole cache (SmolLM2, 64 tokens, 2 cores: 0.15-0.33 s against 3.1-3.8 s, the same
perplexity to four decimals and the same greedy choices). From the two logit
sequences come each model's perplexity on the text and the *agreement*: the
share of positions where both would choose the same next token (greedy). A quantized
model passes when ``ppl / ppl_fp32 <= max_ppl_ratio`` and ``agreement >= min_agreement``;
otherwise compiling fails with both numbers and both limits, so a user can decide to
relax the gate or keep more precision, never get a quietly worse model.

Why not cosine on one example's logits (the gate for other quantized models): an LLM's
quality is its next-token distribution over real text, and one example step says little
about it; perplexity and greedy agreement are the numbers llama.cpp and NxD Inference
users compare.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from kiln.runtime.kv import KVCache

TEXT = ("The history of computing is a story of people finding ways to make machines do more of the "
        "work that once took hours of careful effort. Early calculators were mechanical, then came "
        "relays, vacuum tubes, transistors and integrated circuits, each step making computers smaller, "
        "faster and cheaper.")
# (max perplexity ratio, min greedy agreement) per quantization
LIMITS = {"int8": (1.05, 0.90), "int4": (1.25, 0.75)}


@dataclass
class GateResult:
    tokens: int
    ppl_fp32: float
    ppl: float
    agreement: float
    max_ppl_ratio: float
    min_agreement: float

    @property
    def ppl_ratio(self) -> float:
        return self.ppl / self.ppl_fp32

    @property
    def passed(self) -> bool:
        return self.ppl_ratio <= self.max_ppl_ratio and self.agreement >= self.min_agreement

    def describe(self) -> str:
        return (f"perplexity {self.ppl:.3f} vs {self.ppl_fp32:.3f} in float32 (ratio {self.ppl_ratio:.3f}, "
                f"limit {self.max_ppl_ratio}); greedy agreement {self.agreement:.1%} (limit "
                f"{self.min_agreement:.0%}) over {self.tokens} tokens")

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_ratio": self.ppl_ratio, "passed": self.passed}


def gate_ids(tokenizer, vocab_size: int, length: int) -> list:
    """The fixed text's ids (the tokenizer's), or fixed pseudo-random ids without one."""
    if tokenizer is not None:
        ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
        if len(ids) >= 8:
            return ids[:length]
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def forced_logits(prefill, decode, ids: list, cache_shape, rows: int = 1) -> torch.Tensor:
    """``[len(ids) - 1, V]``: the logits after each prefix of ``ids``, the sequence in row 0
    of a ``rows``-row decode graph (other rows empty)."""
    layers, _, heads, slots, dim = cache_shape
    cache = KVCache((layers, rows, heads, slots, dim))
    out = []
    with torch.no_grad():
        logits, k, v = prefill(torch.tensor([ids[:1]]), torch.tensor([[0]]), torch.tensor([0]))
        cache.write_slot(0, k[:, 0, :, :1], v[:, 0, :, :1])      # a bucket's padding is not kept
        out.append(logits[0, -1])
        for p, token in enumerate(ids[1:-1], start=1):
            tokens, positions = torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(rows, 1, dtype=torch.int64)
            tokens[0, 0], positions[0, 0] = token, p
            logits, k, v = decode(tokens, positions, *cache.inputs(rows))
            cache.write_slot(0, k[:, 0], v[:, 0])
            out.append(logits[0, -1])
    return torch.stack(out).float()


def teacher_forced(step, ids: list) -> torch.Tensor:
    """``[len(ids) - 1, V]``: the logits after each prefix of ``ids``, from one call of
    ``step``, a step that returns every position's logits
    (``DecoderStep(model, with_cache=False, last_only=False)``)."""
    with torch.no_grad():
        logits, _, _ = step(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1).unsqueeze(0))
    return logits[0].float()


def perplexity(logits: torch.Tensor, ids: list) -> float:
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:len(logits) + 1]))
    return math.exp(float(nll))


def measure(reference, candidate: tuple, ids: list, cache_shape, limits: tuple, rows: int = 1) -> GateResult:
    """``reference``: the float32 model as a step returning every position's logits
    (:func:`teacher_forced`); ``candidate``: the compiled (prefill, decode) callables, its
    decode graph ``rows`` rows wide."""
    ref = teacher_forced(reference, ids)
    got = forced_logits(*candidate, ids, cache_shape, rows)
    agreement = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    return GateResult(len(ref), perplexity(ref, ids), perplexity(got, ids), agreement, *limits)
