"""Optimum Neuron's ``NeuronModelForSeq2SeqLM`` (T5-style encoder-decoders) on kiln.

    model = NeuronModelForSeq2SeqLM.from_pretrained("./t5", export=True, batch_size=1,
                                                    sequence_length=64, num_beams=4)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)   # transformers' tokens
    model.save_pretrained("./t5-kiln")   # encoder/, cross_attention/, decoder/, config.json, ...

For T5 (the default there) three graphs are compiled with ``kiln.trace``, as Optimum Neuron
builds T5 with a KV cache (:mod:`kiln.optimum.neuron.seq2seq_graphs`):

* the **encoder**, ``(input_ids, attention_mask) -> last_hidden_state`` at
  ``[batch_size, sequence_length]``;
* the **cross-attention** projections, ``last_hidden_state -> each decoder layer's keys and
  values``, run once per ``generate`` call (on the distinct rows: beams share them);
* the **decoder step**: one new token per row (``batch_size * num_beams`` rows), its position,
  the static self-attention cache (``decoder_sequence_length`` slots, default
  ``sequence_length``), the cross-attention keys/values and the encoder mask in; that token's
  logits and its keys/values out, written into the cache in place
  (:class:`~kiln.optimum.neuron.seq2seq_cache.StaticSeq2SeqCache`).

Other encoder-decoders (BART, mT5, ...), ``decoder_kv_cache=False``, and directories saved
before the cache existed use the decoder without a cache: the whole prefix, padded on the
right to ``decoder_sequence_length``, rerun at every step.

transformers' own ``GenerationMixin.generate`` drives the graphs, so greedy search, beam search
and their stopping rules are Hugging Face's code, and the tokens are transformers'
``model.generate`` tokens; kiln's cache object stands in for transformers' and reorders its
rows for beam search.

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
from kiln.errors import ArtifactError, CompilerArgsError
from kiln.optimum.neuron import options as neuron_options
from kiln.optimum.neuron import seq2seq_graphs as graphs_mod
from kiln.optimum.neuron.exported import exported_class, local_directory, wrong_class
from kiln.optimum.neuron.modeling import MODEL_FILE, CpuModel, preprocessors_of, require_transformers
from kiln.optimum.neuron.seq2seq_cache import StaticSeq2SeqCache, fill_rows, first, hf_driver, pad_right
from kiln.runtime.loader import load

log = logging.getLogger("kiln.optimum")
TASK = graphs_mod.TASK
SHAPES = ("batch_size", "sequence_length", "num_beams")
DECODER_LENGTH = "decoder_sequence_length"
KV_CACHE = "decoder_kv_cache"
FORMAT_KEY, FORMAT = "kiln_seq2seq_format", 2      # 1 (the key absent): no KV cache, encoder/ and decoder/
GENERATION_CONFIG = "generation_config.json"
CROSS_DIR = "cross_attention"


class NeuronModelForSeq2SeqLM(CpuModel):
    """An encoder-decoder compiled as kiln graphs; ``generate`` is transformers' own."""

    task = TASK
    auto_class = "AutoModelForSeq2SeqLM"
    main_input_name = "input_ids"
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, encoder, decoder, config, neuron: dict, generation_config=None, preprocessors=None,
                 cross=None):
        self.encoder, self.decoder, self.cross = encoder, decoder, cross
        self.config = config
        self.neuron = dict(neuron)
        self.kv_cache = bool(self.neuron.get(KV_CACHE, False))
        if self.kv_cache and cross is None:
            raise ValueError("a decoder with a KV cache needs the cross-attention graph (cross=)")
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
        path = local_directory(model_id, kwargs)
        if export:
            return cls._export(path, config, **kwargs)
        if kwargs:
            raise CompilerArgsError(f"{', '.join(sorted(kwargs))} only apply with export=True; this loads an "
                                    "already exported model")
        return cls._load(path)

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        tf = require_transformers()
        decoder_length, kv_cache = kwargs.pop(DECODER_LENGTH, None), kwargs.pop(KV_CACHE, None)
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
        kv_cache = _kv_cache_choice(model, kv_cache)
        shapes = dict(opts.shapes, **{DECODER_LENGTH: decoder_length})
        compiled = graphs_mod.compile_graphs(model, shapes, opts.trace, kv_cache)
        neuron = dict(opts.neuron, **{f"static_{DECODER_LENGTH}": decoder_length, KV_CACHE: kv_cache,
                                      FORMAT_KEY: FORMAT},
                      input_names=[*graphs_mod.ENCODER_INPUTS, "decoder_input_ids"], output_names=["logits"],
                      model_type=config.model_type)
        generation = _generation_config(config, path)
        out = cls(compiled["encoder"], compiled["decoder"], config, neuron, generation, preprocessors_of(path),
                  cross=compiled.get("cross"))
        if out.cache_hit:
            log.info("kiln.optimum: %s came from the compile cache: nothing was recompiled", path)
        return out

    @property
    def cache_hit(self) -> bool:
        """Whether exporting took every compiled graph from kiln's compile cache."""
        return all(bool(m.manifest.get("cache", {}).get("hit")) for m in self._graphs().values())

    def _graphs(self) -> dict:
        graphs = {"encoder": self.encoder, CROSS_DIR: self.cross, "decoder": self.decoder}
        return {part: g for part, g in graphs.items() if g is not None}

    @classmethod
    def _load(cls, path):
        tf = require_transformers()
        config_path = os.path.join(path, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"{path} has no config.json: it holds no model kiln exported; pass export=True "
                                    "to compile a Hugging Face checkpoint")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        neuron = getattr(config, "neuron", None)
        exported = exported_class(path)
        if exported not in (None, cls.__name__):    # a kiln causal LM has no neuron section of this kind
            raise ArtifactError(wrong_class(path, exported, cls.__name__))
        if neuron is None:
            raise FileNotFoundError(f"{path} is a Hugging Face checkpoint, not a model kiln exported: pass "
                                    "export=True to compile it")
        if not isinstance(neuron, dict) or neuron.get("compiler_type") != "kiln":
            raise ArtifactError(f"{path}/config.json has no kiln 'neuron' section (compiler_type 'kiln'): it was "
                                "not saved by kiln.optimum; export it with export=True")
        if neuron.get("task") != TASK:
            raise ArtifactError(f"{path} was exported for task {neuron.get('task')!r}; load it with that "
                                f"task's class, not {cls.__name__} ({TASK!r})")
        version = neuron.get(FORMAT_KEY, 1)
        if not isinstance(version, int) or not 1 <= version <= FORMAT:
            raise ArtifactError(f"{path} was saved in {FORMAT_KEY} {version!r}; this kiln reads formats 1 to "
                                f"{FORMAT}: load it with the kiln that saved it, or export the model again")
        neuron = dict(neuron, **{KV_CACHE: bool(neuron.get(KV_CACHE, False)) and version >= 2})
        parts = ("encoder", CROSS_DIR, "decoder") if neuron[KV_CACHE] else ("encoder", "decoder")
        files = {part: os.path.join(path, part, MODEL_FILE) for part in parts}
        missing = [f for f in files.values() if not os.path.exists(f)]
        if missing:
            raise ArtifactError(f"{path} is incomplete: {', '.join(missing)} missing; export the model again")
        graphs = {part: load(f) for part, f in files.items()}
        return cls(graphs["encoder"], graphs["decoder"], config, neuron, _generation_config(config, path),
                   preprocessors_of(path), cross=graphs.get(CROSS_DIR))

    def save_pretrained(self, save_directory) -> None:
        """``encoder/``, ``cross_attention/`` (with a KV cache) and ``decoder/`` (each
        ``model.kiln`` and a ``config.json`` naming that graph's inputs and outputs),
        ``config.json`` with the ``neuron`` section, ``generation_config.json`` and the
        preprocessors; each file written atomically."""
        os.makedirs(save_directory, exist_ok=True)
        for part, graph in self._graphs().items():
            inputs, outputs = self._graph_names(part)
            os.makedirs(os.path.join(save_directory, part), exist_ok=True)
            graph.save(os.path.join(save_directory, part, MODEL_FILE))
            section = dict(self.neuron, input_names=list(inputs), output_names=list(outputs),
                           model_type=f"{self.config.model_type}-{part.replace('_', '-')}")
            _write_json(os.path.join(save_directory, part, "config.json"), dict(self.config.to_dict(), neuron=section))
        _write_json(os.path.join(save_directory, "config.json"), dict(self.config.to_dict(), neuron=self.neuron))
        if self.generation_config is not None:
            text = self.generation_config.to_json_string(use_diff=True).encode()
            write_atomic(os.path.join(save_directory, GENERATION_CONFIG), lambda f: f.write(text))
        for p in self.preprocessors:
            p.save_pretrained(save_directory)

    def _graph_names(self, part: str) -> tuple:
        layers = graphs_mod.layer_count(self.config)
        if part == "encoder":
            return graphs_mod.ENCODER_INPUTS, graphs_mod.ENCODER_OUTPUTS
        if part == CROSS_DIR:
            return ("encoder_hidden_states",), graphs_mod.cross_output_names(layers)
        if self.kv_cache:
            return graphs_mod.step_input_names(layers), graphs_mod.STEP_OUTPUTS
        return graphs_mod.PADDED_INPUTS, ("logits",)

    # -- run ------------------------------------------------------------------------------

    def encode(self, input_ids, attention_mask=None):
        """The encoder's ``last_hidden_state`` for ``[b, s]`` ids, ``b <= batch_size`` and
        ``s <= sequence_length``: padded to the static shape, trimmed back."""
        ids = torch.as_tensor(input_ids).to(torch.int64)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to(torch.int64)
        rows, length = ids.shape
        self._fits(rows, self.static["batch_size"], "rows", "batch_size")
        self._fits(length, self.static["sequence_length"], "input tokens", "sequence_length")
        ids = pad_right(ids, 1, self.static["sequence_length"], self._pad_id)
        mask = pad_right(mask, 1, self.static["sequence_length"], 0)
        hidden = self.encoder(fill_rows(ids, self.static["batch_size"]), fill_rows(mask, self.static["batch_size"]))
        return first(hidden)[:rows, :length]

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask=None, cache=None):
        """The logits ``[n, 1, vocab]`` of the last of ``decoder_input_ids`` (``[n, t]``), as
        transformers' ``model(...).logits[:, -1:]``, for ``n <= batch_size * num_beams`` rows
        and ``t <= decoder_sequence_length`` tokens. With a KV cache, ``cache`` (from
        :meth:`new_cache`) keeps the positions run so far, and ``decoder_input_ids`` are the
        tokens after them; without one, each call runs the ``t`` tokens from position 0."""
        ids = torch.as_tensor(decoder_input_ids).to(torch.int64)
        hidden = torch.as_tensor(encoder_hidden_states)
        rows, length = ids.shape
        mask = (torch.ones(hidden.shape[:2], dtype=torch.int64) if attention_mask is None
                else torch.as_tensor(attention_mask).to(torch.int64))
        self._fits(rows, self._rows, "decoder rows", "batch_size x num_beams")
        if length < 1:
            raise ValueError("decoder_input_ids holds no token")
        done = cache.length if cache is not None else 0
        if done + length > self.static[DECODER_LENGTH]:
            raise ValueError(f"a decoder sequence of {done + length} tokens does not fit the compiled "
                             f"{DECODER_LENGTH} {self.static[DECODER_LENGTH]}: export with a larger "
                             f"{DECODER_LENGTH} (default: sequence_length), or ask for fewer new tokens")
        self._fits(hidden.shape[1], self.static["sequence_length"], "input tokens", "sequence_length")
        if self.kv_cache:
            return self._decode_cached(ids, hidden, mask, self.new_cache() if cache is None else cache)
        if cache is not None:
            raise ValueError("this model's decoder has no KV cache (exported without one): pass no cache")
        ids = fill_rows(pad_right(ids, 1, self.static[DECODER_LENGTH], self._pad_id), self._rows)
        position = torch.full((self._rows,), length - 1, dtype=torch.int64)
        logits = first(self.decoder(ids, self._padded_hidden(hidden), self._padded_mask(mask), position))
        return logits[:rows, None]

    def new_cache(self) -> StaticSeq2SeqCache:
        """An empty static cache for :meth:`decode` (``generate`` makes its own)."""
        if not self.kv_cache:
            raise ValueError("this model's decoder has no KV cache (exported without one)")
        c = self.config
        return StaticSeq2SeqCache(self._rows, c.num_heads, self.static[DECODER_LENGTH], c.d_kv,
                                  graphs_mod.layer_count(c))

    def _decode_cached(self, ids, hidden, mask, cache):
        rows = ids.shape[0]
        if not cache.started:
            cache.start(self.cross_attention(hidden), self._padded_mask(mask), rows)
        elif rows != cache.rows:
            raise ValueError(f"{rows} decoder rows for a cache started with {cache.rows}")
        logits = None
        for j in range(ids.shape[1]):
            token = fill_rows(ids[:, j:j + 1], self._rows)
            position = torch.full((self._rows,), cache.length, dtype=torch.int64)
            logits, new_k, new_v = self.decoder(token, position, cache.mask, *cache.inputs())
            cache.append(new_k, new_v)
        return logits[:rows, None]

    def cross_attention(self, encoder_hidden_states) -> list:
        """Each decoder layer's cross-attention keys, then values, ``[batch_size * num_beams,
        heads, sequence_length, d_kv]``, of ``[n, s, d_model]`` hidden states. Rows that are
        beams of one input (each repeated ``num_beams`` times, as ``generate`` expands them) run
        once."""
        hidden = self._padded_hidden(encoder_hidden_states, fill=False)
        beams, batch = self.static["num_beams"], self.static["batch_size"]
        repeat = beams > 1 and hidden.shape[0] % beams == 0 and \
            torch.equal(hidden[::beams].repeat_interleave(beams, dim=0), hidden)
        distinct = hidden[::beams] if repeat else hidden
        parts = []
        for i in range(0, distinct.shape[0], batch):
            chunk = distinct[i:i + batch]
            parts.append([t[:chunk.shape[0]] for t in self.cross(fill_rows(chunk, batch))])
        states = [torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*parts)]
        if repeat:
            states = [t.repeat_interleave(beams, dim=0) for t in states]
        return [fill_rows(t, self._rows) for t in states]

    def _padded_hidden(self, hidden, fill: bool = True):
        hidden = pad_right(hidden.to(torch.float32), 1, self.static["sequence_length"], 0.0)
        return fill_rows(hidden, self._rows) if fill else hidden.contiguous()

    def _padded_mask(self, mask):
        return fill_rows(pad_right(mask, 1, self.static["sequence_length"], 0), self._rows)

    @property
    def _rows(self) -> int:
        return self.static["batch_size"] * self.static["num_beams"]

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, encoder_outputs=None,
                cache=None, **kwargs):
        """``Seq2SeqLMOutput`` with the logits of the last decoder position (``[n, 1, vocab]``)
        and, with a KV cache, the ``cache`` given (``decoder_input_ids`` are then the tokens
        after those it holds, as transformers has it)."""
        tf = require_transformers()
        for flag in ("output_attentions", "output_hidden_states"):
            if kwargs.pop(flag, None):
                raise ValueError(f"{flag}=True: this model was exported without those outputs")
        kwargs.pop("return_dict", None)
        if kwargs.pop("use_cache", None) and not self.kv_cache:
            raise ValueError("use_cache=True: this model's decoder graph has no KV cache (exported without "
                             "one); it reruns the whole (padded) decoder sequence each step")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"{type(self).__name__} takes input_ids, attention_mask, decoder_input_ids, "
                             f"encoder_outputs and cache; got {', '.join(unknown)} too")
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids is required")
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("input_ids (or encoder_outputs) is required")
            encoder_outputs = tf.modeling_outputs.BaseModelOutput(last_hidden_state=self.encode(input_ids,
                                                                                                attention_mask))
        hidden = encoder_outputs[0]
        logits = self.decode(decoder_input_ids, hidden, attention_mask, cache)
        return tf.modeling_outputs.Seq2SeqLMOutput(logits=logits, cache=cache, encoder_last_hidden_state=hidden)

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
        if kwargs.get("use_cache") and not self.kv_cache:
            raise ValueError("use_cache=True: this model's decoder graph has no KV cache (exported without one)")
        self._limit_new_tokens(config, kwargs, given=generation_config is not None)
        sequences = kwargs.get("num_return_sequences") or config.num_return_sequences or 1
        if beams == 1 and sequences > 1:     # each sequence is a decoder row: the compiled rows hold that many
            rows = min(torch.as_tensor(input_ids).shape[0], self.static["batch_size"])
            if rows * sequences > self._rows:
                raise ValueError(f"num_return_sequences={sequences} samples {rows * sequences} decoder rows for "
                                 f"{rows} prompt(s), more than the {self._rows} this model was exported with "
                                 f"(batch_size x num_beams): pass fewer prompts at once, or export with "
                                 f"batch_size={rows * sequences}")
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
        parts = [self._hf_generate(ids[i:i + rows], None if mask is None else mask[i:i + rows], config, beams,
                                   _rows_of(kwargs, ids.shape[0], i, rows)) for i in range(0, ids.shape[0], rows)]
        width = max(p.shape[1] for p in parts)
        return torch.cat([pad_right(p, 1, width, self._fill_value(config, kwargs, beams)) for p in parts])

    def _fill_value(self, config, kwargs, beams) -> int:
        """What transformers' generate fills a finished row with, so chunks of a larger batch
        are padded to one width as the whole batch would be: the call's ``pad_token_id`` (a
        keyword wins over the config), else the first end-of-sequence id; beam search takes
        the end-of-sequence id for a pad id of 0 too (its ``pad_token_id or eos_token_id[0]``)."""
        merged = copy.deepcopy(config)
        merged.update(**{k: v for k, v in kwargs.items() if k in ("pad_token_id", "eos_token_id")})
        pad, eos = merged.pad_token_id, merged.eos_token_id
        eos = [eos] if isinstance(eos, int) else (list(eos) if eos is not None else None)
        if pad is None and eos:
            pad = eos[0]
        if beams > 1:
            return (pad or eos[0]) if eos else -1
        return pad if pad is not None else self._pad_id

    def _hf_generate(self, ids, mask, config, beams, kwargs):
        config = copy.deepcopy(config)
        kwargs = dict(kwargs, use_cache=kwargs.get("use_cache", True) if self.kv_cache else False)
        rest = config.update(num_beams=beams, **kwargs)     # the model's inputs remain
        return self._generator().generate(ids, attention_mask=mask, generation_config=config, **rest)

    def _limit_new_tokens(self, config, kwargs, given: bool = False) -> None:
        """At most ``decoder_sequence_length`` decoder tokens (the start token, or the given
        ``decoder_input_ids``, and the new ones but the last): asking for more is an error,
        by keyword or in a ``generation_config`` given to ``generate`` (``given``); the
        model's own default larger than that is cut, with a warning where its config set it."""
        prefix, length = _prefix_length(kwargs), self.static[DECODER_LENGTH]
        limit = length - prefix + 1
        asked, what = kwargs.get("max_new_tokens"), "max_new_tokens={}"
        if asked is None and kwargs.get("max_length") is not None:
            asked, what = kwargs["max_length"] - prefix, f"max_length={kwargs['max_length']} ({{}} new tokens)"
        set_in_config = config.max_new_tokens is not None or "max_length" in config.to_diff_dict()
        if asked is None and given and set_in_config:
            asked = config.max_new_tokens or config.max_length - prefix
            what = "the generation_config's max_new_tokens={}" if config.max_new_tokens else \
                f"the generation_config's max_length={config.max_length} ({{}} new tokens)"
            if asked <= limit:
                asked = None            # it fits: generate takes it from the config
        if asked is None:
            default = config.max_new_tokens or ((config.max_length or 20) - prefix)
            if default > limit and set_in_config:
                log.warning("kiln.optimum: the model's generation_config asks for %d new tokens; this export's "
                            "%s=%d holds %d: generating at most that many", default, DECODER_LENGTH, length, limit)
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


# -- export helpers -------------------------------------------------------------------------

def _check_positions(config, sequence_length: int, decoder_length: int) -> None:
    """Models with learned positions (BART, ...) have a limit; T5's relative positions have none."""
    limit = getattr(config, "max_position_embeddings", None)
    for name, size in (("sequence_length", sequence_length), (DECODER_LENGTH, decoder_length)):
        if limit and size > limit:
            raise CompilerArgsError(f"{name}={size} exceeds the {limit} positions {config.model_type} has "
                                    f"position embeddings for; use {name} <= {limit}")


def _kv_cache_choice(model, asked) -> bool:
    """The decoder with a KV cache where kiln can build one (T5), unless ``decoder_kv_cache=False``."""
    supported = graphs_mod.supports_kv_cache(model)
    if asked is None:
        return supported
    if asked and not supported:
        raise CompilerArgsError(f"{KV_CACHE}=True: kiln builds the cached decoder step for T5 "
                                f"({', '.join(graphs_mod.CACHED_MODEL_TYPES)}), not {model.config.model_type}; "
                                f"export without it (the decoder then reruns its prefix each step)")
    return bool(asked)


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


def _rows_of(kwargs, n: int, start: int, rows: int) -> dict:
    """A chunk's keywords: every per-row input (a forced ``decoder_input_ids`` prefix, its mask, ...) cut to
    the chunk's rows; the rest as given."""
    return {k: v[start:start + rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
            for k, v in kwargs.items()}


def _prefix_length(kwargs) -> int:
    given = kwargs.get("decoder_input_ids")
    return 1 if given is None else int(torch.as_tensor(given).shape[-1])
