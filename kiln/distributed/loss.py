"""NxD's vocabulary-parallel losses: ``parallel_cross_entropy`` (Megatron's algorithm) and
``from_parallel_logits_to_logprobs``.

Each rank holds logits for its contiguous vocabulary range; the max, the target logit and
the sum of exponentials are reduced over the TP group, so no rank ever holds the full
``[tokens, V]``. As NxD: the loss is per token (target's shape, no reduction, no
ignore_index: the caller masks -100 and averages), and the input logits are modified in
place (the max is subtracted from them).

Label smoothing follows NxD's convention (mass ``ε/(V-1)`` to each non-target class, so
it equals ``F.cross_entropy(label_smoothing=ε·V/(V-1))``), with ``V`` and the mean of the
log-probabilities taken over the whole vocabulary. NxD's code uses the local partition's
size and mean there, so its smoothed loss differs between TP ranks and from TP=1; kiln
does not reproduce that, and at TP=1 the two are identical.
"""
from __future__ import annotations

import torch

from kiln.distributed import ops, state


def _tp():
    state.ensure_initialized()
    return state.get_tensor_model_parallel_size(), state.get_tensor_model_parallel_rank()


def _all_reduce(x, op="sum"):
    size, _ = _tp()
    return x if size == 1 else ops.all_reduce(x, "tp", op)


def _target_parts(target, partition: int):
    size, rank = _tp()
    start = rank * partition
    in_range = (target >= start) & (target < start + partition)
    local = (target - start) * in_range.long()
    return in_range, local


class _ParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing=0.0):
        size, _ = _tp()
        logits_max = _all_reduce(torch.max(logits, dim=-1)[0], "max")
        logits.sub_(logits_max.unsqueeze(-1))
        partition = logits.size(-1)
        in_range, local = _target_parts(target, partition)
        picked = torch.gather(logits, -1, local.unsqueeze(-1)).squeeze(-1) * in_range.to(logits.dtype)
        picked = _all_reduce(picked)
        exp_logits = torch.exp(logits)
        sum_exp = _all_reduce(exp_logits.sum(dim=-1))
        loss = torch.log(sum_exp) - picked
        softmax = exp_logits / sum_exp.unsqueeze(-1)
        vocab = partition * size
        if label_smoothing > 0:
            if not 0.0 < label_smoothing < 1.0:
                raise ValueError(f"label_smoothing must be in (0, 1), got {label_smoothing}")
            smoothing = label_smoothing * vocab / (vocab - 1)
            mean_log_probs = _all_reduce(torch.log(softmax).sum(dim=-1)) / vocab
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        ctx.save_for_backward(softmax, in_range, local)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, in_range, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0) * in_range.unsqueeze(-1)
        if ctx.label_smoothing > 0:
            smoothing = ctx.label_smoothing * ctx.vocab / (ctx.vocab - 1)
            grad = softmax - (1.0 - smoothing) * onehot - smoothing / ctx.vocab
        else:
            grad = softmax - onehot
        return grad * grad_output.unsqueeze(-1), None, None


def parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """Per-token cross entropy of vocabulary-sharded logits ``[..., V/tp]`` against global
    target ids ``[...]``. Modifies ``vocab_parallel_logits`` in place, as NxD's does."""
    return _ParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)


class _DistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, inference=True):
        with torch.no_grad():
            shifted = logits - _all_reduce(torch.amax(logits, dim=-1, keepdim=True), "max")
            sum_exp = _all_reduce(shifted.exp().sum(-1, keepdim=True).float())
            log_softmax = shifted - sum_exp.log().to(shifted.dtype)
        in_range, local = _target_parts(target, logits.size(-1))
        log_probs = torch.gather(log_softmax, -1, local.unsqueeze(-1)).squeeze(-1) * in_range.to(logits.dtype)
        log_probs = _all_reduce(log_probs)
        if not inference:
            ctx.save_for_backward(log_softmax.exp(), in_range, local)
        return log_probs

    @staticmethod
    def backward(ctx, grad_output):
        softmax, in_range, local = ctx.saved_tensors
        chosen = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0) * in_range.unsqueeze(-1)
        return (chosen - softmax) * grad_output.unsqueeze(-1), None, None


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, inference=True):
    """Log-probabilities of the next tokens from ``[B, S, V/tp]`` logits: ``target`` is the
    unshifted ids (shifted here by one), the result ``[B, S-1]``. ``inference=False``
    keeps what backward needs."""
    target = target.roll(shifts=-1, dims=-1)
    return _DistributedLogprob.apply(vocab_parallel_logits, target, inference)[:, :-1].contiguous()
