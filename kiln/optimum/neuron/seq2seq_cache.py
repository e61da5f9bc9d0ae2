"""What :class:`~kiln.optimum.neuron.seq2seq.NeuronModelForSeq2SeqLM` hands transformers'
``generate``: a weightless ``PreTrainedModel + GenerationMixin`` whose encoder and forward are
the compiled graphs (:func:`hf_driver`), and the static KV cache of one ``generate`` call
(:class:`StaticSeq2SeqCache`).

The cache is kiln's own object, not a ``transformers.Cache``: ``generate`` only asks it for
its length (``get_seq_length``, ``is_linear``), passes it to the model's forward as ``cache``
and takes it back from the output, and in beam search calls ``reorder_cache(beam_idx)``. The
tensors it holds are the decoder step graph's inputs, one per layer and kind, at the static
shape ``[batch_size * num_beams, heads, decoder_sequence_length, d_kv]``; each step's new keys
and values are written into slot ``position`` in place.
"""
from __future__ import annotations

import copy

import torch

from kiln.optimum.neuron.modeling import require_transformers


class StaticSeq2SeqCache:
    """The self-attention keys/values (``keys``, ``values``: one tensor per layer), the
    cross-attention keys/values (``cross``, set by :meth:`start`), the encoder mask, and
    ``length``: the decoder positions written so far (slot ``s`` holds position ``s``)."""

    is_compileable = False
    is_linear = (False,)

    def __init__(self, rows: int, heads: int, slots: int, d_kv: int, layers: int):
        self.keys = [torch.zeros(rows, heads, slots, d_kv) for _ in range(layers)]
        self.values = [torch.zeros(rows, heads, slots, d_kv) for _ in range(layers)]
        self.slots = slots
        self.cross = None
        self.mask = None
        self.rows = 0          # the caller's rows; the rest are filler
        self.length = 0

    def start(self, cross: list, mask, rows: int) -> None:
        self.cross, self.mask, self.rows = cross, mask, rows

    @property
    def started(self) -> bool:
        return self.cross is not None

    def inputs(self) -> list:
        """The step graph's cache inputs, in its order (past keys, past values, cross)."""
        return [*self.keys, *self.values, *self.cross]

    def append(self, new_keys, new_values) -> None:
        """Write one step's keys/values ``[layers, rows, heads, 1, d_kv]`` at slot ``length``."""
        slot = self.length
        for cache, new in zip(self.keys, new_keys):
            cache[:, :, slot:slot + 1].copy_(new)
        for cache, new in zip(self.values, new_values):
            cache[:, :, slot:slot + 1].copy_(new)
        self.length += 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row ``i`` continues the beam of row ``beam_idx[i]``."""
        rows, filled = int(beam_idx.shape[0]), self.length
        if filled == 0 or torch.equal(beam_idx, torch.arange(rows, device=beam_idx.device)):
            return
        for cache in (*self.keys, *self.values):
            cache[:rows, :, :filled] = cache[:rows, :, :filled].index_select(0, beam_idx)


def pad_right(t, dim: int, size: int, value):
    """``t`` padded on the right along ``dim`` to ``size`` with ``value``."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
    return torch.nn.functional.pad(t, pads, value=value)


def fill_rows(t, rows: int):
    """``t`` with copies of its first row up to ``rows`` (a row of padding alone would attend to nothing)."""
    if t.shape[0] < rows:
        t = torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])
    return t.contiguous()


def first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


class EncoderShim:
    """What ``generate`` calls as the encoder (``get_encoder()``)."""

    main_input_name = "input_ids"

    def __init__(self, owner):
        self.owner = owner

    def __call__(self, **kwargs):
        return self.forward(**kwargs)

    def forward(self, input_ids=None, attention_mask=None, output_attentions=None, output_hidden_states=None,
                return_dict=True):
        from transformers.modeling_outputs import BaseModelOutput
        if output_attentions or output_hidden_states:
            raise ValueError("output_attentions/output_hidden_states: this model was exported without them")
        return BaseModelOutput(last_hidden_state=self.owner.encode(input_ids, attention_mask))


def hf_driver(owner):
    """A weightless ``transformers.PreTrainedModel`` + ``GenerationMixin`` whose encoder and
    forward are ``owner``'s compiled graphs: transformers' ``generate`` runs on it unchanged.
    With a cached decoder it starts each ``generate`` call with a fresh
    :class:`StaticSeq2SeqCache` (``owner.new_cache()``), where transformers would make its
    ``EncoderDecoderCache``."""
    tf = require_transformers()

    class KilnSeq2SeqDriver(tf.PreTrainedModel, tf.GenerationMixin):
        main_input_name = "input_ids"
        base_model_prefix = "kiln"
        _supports_sdpa = True

        def __init__(self, config):
            super().__init__(config)
            self.generation_config = copy.deepcopy(owner.generation_config)

        @property
        def device(self):
            return torch.device("cpu")

        def get_encoder(self, *args, **kwargs):
            return EncoderShim(owner)

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            if model_kwargs.get("cache") is not None:
                raise ValueError("cache=: kiln's compiled decoder keeps its own static KV cache; generate() "
                                 "makes one per call")
            if owner.kv_cache and generation_config.use_cache:
                model_kwargs["cache"] = owner.new_cache()

        def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None,
                    **kwargs):
            return owner.forward(input_ids=input_ids, attention_mask=attention_mask,
                                 decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_outputs, **kwargs)

    config = copy.deepcopy(owner.config)
    if hasattr(config, "neuron"):
        del config.neuron
    return KilnSeq2SeqDriver(config).eval()
