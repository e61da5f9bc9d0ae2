"""The graphs :class:`~kiln.optimum.neuron.seq2seq.NeuronModelForSeq2SeqLM` compiles.

With a KV cache (T5, the default for ``model_type`` ``t5``), as Optimum Neuron builds T5:

* :class:`EncoderGraph`: ``(input_ids, attention_mask) -> last_hidden_state``;
* :class:`CrossGraph`: ``encoder_hidden_states -> (cross_k_0 .. cross_k_{L-1}, cross_v_0 ..)``,
  each decoder layer's cross-attention keys and values ``[rows, heads, sequence, d_kv]``,
  computed once per ``generate`` call;
* :class:`T5StepGraph`: one new token per row against the static self-attention cache, the
  cross-attention keys/values and the encoder mask; returns the token's logits and the
  keys/values of its position, which the runtime writes into the cache.

Without one (older exports, and encoder-decoders other than T5, e.g. BART):
:class:`PaddedDecoderGraph` reruns the whole decoder prefix, padded on the right to the
static length, at every step.

The T5 step is written from the model's own modules (its projections, layer norms,
feed-forward blocks, embeddings, relative-position embedding and LM head); what it spells
out is the attention: scores against the cache ``[rows * heads, 1, slots]`` and against the
new key, the cached slots at or after the query's position masked out, T5's relative position
bias for the one query position against every slot, no 1/sqrt(d) scaling (T5 folds it into
its weights). The per-step logits are tested against transformers eager at 1e-4.
"""
from __future__ import annotations

import math

import torch

from kiln.compiler.api import trace
from kiln.optimum.neuron.modeling import require_transformers

TASK = "text2text-generation"
CACHED_MODEL_TYPES = ("t5",)
ENCODER_INPUTS = ("input_ids", "attention_mask")
ENCODER_OUTPUTS = ("last_hidden_state",)
PADDED_INPUTS = ("decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask", "decoder_position")
STEP_INPUTS = ("decoder_input_ids", "decoder_position", "encoder_attention_mask")
STEP_OUTPUTS = ("logits", "new_keys", "new_values")
NEG = torch.finfo(torch.float32).min


def layer_count(config) -> int:
    return int(getattr(config, "num_decoder_layers", None) or config.num_layers)


def step_input_names(layers: int) -> list:
    """The step graph's inputs: the token, its position, the encoder mask, then per layer the
    self-attention keys, values, and the cross-attention keys, values."""
    caches = [f"{kind}_{i}" for kind in ("past_key", "past_value", "cross_key", "cross_value") for i in range(layers)]
    return [*STEP_INPUTS, *caches]


def cross_output_names(layers: int) -> list:
    return [f"{kind}_{i}" for kind in ("cross_key", "cross_value") for i in range(layers)]


def supports_kv_cache(model) -> bool:
    """Whether the model is a T5 whose decoder kiln can compile as a cached step."""
    decoder = getattr(model, "decoder", None)
    return (getattr(model.config, "model_type", None) in CACHED_MODEL_TYPES and decoder is not None
            and hasattr(decoder, "block") and hasattr(model, "lm_head"))


class EncoderGraph(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class PaddedDecoderGraph(torch.nn.Module):
    """One decoding step without a cache: the right-padded decoder tokens in, the logits of
    ``decoder_position`` out. A pre-hook on the LM head keeps only that position's hidden
    state, so the head (the largest matmul of a small decoder) runs once per row."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask, decoder_position):
        def one_position(module, args):
            index = decoder_position.view(-1, 1, 1).expand(-1, 1, args[0].shape[-1])
            return (torch.gather(args[0], 1, index),)

        encoded = require_transformers().modeling_outputs.BaseModelOutput(last_hidden_state=encoder_hidden_states)
        hook = self.model.get_output_embeddings().register_forward_pre_hook(one_position)
        try:
            out = self.model(encoder_outputs=encoded, attention_mask=encoder_attention_mask,
                             decoder_input_ids=decoder_input_ids, use_cache=False, return_dict=True)
        finally:
            hook.remove()
        return out.logits[:, 0]


def _heads(attn, x):
    """``[rows, t, d_model] -> [rows, heads, t, d_kv]`` of a linear projection's output."""
    return x.view(x.shape[0], x.shape[1], attn.n_heads, attn.key_value_proj_dim).transpose(1, 2)


class CrossGraph(torch.nn.Module):
    """Every decoder layer's cross-attention keys and values of the encoder output."""

    def __init__(self, model):
        super().__init__()
        self.attentions = torch.nn.ModuleList(block.layer[1].EncDecAttention for block in model.decoder.block)

    def forward(self, encoder_hidden_states):
        keys = [_heads(a, a.k(encoder_hidden_states)).contiguous() for a in self.attentions]
        values = [_heads(a, a.v(encoder_hidden_states)).contiguous() for a in self.attentions]
        return (*keys, *values)


def relative_bucket(relative, num_buckets: int, max_distance: int):
    """T5's causal (``bidirectional=False``) bucket of ``key - query`` positions, as
    transformers' ``T5Attention._relative_position_bucket``, with the logarithm's argument
    clamped where its branch is not taken (``log(0)`` cast to an integer is undefined, and
    engines need not agree on it)."""
    distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    large = exact + (torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(distance < exact, distance, large)


class T5StepGraph(torch.nn.Module):
    """``forward(decoder_input_ids [R, 1], decoder_position [R], encoder_attention_mask [R, S],
    past_key_0 .. past_value_{L-1} [R, H, N, D], cross_key_0 .. cross_value_{L-1} [R, H, S, D])``
    -> ``(logits [R, V], new_keys [L, R, H, 1, D], new_values)``.

    Slot ``s`` of the self-attention cache holds position ``s``; a row at position ``p`` sees
    slots ``s < p`` and its own new key. ``N`` (``decoder_sequence_length``) slots hold
    positions ``0 .. N-1``."""

    def __init__(self, model):
        super().__init__()
        self.decoder, self.lm_head = model.decoder, model.lm_head
        self.layers = len(model.decoder.block)
        scale = getattr(model.config, "scale_decoder_outputs", getattr(model.config, "tie_word_embeddings", True))
        self.scale = model.config.d_model ** -0.5 if scale else None

    def forward(self, decoder_input_ids, decoder_position, encoder_attention_mask, *caches):
        n = self.layers
        past_k, past_v, cross_k, cross_v = (caches[i * n:(i + 1) * n] for i in range(4))
        slots = past_k[0].shape[2]
        hidden = self.decoder.embed_tokens(decoder_input_ids)
        visible = torch.arange(slots, device=hidden.device).unsqueeze(0) < decoder_position.unsqueeze(1)  # [R, N]
        cross_mask = torch.zeros(encoder_attention_mask.shape, dtype=hidden.dtype, device=hidden.device)
        cross_mask = cross_mask.masked_fill(encoder_attention_mask == 0, NEG)[:, None, None, :]
        bias = None
        new_k, new_v = [], []
        for i, block in enumerate(self.decoder.block):
            attention = block.layer[0].SelfAttention
            if attention.has_relative_attention_bias or bias is None:
                bias = self._bias(attention, decoder_position, slots, visible)
            hidden, k, v = self._self_attention(block.layer[0], hidden, past_k[i], past_v[i], bias)
            new_k.append(k)
            new_v.append(v)
            hidden = self._cross_attention(block.layer[1], hidden, cross_k[i], cross_v[i], cross_mask)
            hidden = block.layer[-1](hidden)
        hidden = self.decoder.final_layer_norm(hidden)
        if self.scale is not None:
            hidden = hidden * self.scale
        return self.lm_head(hidden)[:, 0], torch.stack(new_k), torch.stack(new_v)

    def _bias(self, attention, position, slots: int, visible):
        """``([R, H, 1, N], [R, H, 1, 1])``: the relative position bias of the query at
        ``position`` against each cached slot (masked ones at the float minimum) and against
        itself; zeros for a layer without a bias of its own, as in transformers."""
        rows, heads = position.shape[0], attention.n_heads
        if not attention.has_relative_attention_bias:
            cached = torch.zeros(rows, heads, 1, slots, dtype=torch.float32, device=position.device)
            own = torch.zeros(rows, heads, 1, 1, dtype=torch.float32, device=position.device)
        else:
            relative = torch.arange(slots, device=position.device).unsqueeze(0) - position.unsqueeze(1)
            buckets = relative_bucket(relative, attention.relative_attention_num_buckets,
                                      attention.relative_attention_max_distance)
            table = attention.relative_attention_bias
            cached = table(buckets).permute(0, 2, 1).unsqueeze(2)                    # [R, H, 1, N]
            own = table.weight[0].view(1, heads, 1, 1).expand(rows, heads, 1, 1)     # distance 0: bucket 0
        return cached.masked_fill(~visible[:, None, None, :], NEG), own

    @staticmethod
    def _self_attention(layer, hidden, past_k, past_v, bias):
        attention, (cached_bias, own_bias) = layer.SelfAttention, bias
        x = layer.layer_norm(hidden)
        q, k, v = (_heads(attention, proj(x)) for proj in (attention.q, attention.k, attention.v))
        rows, heads, _, dim = q.shape
        slots = past_k.shape[2]
        q3 = q.reshape(rows * heads, 1, dim)
        cached = torch.bmm(q3, past_k.reshape(rows * heads, slots, dim).transpose(1, 2))
        cached = cached + cached_bias.reshape(rows * heads, 1, slots)
        own = (q3 * k.reshape(rows * heads, 1, dim)).sum(-1, keepdim=True) + own_bias.reshape(rows * heads, 1, 1)
        probs = torch.cat([cached, own], dim=-1).softmax(dim=-1)
        out = torch.bmm(probs[..., :slots], past_v.reshape(rows * heads, slots, dim))
        out = out + probs[..., slots:] * v.reshape(rows * heads, 1, dim)
        out = out.reshape(rows, heads * dim).unsqueeze(1)
        return hidden + attention.o(out), k, v

    @staticmethod
    def _cross_attention(layer, hidden, keys, values, mask):
        attention = layer.EncDecAttention
        q = _heads(attention, attention.q(layer.layer_norm(hidden)))
        rows, heads, _, dim = q.shape
        length = keys.shape[2]
        scores = torch.bmm(q.reshape(rows * heads, 1, dim), keys.reshape(rows * heads, length, dim).transpose(1, 2))
        scores = scores.view(rows, heads, 1, length) + mask
        probs = scores.softmax(dim=-1).reshape(rows * heads, 1, length)
        out = torch.bmm(probs, values.reshape(rows * heads, length, dim)).reshape(rows, heads * dim).unsqueeze(1)
        return hidden + attention.o(out)


# -- compile ---------------------------------------------------------------------------------

def _examples(model, shapes: dict):
    rows, length = shapes["batch_size"], shapes["sequence_length"]
    vocab = max(int(getattr(model.config, "vocab_size", 2) or 2), 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.int64)
    return vocab, gen, ids, mask


def compile_graphs(model, shapes: dict, options: dict, kv_cache: bool) -> dict:
    """``{"encoder": ..., "decoder": ...}``, and ``"cross"`` with ``kv_cache``: each graph
    traced on inputs of its static shape (module doc)."""
    vocab, gen, ids, mask = _examples(model, shapes)
    beams, name = shapes["num_beams"], type(model).__name__
    encoder_graph = EncoderGraph(model).eval()
    graphs = {"encoder": trace(encoder_graph, (ids, mask), name=f"{name} encoder ({TASK})", **options)}
    with torch.no_grad():
        hidden = encoder_graph(ids, mask)
    if kv_cache:
        graphs["cross"] = trace(CrossGraph(model).eval(), (hidden,), name=f"{name} cross-attention ({TASK})",
                                **options)
        graphs["decoder"] = trace(T5StepGraph(model).eval(), _step_examples(model, shapes, vocab, gen),
                                  name=f"{name} decoder step ({TASK})", **options)
        return graphs
    beam_rows, decoder_length = shapes["batch_size"] * beams, shapes["decoder_sequence_length"]
    decoder_ids = torch.randint(1, vocab, (beam_rows, decoder_length), generator=gen)
    position = torch.arange(beam_rows, dtype=torch.int64) % decoder_length
    graphs["decoder"] = trace(PaddedDecoderGraph(model).eval(),
                              (decoder_ids, hidden.repeat_interleave(beams, dim=0),
                               mask.repeat_interleave(beams, dim=0), position),
                              name=f"{name} decoder ({TASK})", **options)
    return graphs


def _step_examples(model, shapes: dict, vocab: int, gen) -> tuple:
    """The step's inputs at the static shapes: rows at different positions, one input
    position masked, caches of small random values."""
    config = model.config
    rows = shapes["batch_size"] * shapes["num_beams"]
    slots, length, layers = shapes["decoder_sequence_length"], shapes["sequence_length"], layer_count(config)
    ids = torch.randint(1, vocab, (rows, 1), generator=gen)
    position = torch.arange(rows, dtype=torch.int64) % slots
    mask = torch.ones(rows, length, dtype=torch.int64)
    mask[:, length - 1:] = 0 if length > 1 else 1
    past = [torch.randn(rows, config.num_heads, slots, config.d_kv, generator=gen) * 0.5 for _ in range(2 * layers)]
    cross = [torch.randn(rows, config.num_heads, length, config.d_kv, generator=gen) * 0.5
             for _ in range(2 * layers)]
    return (ids, position, mask, *past, *cross)
