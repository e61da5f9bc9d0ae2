"""Optimum Neuron's ``NeuronModelForSeq2SeqLM`` (T5-style encoder-decoders) on kiln.

    model = NeuronModelForSeq2SeqLM.from_pretrained("./t5", export=True, batch_size=1,
                                                    sequence_length=64, num_beams=4)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)   # transformers' tokens
    model.save_pretrained("./t5-kiln")   # encoder/model.kiln, decoder/model.kiln, config.json, ...

Two graphs are compiled with ``kiln.trace``:

* the **encoder**, ``(input_ids, attention_mask) -> last_hidden_state`` at
  ``[batch_size, sequence_length]``;
* the **decoder step**, without a KV cache: ``(decoder_input_ids, encoder_hidden_states,
  encoder_attention_mask, decoder_position) -> logits`` at ``batch_size * num_beams`` rows and
  ``decoder_sequence_length`` (default: ``sequence_length``) decoder tokens. The tokens so far
  are padded on the right to the static length; the decoder is causal, so the padding never
  changes an earlier position, and the graph returns the logits of ``decoder_position`` only
  (the LM head runs on that one position).

transformers' own ``GenerationMixin.generate`` drives both graphs (``use_cache=False``), so
greedy search, beam search and their stopping rules are Hugging Face's code, and the tokens are
transformers' ``model.generate`` tokens. The cost of having no cache: every new token runs the
decoder over all ``decoder_sequence_length`` positions, so a step costs as much as the longest
one, and ``n`` new tokens cost ``n * decoder_sequence_length`` decoder positions where a KV
cache would cost ``n``. Keep ``decoder_sequence_length`` near the longest output you need.

``num_beams`` is fixed at export, as on Neuron; so are the batch, the input length and the
decoder length: a shorter or smaller input is padded (the pad token with a zero mask; the batch
with copies of the first row), a larger one is a ``ValueError`` naming the export option that
raises the limit.
"""
from __future__ import annotations

import copy
import json
import logging
import os

import torch

from kiln.atomic import write_atomic
from kiln.compiler.api import trace
from kiln.errors import ArtifactError, CompilerArgsError
from kiln.optimum.neuron import options as neuron_options
from kiln.optimum.neuron.modeling import MODEL_FILE, preprocessors_of, require_transformers
from kiln.runtime.loader import load

log = logging.getLogger("kiln.optimum")
TASK = "text2text-generation"
SHAPES = ("batch_size", "sequence_length", "num_beams")
DECODER_LENGTH = "decoder_sequence_length"
ENCODER_INPUTS = ("input_ids", "attention_mask")
ENCODER_OUTPUTS = ("last_hidden_state",)
DECODER_INPUTS = ("decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask", "decoder_position")
DECODER_OUTPUTS = ("logits",)
GENERATION_CONFIG = "generation_config.json"
LOADING = ("token", "revision", "force_download", "cache_dir", "subfolder", "trust_remote_code")


class _EncoderGraph(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class _DecoderGraph(torch.nn.Module):
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


class NeuronModelForSeq2SeqLM:
    """An encoder-decoder compiled as two kiln graphs; ``generate`` is transformers' own."""

    task = TASK
    auto_class = "AutoModelForSeq2SeqLM"
    main_input_name = "input_ids"
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, encoder, decoder, config, neuron: dict, generation_config=None, preprocessors=None):
        self.encoder, self.decoder = encoder, decoder
        self.config = config
        self.neuron = dict(neuron)
        self.static = neuron_options.static_shapes(self.neuron)
        self.generation_config = generation_config or _generation_config(config)
        self.preprocessors = list(preprocessors or [])
        self.input_names = tuple(self.neuron["input_names"])
        self.output_names = tuple(self.neuron["output_names"])
        self._driver = None

    # -- export and load -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_id, export: bool = False, config=None, local_files_only: bool = True, **kwargs):
        """``model_id``: a local directory (a Hugging Face checkpoint with ``export=True``,
        else one this class saved). Nothing is downloaded."""
        path = os.fspath(model_id)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: not a directory; kiln.optimum loads local checkpoint directories "
                                    "only (nothing is downloaded)")
        for loading in LOADING:
            kwargs.pop(loading, None)
        if export:
            return cls._export(path, config, **kwargs)
        if kwargs:
            raise CompilerArgsError(f"{', '.join(sorted(kwargs))} only apply with export=True; this loads an "
                                    "already exported model")
        return cls._load(path)

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        tf = require_transformers()
        decoder_length = kwargs.pop(DECODER_LENGTH, None)
        if kwargs.get("num_beams") is None:
            kwargs["num_beams"] = 1
        opts = neuron_options.parse(TASK, SHAPES, kwargs)
        if decoder_length is None:
            decoder_length = opts.shapes["sequence_length"]
        if not isinstance(decoder_length, int) or decoder_length < 1:
            raise CompilerArgsError(f"{DECODER_LENGTH} must be a positive integer; got {decoder_length!r}")
        config = config or tf.AutoConfig.from_pretrained(path, local_files_only=True)
        if "neuron" in config.to_dict():
            raise CompilerArgsError(f"{path} is already an exported model: load it without export=True")
        if not getattr(config, "is_encoder_decoder", False):
            raise CompilerArgsError(f"{path} holds a {config.model_type} model, not an encoder-decoder: "
                                    f"{cls.__name__} exports T5-style sequence-to-sequence models")
        _check_positions(config, opts.shapes["sequence_length"], decoder_length)
        try:
            model = getattr(tf, cls.auto_class).from_pretrained(path, config=config, local_files_only=True).eval()
        except ValueError as e:     # transformers' "Unrecognized configuration class" (Whisper, ...)
            raise CompilerArgsError(f"{path}: transformers' {cls.auto_class} does not load a {config.model_type} "
                                    f"model ({str(e).splitlines()[0]}); {cls.__name__} exports text-to-text "
                                    "encoder-decoders such as T5") from None
        shapes = dict(opts.shapes, **{DECODER_LENGTH: decoder_length})
        encoder, decoder = _compile(model, shapes, opts.trace)
        neuron = dict(opts.neuron, **{f"static_{DECODER_LENGTH}": decoder_length},
                      input_names=[*ENCODER_INPUTS, "decoder_input_ids"], output_names=list(DECODER_OUTPUTS),
                      model_type=config.model_type)
        generation = _generation_config(config, path)
        out = cls(encoder, decoder, config, neuron, generation, preprocessors_of(path))
        if out.cache_hit:
            log.info("kiln.optimum: %s came from the compile cache: nothing was recompiled", path)
        return out

    @property
    def cache_hit(self) -> bool:
        """Whether exporting took both compiled graphs from kiln's compile cache."""
        return all(bool(m.manifest.get("cache", {}).get("hit")) for m in (self.encoder, self.decoder))

    @classmethod
    def _load(cls, path):
        tf = require_transformers()
        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"{path} has no config.json: it holds no model kiln exported; pass export=True "
                                    "to compile a Hugging Face checkpoint")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        neuron = getattr(config, "neuron", None)
        if neuron is None:
            raise FileNotFoundError(f"{path} is a Hugging Face checkpoint, not a model kiln exported: pass "
                                    "export=True to compile it")
        if not isinstance(neuron, dict) or neuron.get("compiler_type") != "kiln":
            raise ArtifactError(f"{path}/config.json has no kiln 'neuron' section (compiler_type 'kiln'): it was "
                                "not saved by kiln.optimum; export it with export=True")
        if neuron.get("task") != TASK:
            raise ArtifactError(f"{path} was exported for task {neuron.get('task')!r}; load it with that "
                                f"task's class, not {cls.__name__} ({TASK!r})")
        graphs = [os.path.join(path, part, MODEL_FILE) for part in ("encoder", "decoder")]
        missing = [g for g in graphs if not os.path.exists(g)]
        if missing:
            raise ArtifactError(f"{path} is incomplete: {', '.join(missing)} missing; export the model again")
        return cls(load(graphs[0]), load(graphs[1]), config, neuron, _generation_config(config, path),
                   preprocessors_of(path))

    def save_pretrained(self, save_directory) -> None:
        """``encoder/`` and ``decoder/`` (each ``model.kiln`` and a ``config.json`` naming that
        graph's inputs and outputs), ``config.json`` with the ``neuron`` section,
        ``generation_config.json`` and the preprocessors; each file written atomically."""
        os.makedirs(save_directory, exist_ok=True)
        graphs = {"encoder": (self.encoder, ENCODER_INPUTS, ENCODER_OUTPUTS),
                  "decoder": (self.decoder, DECODER_INPUTS, DECODER_OUTPUTS)}
        for part, (graph, inputs, outputs) in graphs.items():
            os.makedirs(os.path.join(save_directory, part), exist_ok=True)
            graph.save(os.path.join(save_directory, part, MODEL_FILE))
            section = dict(self.neuron, input_names=list(inputs), output_names=list(outputs),
                           model_type=f"{self.config.model_type}-{part}")
            _write_json(os.path.join(save_directory, part, "config.json"), dict(self.config.to_dict(), neuron=section))
        _write_json(os.path.join(save_directory, "config.json"), dict(self.config.to_dict(), neuron=self.neuron))
        if self.generation_config is not None:
            text = self.generation_config.to_json_string(use_diff=True).encode()
            write_atomic(os.path.join(save_directory, GENERATION_CONFIG), lambda f: f.write(text))
        for p in self.preprocessors:
            p.save_pretrained(save_directory)

    # -- run ------------------------------------------------------------------------------

    def encode(self, input_ids, attention_mask=None):
        """The encoder's ``last_hidden_state`` for ``[b, s]`` ids, ``b <= batch_size`` and
        ``s <= sequence_length``: padded to the static shape, trimmed back."""
        ids = torch.as_tensor(input_ids).to(torch.int64)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to(torch.int64)
        rows, length = ids.shape
        self._fits(rows, self.static["batch_size"], "rows", "batch_size")
        self._fits(length, self.static["sequence_length"], "input tokens", "sequence_length")
        ids = _pad(ids, 1, self.static["sequence_length"], self._pad_id)
        mask = _pad(mask, 1, self.static["sequence_length"], 0)
        hidden = self.encoder(_fill(ids, self.static["batch_size"]), _fill(mask, self.static["batch_size"]))
        return _first(hidden)[:rows, :length]

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask=None):
        """The logits ``[n, 1, vocab]`` of the last of ``decoder_input_ids`` (``[n, t]``), as
        transformers' ``model(...).logits[:, -1:]``, for ``n <= batch_size * num_beams`` rows
        and ``t <= decoder_sequence_length`` tokens."""
        ids = torch.as_tensor(decoder_input_ids).to(torch.int64)
        hidden = torch.as_tensor(encoder_hidden_states)
        rows, length = ids.shape
        mask = (torch.ones(hidden.shape[:2], dtype=torch.int64) if attention_mask is None
                else torch.as_tensor(attention_mask).to(torch.int64))
        static_rows = self.static["batch_size"] * self.static["num_beams"]
        decoder_length = self.static[DECODER_LENGTH]
        self._fits(rows, static_rows, "decoder rows", "batch_size x num_beams")
        if length > decoder_length:
            raise ValueError(f"a decoder sequence of {length} tokens does not fit the compiled "
                             f"{DECODER_LENGTH} {decoder_length}: export with a larger {DECODER_LENGTH} "
                             "(default: sequence_length), or ask for fewer new tokens")
        self._fits(hidden.shape[1], self.static["sequence_length"], "input tokens", "sequence_length")
        ids = _fill(_pad(ids, 1, decoder_length, self._pad_id), static_rows)
        hidden = _fill(_pad(hidden, 1, self.static["sequence_length"], 0.0), static_rows)
        mask = _fill(_pad(mask, 1, self.static["sequence_length"], 0), static_rows)
        position = torch.full((static_rows,), length - 1, dtype=torch.int64)
        logits = _first(self.decoder(ids, hidden.to(torch.float32).contiguous(), mask, position))
        return logits[:rows, None]

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None, **kwargs):
        """``Seq2SeqLMOutput`` with the logits of the last decoder position (``[n, 1, vocab]``)."""
        tf = require_transformers()
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag}=True: this model was exported without those outputs")
        kwargs.pop("return_dict", None)
        if kwargs.pop("use_cache", None):
            raise ValueError("use_cache=True: kiln's decoder graph has no KV cache; it reruns the whole "
                             "(padded) decoder sequence each step")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"{type(self).__name__} takes input_ids, attention_mask, decoder_input_ids and "
                             f"encoder_outputs; got {', '.join(unknown)} too")
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids is required")
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("input_ids (or encoder_outputs) is required")
            encoder_outputs = tf.modeling_outputs.BaseModelOutput(last_hidden_state=self.encode(input_ids,
                                                                                                attention_mask))
        hidden = encoder_outputs[0]
        logits = self.decode(decoder_input_ids, hidden, attention_mask)
        return tf.modeling_outputs.Seq2SeqLMOutput(logits=logits, encoder_last_hidden_state=hidden)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        """transformers' ``generate`` (greedy, beam search with the exported ``num_beams``,
        sampling) on the compiled graphs: ``[b, 1 + new tokens]`` ids, as transformers returns."""
        config = copy.deepcopy(generation_config or self.generation_config)
        beams = kwargs.pop("num_beams", None) or self.static["num_beams"]
        if beams != self.static["num_beams"]:
            raise ValueError(f"num_beams={beams}: this model was exported with num_beams={self.static['num_beams']}, "
                             f"which generate() cannot change; export with num_beams={beams}")
        if kwargs.pop("use_cache", None):
            raise ValueError("use_cache=True: kiln's decoder graph has no KV cache")
        self._limit_new_tokens(config, kwargs)
        ids = torch.as_tensor(input_ids)
        mask = None if attention_mask is None else torch.as_tensor(attention_mask)
        self._fits(ids.shape[-1], self.static["sequence_length"], "input tokens", "sequence_length")
        rows = self.static["batch_size"]
        if ids.shape[0] <= rows:
            return self._hf_generate(ids, mask, config, beams, kwargs)
        if not self.neuron.get("dynamic_batch_size"):
            self._fits(ids.shape[0], rows, "rows", "batch_size")
        if kwargs.get("return_dict_in_generate") or config.return_dict_in_generate:
            raise ValueError("return_dict_in_generate=True takes at most batch_size rows; split the batch")
        parts = [self._hf_generate(ids[i:i + rows], None if mask is None else mask[i:i + rows], config, beams, kwargs)
                 for i in range(0, ids.shape[0], rows)]
        width = max(p.shape[1] for p in parts)
        pad = config.pad_token_id if config.pad_token_id is not None else self._pad_id   # as generate pads rows
        return torch.cat([_pad(p, 1, width, pad) for p in parts])

    def _hf_generate(self, ids, mask, config, beams, kwargs):
        config = copy.deepcopy(config)
        rest = config.update(num_beams=beams, use_cache=False, **kwargs)     # the model's inputs remain
        return self._generator().generate(ids, attention_mask=mask, generation_config=config, **rest)

    def _limit_new_tokens(self, config, kwargs) -> None:
        """At most ``decoder_sequence_length`` decoder tokens (the start token, or the given
        ``decoder_input_ids``, and the new ones but the last): asking for more is an error; a
        default larger than that is cut."""
        prefix, length = _prefix_length(kwargs), self.static[DECODER_LENGTH]
        limit = length - prefix + 1
        asked, what = kwargs.get("max_new_tokens"), "max_new_tokens={}"
        if asked is None and kwargs.get("max_length") is not None:
            asked, what = kwargs["max_length"] - prefix, f"max_length={kwargs['max_length']} ({{}} new tokens)"
        if asked is None:
            default = config.max_new_tokens or ((config.max_length or 20) - prefix)
            kwargs["max_new_tokens"] = min(default, limit)
        elif asked > limit:
            raise ValueError(f"{what.format(asked)} exceeds the {limit} new tokens the compiled {DECODER_LENGTH} "
                             f"{length} allows: export with {DECODER_LENGTH}={asked + prefix - 1} or more "
                             "(default: sequence_length)")

    def _generator(self):
        if self._driver is None:
            self._driver = hf_driver(self)
        return self._driver

    def _fits(self, size, limit, what, option) -> None:
        if size > limit:
            more = " (or dynamic_batch_size=True)" if option == "batch_size" and what == "rows" else ""
            raise ValueError(f"Unable to pad {size} {what} to the compiled {option} {limit}: export with a "
                             f"larger {option}{more}")

    @property
    def _pad_id(self) -> int:
        return getattr(self.config, "pad_token_id", None) or 0

    # -- what transformers asks of a model -------------------------------------------------

    def can_generate(self) -> bool:
        return True

    def eval(self):
        return self

    def to(self, device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"this model was compiled for the CPU; it cannot move to {device}")
        return self


# -- export helpers -------------------------------------------------------------------------

def _check_positions(config, sequence_length: int, decoder_length: int) -> None:
    """Models with learned positions (BART, ...) have a limit; T5's relative positions have none."""
    limit = getattr(config, "max_position_embeddings", None)
    for name, size in (("sequence_length", sequence_length), (DECODER_LENGTH, decoder_length)):
        if limit and size > limit:
            raise CompilerArgsError(f"{name}={size} exceeds the {limit} positions {config.model_type} has "
                                    f"position embeddings for; use {name} <= {limit}")


def _compile(model, shapes: dict, options: dict):
    """The encoder at ``[batch, sequence]``, then the decoder step at ``[batch * beams,
    decoder length]``, each traced on inputs of its static shape."""
    rows, length = shapes["batch_size"], shapes["sequence_length"]
    beam_rows, decoder_length = rows * shapes["num_beams"], shapes[DECODER_LENGTH]
    vocab = max(int(getattr(model.config, "vocab_size", 2) or 2), 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.int64)
    name = type(model).__name__
    encoder_graph = _EncoderGraph(model).eval()
    encoder = trace(encoder_graph, (ids, mask), name=f"{name} encoder ({TASK})", **options)
    with torch.no_grad():
        hidden = encoder_graph(ids, mask).repeat_interleave(shapes["num_beams"], dim=0)
    decoder_ids = torch.randint(1, vocab, (beam_rows, decoder_length), generator=gen)
    position = torch.arange(beam_rows, dtype=torch.int64) % decoder_length
    decoder = trace(_DecoderGraph(model).eval(),
                    (decoder_ids, hidden, mask.repeat_interleave(shapes["num_beams"], dim=0), position),
                    name=f"{name} decoder ({TASK})", **options)
    return encoder, decoder


def _generation_config(config, path=None):
    try:
        from transformers import GenerationConfig
    except ImportError:
        return None
    if path is not None and os.path.exists(os.path.join(path, GENERATION_CONFIG)):
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    return GenerationConfig.from_model_config(config)


def _write_json(path, data: dict) -> None:
    text = json.dumps(data, indent=2, sort_keys=True).encode()
    write_atomic(path, lambda f: f.write(text))


# -- run helpers ----------------------------------------------------------------------------

def _pad(t, dim: int, size: int, value):
    """``t`` padded on the right along ``dim`` to ``size`` with ``value``."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    pads = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
    return torch.nn.functional.pad(t, pads, value=value)


def _fill(t, rows: int):
    """``t`` with copies of its first row up to ``rows`` (a row of padding alone would attend to nothing)."""
    if t.shape[0] < rows:
        t = torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])
    return t.contiguous()


def _first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


def _prefix_length(kwargs) -> int:
    given = kwargs.get("decoder_input_ids")
    return 1 if given is None else int(torch.as_tensor(given).shape[-1])


# -- transformers' generate on the compiled graphs --------------------------------------------

class _Encoder:
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
    forward are ``owner``'s compiled graphs: transformers' ``generate`` runs on it unchanged."""
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
            return _Encoder(owner)

        def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None,
                    **kwargs):
            return owner.forward(input_ids=input_ids, attention_mask=attention_mask,
                                 decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_outputs, **kwargs)

    config = copy.deepcopy(owner.config)
    if hasattr(config, "neuron"):
        del config.neuron
    return KilnSeq2SeqDriver(config).eval()

