"""Compile a decoder for tensor parallelism: each rank's share (:mod:`kiln.llm.shard`)
compiled as an ordinary LLM, the ranks packed into one
:class:`~kiln.runtime.tp_llm.TensorParallelLLM`, and the whole checked against the
unsharded model before it is returned.

Each rank's graphs go through :func:`kiln.llm.build.compile_llm` — kiln's engines, the
compile cache and the per-graph check against eager — with the tensor-parallel group
bound to a one-thread stand-in (:class:`kiln.distributed.groups.SoloGroup`): a graph's
collectives are host steps between engine partitions, and the stand-in gives its eager
and compiled runs the same values there. What the stand-in cannot show — that the ranks
together compute the model — is then shown with every rank's compiled graphs run side by
side as threads (:class:`~kiln.distributed.groups.ThreadGroup`): a prompt's prefill and
decode steps, compared with the whole model run eagerly.
"""
from __future__ import annotations

import torch

from kiln.distributed import groups
from kiln.errors import CompilerArgsError, ValidationError
from kiln.llm import shard
from kiln.llm.decoder import DecoderStep, check_supported
from kiln.runtime.tp_llm import TensorParallelLLM

# The ranks' logits against the whole model's, float32: a sum split over ranks rounds
# differently, so not bit-equal. Held relative to the largest logit: SmolLM2's real weights
# differ by up to 0.01 on logits of magnitude ~20 (cosine 1.000000, greedy tokens equal).
RTOL, ATOL = 1e-3, 1e-3
# The per-graph check against eager runs on the stand-in group's values, which are not the
# model's (each rank sees only its partial sums): larger activations, larger rounding. It
# still checks the engines against eager on the same function; the ranks together are
# held to the whole model by :func:`check`. SmolLM2 at tp 2 needed more than 1e-3 there.
RANK_ATOL = 2e-2


def compile_tp(model, tp_degree: int, compile_one, *, tokenizer_files: dict, on_graph=None, **options):
    """``compile_one(module, **options)``: :func:`kiln.llm.build.compile_llm` for one rank."""
    family = check_supported(model)
    if options.get("quantize"):
        raise CompilerArgsError(f"quantize={options['quantize']!r} with tp_degree={tp_degree}: kiln's quantized "
                                "builds are judged by an accuracy gate on the whole model, which tensor-parallel "
                                "builds do not run yet; compile float32 with tp_degree, or quantize at tp_degree=1")
    options.setdefault("atol", RANK_ATOL)
    # named, so that no rank adds graphs of its own: compile_llm adds a 2-row decode graph
    # where its batch-invariance check drops the 1-row one, and ranks checked one by one
    # could disagree (the ranks together are checked at load, kiln.runtime.tp_llm)
    if options.get("decode_batches") is None:
        options["decode_batches"] = sorted({1, options.get("batch_size", 1)})
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    ranks, plan = [], None
    for rank in range(tp_degree):
        part, _, plan = shard.shard(model, rank, tp_degree, family)
        progress = None if on_graph is None else (
            lambda name, k, n, s, r=rank: on_graph(f"rank {r} {name}", k + r * n, n * tp_degree, s))
        with groups.registered("tp", groups.SoloGroup(tp_degree, rank)):
            ranks.append(compile_one(part, on_graph=progress, workers=1, **options))
        del part
    meta = {**ranks[0].meta, "tp_degree": tp_degree, "heads": plan.describe(heads, kv_heads),
            "vocab_size": config.vocab_size}
    llm = TensorParallelLLM(ranks, meta, tokenizer_files)
    meta["tp_check"] = check(model, llm)
    return llm


def check(model, llm: TensorParallelLLM) -> dict:
    """Every rank's compiled graphs at once (threads): a prompt's prefill logits against the
    whole model's, then three greedy tokens; returns what was found, or raises
    ValidationError when the logits differ past ``RTOL``/``ATOL``."""
    g = torch.Generator().manual_seed(0)
    n = max(1, min(min(llm.prefill), llm.meta["cache_shape"][3] - 4))
    prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
    step = DecoderStep(model, with_cache=False, last_only=True).eval()
    with torch.no_grad():
        expected = step(torch.tensor([prompt]), torch.arange(n).unsqueeze(0), torch.tensor([n - 1]))[0]
    llm.start(mode="threads")
    try:
        got = llm.last_logits(prompt)
        tokens = llm.generate([prompt], 3, stop_at_eos=False)[0]
    finally:
        llm.close()
    worst = float((got - expected).abs().max())
    allowed = ATOL + RTOL * float(expected.abs().max())
    if worst > allowed:
        raise ValidationError(f"the tensor-parallel build's logits differ from the whole model's by up to {worst:.3g} "
                              f"(allowed {allowed:.3g}: {ATOL} + {RTOL} x the largest logit): the sharding is wrong "
                              "for this model; report it with the model's config")
    return {"max_abs_logit_diff": worst, "greedy_equal": tokens == _eager_tokens(model, prompt, 3)}


def _eager_tokens(model, prompt, n):
    step = DecoderStep(model, with_cache=False, last_only=False).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = step(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))[0]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]
