"""One rank's share of a Hugging Face decoder, for tensor parallelism over ``tp`` ranks.

Megatron's split, as transformers-neuronx and NxD Inference make it: attention heads
(query heads with their key/value head) and the MLP's intermediate columns are divided
between the ranks, each rank's output projection and MLP down projection produce a
partial sum that is all-reduced (``torch.ops.kiln.all_reduce``), the vocabulary is
divided for the embedding (each rank looks up the ids it owns, zeros elsewhere, then an
all-reduce) and for the LM head (each rank's logits are gathered along the vocabulary).
Each rank's KV cache holds only its key/value heads. The result is the original module
tree with its weights sliced, so :class:`kiln.llm.decoder.DecoderStep` wraps it as it
wraps the whole model, and the collectives are ordinary graph nodes that run on the host
between engine partitions.

Head counts that do not divide by ``tp`` (SmolLM2: 9 query heads, 3 key/value heads):

* key/value heads fewer than ranks and dividing them (1 head, tp 2): each key/value head
  is replicated on ``tp / kv`` ranks and its query heads divided between them, as NxD's
  ``kv_size_multiplier`` does;
* otherwise key/value heads are padded with zero heads up to a multiple of ``tp``, each
  with its group of zero query heads, as NxD's ``pad_model`` pads heads: a zero query
  head's output is zero and its output-projection columns are zero, so padding changes
  no answer (checked at compile time against the whole model, :mod:`kiln.llm.build`).

The MLP's intermediate size and the vocabulary are padded with zeros to a multiple of
``tp`` the same way; padded logits are cut off after the gather.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kiln.distributed import ops
from kiln.errors import CompilerArgsError


@dataclass(frozen=True)
class Heads:
    """Which original heads each rank holds: ``q[r]`` and ``kv[r]`` list head indices in
    the rank's order (query head ``i`` of a rank uses its key/value head
    ``i // (len(q[r]) // len(kv[r]))``); ``-1`` is a zero (padding) head."""
    q: tuple
    kv: tuple
    how: str            # "sharded", "replicated" or "padded"

    def describe(self, heads: int, kv_heads: int) -> str:
        per_q, per_kv = len(self.q[0]), len(self.kv[0])
        return (f"{heads} query / {kv_heads} key-value heads over {len(self.q)} ranks: {self.how}, "
                f"{per_q} query and {per_kv} key-value heads per rank")


def plan_heads(heads: int, kv_heads: int, tp: int) -> Heads:
    if heads % kv_heads:
        raise CompilerArgsError(f"{heads} attention heads do not group under {kv_heads} key/value heads")
    group = heads // kv_heads
    if kv_heads % tp == 0:
        per = kv_heads // tp
        kv = [list(range(r * per, (r + 1) * per)) for r in range(tp)]
        how = "sharded"
    elif tp % kv_heads == 0:
        copies = tp // kv_heads
        kv = [[r // copies] for r in range(tp)]
        part = math.ceil(group / copies)
        q = []
        for r in range(tp):
            head, piece = r // copies, r % copies
            members = [head * group + i for i in range(piece * part, (piece + 1) * part)]
            q.append(tuple(h if h < (head + 1) * group else -1 for h in members))
        return Heads(tuple(q), tuple(tuple(k) for k in kv),
                     "replicated" if part * copies == group else "replicated and padded")
    else:
        padded = math.ceil(kv_heads / tp) * tp
        per = padded // tp
        kv = [[h if h < kv_heads else -1 for h in range(r * per, (r + 1) * per)] for r in range(tp)]
        how = "padded"
    q = [tuple(k * group + i if k >= 0 else -1 for k in ks for i in range(group)) for ks in kv]
    return Heads(tuple(q), tuple(tuple(k) for k in kv), how)


def _rows(weight, heads, dim):
    """Rows ``[h*dim, (h+1)*dim)`` of ``weight`` for each head in ``heads`` (zeros for -1)."""
    parts = [weight[h * dim:(h + 1) * dim] if h >= 0 else weight.new_zeros((dim, *weight.shape[1:]))
             for h in heads]
    return torch.cat(parts).contiguous()


def _padded_split(tensor, dim: int, tp: int, rank: int):
    """Rank ``rank``'s contiguous share of ``tensor`` along ``dim``, zero-padded to a multiple of tp."""
    size = tensor.shape[dim]
    per = math.ceil(size / tp)
    if per * tp != size:
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, per * tp - size]
        tensor = F.pad(tensor, pad)
    return tensor.narrow(dim, rank * per, per).contiguous()


class RowParallel(nn.Module):
    """``all_reduce(x @ Wᵣᵀ) + b``: a projection whose input is split over the ranks."""

    def __init__(self, weight, bias, tp: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.tp = tp

    def forward(self, x):
        out = ops.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabEmbedding(nn.Module):
    """Rows ``[start, start + n)`` of the embedding: other ids look up zeros, then the
    ranks' lookups are summed (exactly one rank owns each id)."""

    def __init__(self, weight, start: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start

    def forward(self, ids):
        local = ids - self.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        found = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return ops.all_reduce(found * owned.unsqueeze(-1).to(found.dtype))


class VocabHead(nn.Module):
    """Logits for this rank's slice of the vocabulary, gathered from every rank and cut
    back to the real vocabulary (the last slice may be padding)."""

    def __init__(self, weight, bias, vocab: int, tp: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, hidden):
        local = F.linear(hidden, self.weight, self.bias)
        return ops.all_gather(local, local.dim() - 1, self.tp)[..., :self.vocab]


def shard(model, rank: int, tp: int, family: str):
    """A copy of ``model`` (a supported ``*ForCausalLM``) holding rank ``rank``'s share;
    returns ``(module, kv_heads_per_rank, Heads)``."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    plan = plan_heads(heads, kv_heads, tp)
    part = copy.deepcopy(model).eval()
    for p in part.parameters():
        p.requires_grad_(False)
    q, kv = plan.q[rank], plan.kv[rank]
    if family == "gpt2":
        _shard_gpt2(part, q, dim, rank, tp)
    else:
        _shard_llama(part, q, kv, dim, rank, tp)
    _shard_vocab(part, family, rank, tp)
    part.config.num_attention_heads = len(q)
    if family != "gpt2":
        part.config.num_key_value_heads = len(kv)
    part.config.head_dim = dim
    return part, len(kv), plan


def _shard_llama(part, q, kv, dim, rank, tp):
    for layer in part.model.layers:
        attn = layer.self_attn
        for name, index in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            lin = getattr(attn, name)
            new = nn.Linear(lin.in_features, len(index) * dim, bias=lin.bias is not None)
            new.weight = nn.Parameter(_rows(lin.weight.data, index, dim), requires_grad=False)
            if lin.bias is not None:
                new.bias = nn.Parameter(_rows(lin.bias.data, index, dim), requires_grad=False)
            setattr(attn, name, new)
        o = attn.o_proj
        attn.o_proj = RowParallel(_rows(o.weight.data.t(), q, dim).t().contiguous(), o.bias, tp)
        attn.num_key_value_groups = len(q) // len(kv)
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):
            lin = getattr(mlp, name)
            new = nn.Linear(lin.in_features, 1, bias=lin.bias is not None)
            new.weight = nn.Parameter(_padded_split(lin.weight.data, 0, tp, rank), requires_grad=False)
            new.out_features = new.weight.shape[0]
            if lin.bias is not None:
                new.bias = nn.Parameter(_padded_split(lin.bias.data, 0, tp, rank), requires_grad=False)
            setattr(mlp, name, new)
        down = mlp.down_proj
        mlp.down_proj = RowParallel(_padded_split(down.weight.data, 1, tp, rank), down.bias, tp)


def _shard_gpt2(part, q, dim, rank, tp):
    hidden = part.config.hidden_size
    for block in part.transformer.h:
        attn = block.attn
        w, b = attn.c_attn.weight.data, attn.c_attn.bias.data           # Conv1D: [in, 3*hidden]
        cols = [torch.cat([_rows(w.t()[k * hidden:(k + 1) * hidden], q, dim) for k in range(3)]).t().contiguous()]
        bias = torch.cat([_rows(b[k * hidden:(k + 1) * hidden], q, dim) for k in range(3)])
        attn.c_attn.weight = nn.Parameter(cols[0], requires_grad=False)
        attn.c_attn.bias = nn.Parameter(bias, requires_grad=False)
        attn.c_attn.nf = bias.shape[0]
        attn.split_size = len(q) * dim
        attn.num_heads = len(q)
        attn.embed_dim = len(q) * dim
        proj = attn.c_proj
        attn.c_proj = RowParallel(_rows(proj.weight.data, q, dim).t().contiguous(), proj.bias.data, tp)
        fc, out = block.mlp.c_fc, block.mlp.c_proj
        fc.weight = nn.Parameter(_padded_split(fc.weight.data, 1, tp, rank), requires_grad=False)
        fc.bias = nn.Parameter(_padded_split(fc.bias.data, 0, tp, rank), requires_grad=False)
        fc.nf = fc.bias.shape[0]
        block.mlp.c_proj = RowParallel(_padded_split(out.weight.data, 0, tp, rank).t().contiguous(),
                                       out.bias.data, tp)


def _shard_vocab(part, family, rank, tp):
    inner = part.transformer if family == "gpt2" else part.model
    name = "wte" if family == "gpt2" else "embed_tokens"
    table = getattr(inner, name).weight.data
    vocab = table.shape[0]
    per = math.ceil(vocab / tp)
    rows = _padded_split(table, 0, tp, rank)
    setattr(inner, name, VocabEmbedding(rows, rank * per))
    head = part.lm_head
    tied = head.weight.data.data_ptr() == table.data_ptr()      # tied embeddings stay one tensor
    part.lm_head = VocabHead(rows if tied else _padded_split(head.weight.data, 0, tp, rank),
                             None if head.bias is None else _padded_split(head.bias.data, 0, tp, rank), vocab, tp)
