"""A Hugging Face decoder as one step function with the KV cache as explicit tensors.

kiln compiles an LLM into two kinds of graph, as transformers-neuronx and NxD Inference
do: *context encoding* (prefill: the prompt, T tokens, no cache) and *token generation*
(decode: T new tokens against S cached positions). Both are :class:`DecoderStep`; only
the shapes differ. The cache is a graph input and the new keys and values are graph
outputs, so the engines (ONNX Runtime, OpenVINO, Inductor) see a pure function of
fixed shapes; the runtime owns the cache buffer and writes each step's keys and values
into it in place (:mod:`kiln.runtime.kv`), never reallocating it.

Why wrap the model's own modules instead of writing Llama again: the layers, the rotary
embedding (with every ``rope_scaling`` variant) and the attention call are transformers'
code, so kiln's answers are Hugging Face's by construction. The one thing replaced is the
cache object: transformers calls ``past_key_values.update(k, v, layer)`` inside each
attention layer, and :class:`_StepCache` answers it with the cached keys concatenated to
the new ones while recording the new ones as outputs.

The mask is built here, from positions, as a boolean ``[B, 1, T, S + T]``:

* a cached slot ``s`` is visible where ``cache_valid[b, s]`` (the runtime marks a
  sequence's first ``length`` slots; slot ``s`` holds position ``s``);
* a new token ``j`` is visible to new token ``i`` where ``j <= i`` (causal), so right
  padding in a prompt is never seen by the real tokens before it;
* with a sliding window, a key is visible only where ``key_pos > query_pos - window``, as
  ``transformers.masking_utils.sliding_window_overlay`` has it, in the layers the model's own
  code slides (:func:`layer_windows`): every layer of Mistral, Qwen2's ``sliding_attention``
  layers, none of Llama's or GPT-2's.

Every query sees at least itself, so no row is fully masked.

The runtime only ever passes prefix masks (a row's first ``length`` slots, with the new
tokens at positions ``length, length + 1, ...``), and a decode step compiled for ONNX
Runtime relies on it: its attention is ``GroupQueryAttention`` over each row's count of
valid slots, which also writes the step's keys into the cache it is given
(:mod:`kiln.engines.ort_gqa`).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from kiln.errors import UnsupportedModelError

# Architectures whose decoder layers call ``past_key_values.update`` and transformers'
# attention interface: the Llama family (layers take rotary position embeddings; the
# model keeps embed_tokens / layers / norm / rotary_emb) and GPT-2 (learned position
# embeddings added at the input; the model keeps wte / wpe / h / ln_f).
SUPPORTED = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
             "GPT2LMHeadModel": "gpt2"}
_PARTS = {"gpt2": ("transformer", ("wte", "wpe", "h", "ln_f"))}
_LLAMA_PARTS = ("model", ("embed_tokens", "layers", "norm", "rotary_emb"))


def check_supported(model) -> str:
    """The model family, or an UnsupportedModelError naming what is missing."""
    arch = type(model).__name__
    if arch not in SUPPORTED:
        raise UnsupportedModelError(
            f"kiln's LLM path does not support {arch} yet: it compiles decoder-only models of the "
            f"Llama family and GPT-2 ({', '.join(sorted(SUPPORTED))}); other architectures can still be "
            "compiled as plain graphs with kiln.trace")
    where, parts = _PARTS.get(SUPPORTED[arch], _LLAMA_PARTS)
    inner = getattr(model, where, None)
    missing = [a for a in parts if not hasattr(inner, a)]
    if missing:
        raise UnsupportedModelError(f"{arch} lacks {', '.join(missing)} where kiln expects them "
                                    "(a transformers version kiln does not know?)")
    return SUPPORTED[arch]


def max_positions(config) -> int | None:
    """Positions a model with learned position embeddings (GPT-2) has embeddings for; None
    for rotary ones, which extend past their training length."""
    return getattr(config, "n_positions", None) if config.model_type == "gpt2" else None


def layer_windows(config, family: str) -> list:
    """Each layer's sliding window (None: full attention), as the family's transformers code
    applies it. Mistral slides every layer when its config has a window; Qwen2 only the layers
    its ``layer_types`` call ``sliding_attention`` (those from ``max_window_layers`` on, with
    ``use_sliding_window``); Llama and GPT-2 never, whatever their config.json carries. Until
    12-03 any config's ``sliding_window`` slid every layer: a Qwen2 with ``use_sliding_window``
    and a Llama whose converted config kept the key generated other tokens than Hugging Face."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is not None and family not in ("mistral", "qwen2"):
        warnings.warn(f"{type(config).__name__} has sliding_window={window}, which its model's attention does "
                      "not apply: kiln computes the model's forward (every position attended). transformers' "
                      "generate with its cache differs from that forward for such a config (its cache keeps only "
                      "the window's last positions); drop sliding_window from config.json if that is the intent",
                      stacklevel=3)
    if window is None or family not in ("mistral", "qwen2"):
        return [None] * layers
    if family == "qwen2":
        if not getattr(config, "use_sliding_window", False):
            return [None] * layers
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) < layers:
            raise UnsupportedModelError(f"{type(config).__name__} slides attention but its layer_types name "
                                        f"{len(types)} of its {layers} layers")
        return [window if types[i] == "sliding_attention" else None for i in range(layers)]
    return [window] * layers


class _Split:
    """A layer's keys (or values) in two parts: the cache ``[B, H_kv, S, D]`` as given, and
    the step's new ones ``[B, H_kv, T, D]``. Joining them (``torch.cat``) would copy the
    whole cache in every layer at every step: at batch 8 and 256 positions that made
    SmolLM2's decode step 81.6 ms; :func:`cached_attention` reads the parts in place."""

    def __init__(self, cache, new):
        self.cache, self.new = cache, new


class _StepCache:
    """Stands in for transformers' Cache inside one step: the cached keys/values (none in
    prefill) with the new ones, as :class:`_Split` for :func:`cached_attention`; the new
    ones kept as the step's outputs."""

    def __init__(self, k_cache, v_cache):
        self.k_cache, self.v_cache = k_cache, v_cache
        self.new_k: list = []
        self.new_v: list = []

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.new_k.append(key)
        self.new_v.append(value)
        if self.k_cache is None:
            return key, value
        return _Split(self.k_cache[layer_idx], key), _Split(self.v_cache[layer_idx], value)

    def get_seq_length(self, layer_idx=0) -> int:
        return 0 if self.k_cache is None else self.k_cache[layer_idx].shape[2]


ATTENTION = "kiln_cached"


def cached_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function signature, for a step with a cache: softmax over
    the cached and the new keys together, without joining them. Query heads are grouped
    under their key/value head (``[B*H_kv, G*T, D]``), so grouped-query attention needs
    no copy of the cache either. ``attention_mask``: boolean ``[B, 1, T, S + T]``.

    Written with 3-D ``bmm`` on views, not 4-D ``@``: torch decomposes a 4-D matmul into
    ``expand`` + ``reshape`` + ``bmm``, which ONNX exports as an ``Expand`` (a copy of the
    value cache) and a ``Transpose`` held apart from its ``MatMul`` (a copy of the key
    cache), in every layer at every step. As ``bmm(q, k.transpose)`` ONNX Runtime fuses the
    transpose into the product (``FusedMatMul``), and nothing copies the cache."""
    batch, heads, t, dim = query.shape
    kv_heads, slots = key.cache.shape[1], key.cache.shape[2]
    groups = heads // kv_heads
    rows = batch * kv_heads
    q = query.reshape(rows, groups * t, dim) * (scaling if scaling is not None else dim ** -0.5)
    k_cache, k_new = key.cache.reshape(rows, slots, dim), key.new.reshape(rows, t, dim)
    v_cache, v_new = value.cache.reshape(rows, slots, dim), value.new.reshape(rows, t, dim)
    scores = torch.cat([torch.bmm(q, k_cache.transpose(1, 2)), torch.bmm(q, k_new.transpose(1, 2))], dim=-1)
    mask = attention_mask.unsqueeze(2).expand(batch, kv_heads, groups, t, -1).reshape(rows, groups * t, -1)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.bmm(probs[..., :slots], v_cache) + torch.bmm(probs[..., slots:], v_new)
    return out.reshape(batch, heads, t, dim).transpose(1, 2).contiguous(), None


def _register_attention():
    from transformers import AttentionInterface
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, cached_attention)


class DecoderStep(nn.Module):
    """``forward(input_ids, positions, [k_0 .. k_{L-1}, v_0 .. v_{L-1}, cache_valid,] [last])``.

    * ``input_ids``, ``positions``: ``[B, T]`` int64.
    * ``k_l``, ``v_l``: layer ``l``'s cache, ``[B, H_kv, S, D]``, one input per layer and
      kind; ``cache_valid``: ``[B, S]`` bool (absent for prefill, ``with_cache=False``).
      One input per layer, not one ``[L, ...]`` tensor: an engine slices a layer out of a
      stacked input by copying it (ONNX ``Gather``), which is the whole cache every step;
      and the runtime can hand a decode graph for fewer rows the first rows of each
      layer's buffer as a view.
    * ``last``: ``[B]`` int64, the index of each row's last real token, when only its
      logits are wanted (prefill); otherwise logits for all T tokens (decode, and the
      verification pass of speculative decoding).

    Returns ``(logits [B, T or 1, V], new_k [L, B, H_kv, T, D], new_v)``.
    """

    # Capture records no source line per node (kiln.graph.capture): the lines would all be in
    # the model library's own code, and recording them took 1.1-1.3 of 6.5 s per SmolLM2
    # decode graph (2 cores, 11-28)
    kiln_record_stack_traces = False

    def __init__(self, causal_lm, *, with_cache: bool, last_only: bool):
        super().__init__()
        self.family = check_supported(causal_lm)
        self.model = getattr(causal_lm, _PARTS.get(self.family, _LLAMA_PARTS)[0])
        self.lm_head = causal_lm.lm_head
        self.config = causal_lm.config
        self.with_cache, self.last_only = with_cache, last_only
        self.windows = layer_windows(self.config, self.family)

    def forward(self, input_ids, positions, *rest):
        rest = list(rest)
        k_cache = v_cache = valid = None
        if self.with_cache:
            layers = self.config.num_hidden_layers
            k_cache, v_cache, valid = rest[:layers], rest[layers:2 * layers], rest[2 * layers]
            rest = rest[2 * layers + 1:]
        last = rest[0] if self.last_only else None
        masks = {w: self._mask(positions, valid, w) for w in set(self.windows)}
        mask = [masks[w] for w in self.windows]         # one per layer
        cache = _StepCache(k_cache, v_cache)
        previous = self.config._attn_implementation
        if self.with_cache:
            _register_attention()
            self.config._attn_implementation = ATTENTION
        try:
            hidden = self._layers(input_ids, positions, mask, cache)
        finally:
            self.config._attn_implementation = previous
        if last is not None:
            hidden = hidden[torch.arange(hidden.shape[0]), last].unsqueeze(1)
        norm = self.model.ln_f if self.family == "gpt2" else self.model.norm
        logits = self.lm_head(norm(hidden))
        return logits, torch.stack(cache.new_k), torch.stack(cache.new_v)

    def _layers(self, input_ids, positions, masks, cache):
        """The embeddings and every decoder layer, each family's way; ``masks``: one per layer."""
        if self.family == "gpt2":
            hidden = self.model.wte(input_ids) + self.model.wpe(positions)
            for layer, mask in zip(self.model.h[: self.config.num_hidden_layers], masks):
                hidden = layer(hidden, past_key_values=cache, attention_mask=mask, use_cache=True)
            return hidden
        hidden = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb(hidden, position_ids=positions)
        for layer, mask in zip(self.model.layers[: self.config.num_hidden_layers], masks):
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                           past_key_values=cache, use_cache=True)
        return hidden

    @staticmethod
    def _mask(positions, valid, window):
        """Boolean ``[B, 1, T, S + T]``: what each new token may attend to in a layer with
        this sliding ``window`` (None: full attention; module doc)."""
        t = positions.shape[1]
        new_keys = positions.unsqueeze(1)                       # [B, 1, T] key positions
        queries = positions.unsqueeze(2)                        # [B, T, 1]
        order = torch.arange(t, device=positions.device)
        mask = (order.unsqueeze(0) <= order.unsqueeze(1)).unsqueeze(0)   # [1, T, T] causal by index
        if window is not None:
            mask = mask & (new_keys > queries - window)
        if valid is not None:
            slots = torch.arange(valid.shape[1], device=positions.device).view(1, 1, -1)
            cached = valid.unsqueeze(1)                          # [B, 1, S]
            if window is not None:
                cached = cached & (slots > queries - window)
            mask = torch.cat([cached.expand(-1, t, -1), mask.expand(positions.shape[0], -1, -1)], dim=2)
        return mask.unsqueeze(1).expand(positions.shape[0], 1, t, -1)


def cache_shape(config, batch: int, length: int) -> tuple:
    """``[L, B, H_kv, S, D]`` of a KV cache for ``config``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (config.num_hidden_layers, batch, kv_heads, length, head_dim)
