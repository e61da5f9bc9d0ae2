"""Optimum Neuron's traced-model classes on kiln: ``from_pretrained(path, export=True,
**input_shapes, **compiler_args)`` compiles a Hugging Face checkpoint directory with
``kiln.trace`` at static shapes; ``save_pretrained`` writes ``model.kiln``, ``config.json``
with Optimum's ``neuron`` section and the preprocessors; ``from_pretrained(dir)`` loads that
back without the model's code and without recompiling.

As on Neuron, inputs are padded on the right to the compiled shapes and the outputs trimmed
back: the sequence with the pad token and a zero attention mask (masked keys get exactly zero
weight), the batch with copies of the first row (a row of padding only would attend to
nothing). A batch or sequence larger than compiled is a ``ValueError``, unless
``dynamic_batch_size=True``, which runs a larger batch in chunks of the compiled size.
"""
from __future__ import annotations

import inspect
import json
import logging
import os

import torch

from kiln.atomic import write_atomic
from kiln.compiler.api import trace
from kiln.errors import ArtifactError, CompilerArgsError, InputError
from kiln.optimum.neuron import options as neuron_options
from kiln.optimum.neuron.exported import (check_positions, exported_class, exported_task,
                                          local_directory, wrong_class)
from kiln.runtime.loader import load

log = logging.getLogger("kiln.optimum")
MODEL_FILE = "model.kiln"
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# per-token outputs are trimmed back along the sequence, the rest only along the batch
PER_TOKEN = {"last_hidden_state", "start_logits", "end_logits", "token_embeddings"}


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise CompilerArgsError("kiln.optimum needs transformers: pip install transformers") from None
    return transformers


class _Traced(torch.nn.Module):
    """The Hugging Face model as kiln traces it: positional inputs, a tuple of named outputs."""

    def __init__(self, model, inputs, outputs):
        super().__init__()
        self.model, self.inputs, self.outputs = model, tuple(inputs), tuple(outputs)

    def forward(self, *args):
        out = self.model(**dict(zip(self.inputs, args)), return_dict=True)
        return tuple(out[k] for k in self.outputs)


class CpuModel:
    """What transformers asks of any model it is handed: ``eval()``, ``to(device)``, which
    must refuse a device the compiled graphs do not run on, and what a pipeline's ``repr``
    reads (``input_modalities``; ``output_modalities`` of a model that generates)."""

    input_modalities = "text"
    output_modalities = "text"

    def eval(self):
        return self

    def to(self, device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"this model was compiled for the CPU; it cannot move to {device}")
        return self


class NeuronTracedModel(CpuModel):
    """One compiled task model. Subclasses set the task, the transformers auto class, the
    output names and the output class."""

    task = ""
    auto_class = "AutoModel"
    output_names: tuple = ()
    output_class = "BaseModelOutput"
    shapes = ("batch_size", "sequence_length")
    main_input_name = "input_ids"
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, compiled, config, neuron: dict, preprocessors=None):
        self.model = compiled
        self.config = config
        self.neuron = dict(neuron)
        self.preprocessors = list(preprocessors or [])
        self.input_names = tuple(neuron["input_names"])
        self.output_names = tuple(neuron["output_names"])
        self.static = neuron_options.static_shapes(neuron)

    # -- export and load -----------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_id, export: bool = False, config=None, file_name=None,
                        local_files_only: bool = True, **kwargs):
        """``model_id``: a local directory (a Hugging Face checkpoint with ``export=True``,
        else one this class saved). Nothing is downloaded."""
        path = local_directory(model_id, kwargs)
        if export:
            return cls._export(path, config, **kwargs)
        if kwargs:
            raise CompilerArgsError(f"{', '.join(sorted(kwargs))} only apply with export=True; this loads an "
                                    "already exported model")
        return cls._load(path, file_name or MODEL_FILE)

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        tf = require_transformers()
        opts = neuron_options.parse(cls.task, cls.shapes, kwargs)
        config = config or tf.AutoConfig.from_pretrained(path, local_files_only=True)
        if "neuron" in config.to_dict():
            raise CompilerArgsError(f"{path} is already an exported model: load it without export=True")
        limit = getattr(config, "max_position_embeddings", None)
        if limit and opts.shapes.get("sequence_length", 0) > limit:
            raise CompilerArgsError(f"sequence_length={opts.shapes['sequence_length']} exceeds the {limit} positions "
                                    f"{config.model_type} has position embeddings for; use sequence_length <= {limit}")
        try:
            model, info = getattr(tf, cls.auto_class).from_pretrained(path, config=config, local_files_only=True,
                                                                      output_loading_info=True)
        except RuntimeError as e:       # transformers' "size mismatch for classifier.weight ..."
            if "size mismatch" not in str(e) and "ignore_mismatched_sizes" not in str(e):
                raise
            raise CompilerArgsError(f"{path} does not fit {cls.__name__} (task {cls.task}): its weights have "
                                    "other shapes than such a model's (e.g. a classifier head with another number "
                                    "of labels); export it with the class of the task it was trained for") from None
        model.eval()
        check_positions(model, config, opts.shapes.get("sequence_length", 0))
        if info.get("missing_keys"):
            log.warning("kiln.optimum: %s has no weights for %s of %s, so transformers initialised them at "
                        "random and the exported model's %s answers are random too: is the task right, and "
                        "is this checkpoint trained for it?", path, ", ".join(sorted(info["missing_keys"])[:4]),
                        type(model).__name__, cls.task)
        example = cls._example(model, config, opts.shapes)
        with torch.no_grad():
            eager = model(**example, return_dict=True)
        example = _inert_defaults_only(model, example, eager)
        outputs = [k for k in cls.output_names if eager.get(k) is not None]
        traced = _Traced(model, example, outputs).eval()
        padding = _padding_effect(cls, traced, example, getattr(config, "pad_token_id", None))
        if padding:
            log.warning("kiln.optimum: %s answers differently when its input is padded to sequence_length=%d "
                        "(by up to %.3g: e.g. a classifier that reads the last position and has no "
                        "pad_token_id); this export takes inputs of exactly that length", type(model).__name__,
                        opts.shapes["sequence_length"], padding)
        compiled = trace(traced, tuple(example.values()), name=f"{type(model).__name__} ({cls.task})", **opts.trace)
        neuron = dict(opts.neuron, input_names=list(example), output_names=outputs,
                      model_type=config.model_type)
        if padding:
            neuron["padding_changes_answers"] = padding
        model = cls(compiled, config, neuron, preprocessors_of(path))
        if model.cache_hit:
            log.info("kiln.optimum: %s came from the compile cache (%s): nothing was recompiled", path,
                     compiled.manifest["cache"].get("url"))
        return model

    @property
    def cache_hit(self) -> bool:
        """Whether exporting took the compiled model from kiln's compile cache."""
        return bool(self.model.manifest.get("cache", {}).get("hit"))

    @classmethod
    def _example(cls, model, config, shapes) -> dict:
        """Inputs of the static shapes, in the order the model's forward takes them."""
        params = inspect.signature(model.forward).parameters
        names = [n for n in TEXT_INPUTS if n in params]
        dims = cls._dims(shapes)
        vocab = max(int(getattr(config, "vocab_size", 2) or 2), 2)
        out = {}
        for n in names:
            if n == "input_ids":
                out[n] = torch.randint(1, vocab, dims, generator=torch.Generator().manual_seed(0))
            elif n == "attention_mask":
                out[n] = torch.ones(dims, dtype=torch.int64)
            else:
                out[n] = torch.zeros(dims, dtype=torch.int64)
        return out

    @staticmethod
    def _dims(shapes) -> tuple:
        return shapes["batch_size"], shapes["sequence_length"]

    @classmethod
    def _load(cls, path, file_name):
        tf = require_transformers()
        model_path = os.path.join(path, file_name)
        if not os.path.exists(model_path):
            task = exported_task(path)
            if task not in (None, cls.task):      # e.g. an encoder-decoder's encoder/ and decoder/ graphs
                raise ArtifactError(wrong_class(path, exported_class(path), cls.__name__))
            raise FileNotFoundError(f"{model_path} does not exist: {path} holds no model kiln exported; pass "
                                    "export=True to compile a Hugging Face checkpoint")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        neuron = getattr(config, "neuron", None)
        exported = exported_class(path)
        if not isinstance(neuron, dict) or neuron.get("compiler_type") != "kiln":
            if exported:
                raise ArtifactError(wrong_class(path, exported, cls.__name__))
            raise ArtifactError(f"{path}/config.json has no kiln 'neuron' section (compiler_type 'kiln'): it was "
                                "not saved by kiln.optimum; export it with export=True")
        if neuron.get("task") != cls.task:
            raise ArtifactError(wrong_class(path, exported, cls.__name__))
        return cls(load(model_path), config, neuron, preprocessors_of(path))

    def save_pretrained(self, save_directory) -> None:
        """``model.kiln``, ``config.json`` (the model's config with the ``neuron`` section) and
        the preprocessors it was loaded with; each file written atomically."""
        os.makedirs(save_directory, exist_ok=True)
        self.model.save(os.path.join(save_directory, MODEL_FILE))
        config = self.config.to_dict()
        config["neuron"] = self.neuron
        text = json.dumps(config, indent=2, sort_keys=True).encode()
        write_atomic(os.path.join(save_directory, "config.json"), lambda f: f.write(text))
        for p in self.preprocessors:
            p.save_pretrained(save_directory)

    # -- run ------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        given = dict(zip(self.input_names, args))
        given.update(kwargs)
        return_dict = given.pop("return_dict", None)
        for flag in ("output_attentions", "output_hidden_states"):
            if given.pop(flag, None):
                raise ValueError(f"{flag}=True: this model was exported without those outputs")
        given = self._accept({k: v for k, v in given.items() if v is not None})
        unknown = [k for k in given if k not in self.input_names]
        if unknown:
            raise ValueError(f"{type(self).__name__} was exported with inputs {list(self.input_names)}; got "
                             f"{', '.join(unknown)} too")
        if self.main_input_name not in given:
            raise ValueError(f"{self.main_input_name} is required")
        outs = self._run(self._inputs(given))
        out = _output(self.output_class, dict(zip(self.output_names, outs)))
        return out.to_tuple() if return_dict is False else out

    def _accept(self, given: dict) -> dict:
        """The inputs a caller gave, less those this model may drop (none for text models)."""
        return given

    def _inputs(self, given: dict) -> dict:
        """Every exported input: a text model's mask defaults to ones, its token types to zeros."""
        ids = torch.as_tensor(given["input_ids"])
        inputs = {}
        for n in self.input_names:
            v = given.get(n)
            if v is None:
                v = torch.ones_like(ids) if n == "attention_mask" else torch.zeros_like(ids)
            inputs[n] = torch.as_tensor(v).to(torch.int64)
        return inputs

    def _run(self, inputs: dict) -> list:
        x, dims = inputs[self.main_input_name], self._dims(self.static)
        if x.dim() != len(dims) or x.shape[0] == 0:
            raise ValueError(f"{self.main_input_name} has shape {tuple(x.shape)}; this model takes "
                             f"{len(dims)} dimensions like its compiled {tuple(dims)}, with at least one row"
                             + (" (a single sequence is [1, length]: add .unsqueeze(0))" if x.dim() == len(dims) - 1
                                else ""))
        if 0 in x.shape:
            raise InputError(f"{self.main_input_name} has shape {tuple(x.shape)}: an empty sequence has nothing to "
                             "run the model on (transformers refuses it too); give at least one token")
        batch, static_batch = x.shape[0], self.static["batch_size"]
        if batch <= static_batch:
            return self._run_padded(inputs)
        if not self.neuron.get("dynamic_batch_size"):
            raise ValueError(f"Unable to pad a batch of {batch} to the compiled batch size {static_batch}: "
                             "export with a larger batch_size, or with dynamic_batch_size=True")
        parts = [self._run_padded({k: v[i:i + static_batch] for k, v in inputs.items()})
                 for i in range(0, batch, static_batch)]
        return [torch.cat(p) for p in zip(*parts)]

    def _run_padded(self, inputs: dict) -> list:
        ids = inputs["input_ids"]
        seq_axis = ids.dim() - 1
        length, batch = ids.shape[seq_axis], ids.shape[0]
        want = self.static["sequence_length"]
        if length > want:
            raise ValueError(f"Unable to pad a sequence of {length} tokens to the compiled sequence_length "
                             f"{want}: export with a larger sequence_length, or truncate the input")
        changes = self.neuron.get("padding_changes_answers")
        if changes and length < want:
            raise ValueError(f"this {self.config.model_type} model answers differently when its input is padded "
                             f"(by up to {changes:.3g}, measured at export: e.g. a classifier that reads the last "
                             f"position and has no pad_token_id), so it takes exactly sequence_length={want} "
                             f"tokens; got {length}. Pad the input yourself the way the model expects, or set "
                             "the config's pad_token_id and export again")
        padded = pad_inputs(inputs, self.input_names, self.static["batch_size"], want,
                            getattr(self.config, "pad_token_id", None))
        outs = self.model(*padded)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return [self._trim(name, o, batch, length, seq_axis) for name, o in zip(self.output_names, outs)]

    def _trim(self, name, out, batch, length, seq_axis):
        out = out[:batch]
        return out.narrow(seq_axis, 0, length) if per_token(self.task, name) else out

    # -- what transformers' pipelines ask of a model --------------------------------------

    def can_generate(self) -> bool:
        return False


def pad_inputs(inputs: dict, names, rows: int, length: int, pad_id) -> list:
    """``inputs`` padded to the compiled shapes, in ``names``' order: each sequence on the right
    to ``length`` (the ids with ``pad_id``, or 0 when the model has none; masks and token types
    with 0), the batch to ``rows`` with copies of its first row."""
    out = []
    for n in names:
        v = inputs[n]
        v = torch.nn.functional.pad(v, (0, length - v.shape[-1]), value=(pad_id or 0) if n == "input_ids" else 0)
        if v.shape[0] < rows:
            v = torch.cat([v, v[:1].expand(rows - v.shape[0], *v.shape[1:])])
        out.append(v.contiguous())
    return out


def _inert_defaults_only(model, example: dict, eager) -> dict:
    """``example`` less ``token_type_ids`` when leaving them out is not the same as zeros.

    A compiled graph cannot tell an input left out from one filled with the default, so an
    input is exported only if its default (zeros, as callers leave token types out) gives the
    model's answers without it. GPT-2 embeds token types through its word embeddings: zeros
    add ``wte[0]`` to every position, and its logits moved by 0.08."""
    if "token_type_ids" not in example:
        return example
    without = {k: v for k, v in example.items() if k != "token_type_ids"}
    with torch.no_grad():
        other = model(**without, return_dict=True)
    same = all(torch.allclose(eager[k], other[k], atol=1e-6, rtol=1e-6)
               for k in eager.keys() if isinstance(eager[k], torch.Tensor))
    if not same:
        log.info("kiln.optimum: %s answers differently with token_type_ids of zeros than without them; "
                 "exported without token_type_ids", type(model).__name__)
    return example if same else without


def _padding_effect(cls, traced, example: dict, pad_id) -> float:
    """The largest change padding makes to the model's answers, 0.0 if none (within 1e-4).

    The model runs on a third shorter input as given and padded the way calls are
    (:func:`pad_inputs`), and the outputs are compared on the real positions. Masked keys get
    exactly zero attention, so encoders agree; a classifier that finds its last token by the
    pad id, with no pad id set, reads a padding position instead."""
    if "input_ids" not in example:          # images and audio: padded along the batch only
        return 0.0
    length = example["input_ids"].shape[-1]
    short = length - length // 3
    if short == length:
        return 0.0
    given = {k: v[..., :short] for k, v in example.items()}
    padded = pad_inputs(given, list(example), example["input_ids"].shape[0], length, pad_id)
    with torch.no_grad():
        want, got = traced(*given.values()), traced(*padded)
    worst, seq_axis = 0.0, example["input_ids"].dim() - 1
    for name, w, g in zip(traced.outputs, want, got):
        g = g.narrow(seq_axis, 0, short) if per_token(cls.task, name) else g
        if not torch.allclose(g, w, atol=1e-4, rtol=1e-4):
            worst = max(worst, float((g - w).abs().max()))
    return worst


def per_token(task: str, name: str) -> bool:
    """Whether output ``name`` has a sequence axis, trimmed back to the caller's length."""
    return name in PER_TOKEN or (name == "logits" and task in ("token-classification", "fill-mask"))


def _output(class_name: str, values: dict):
    from transformers import modeling_outputs
    return getattr(modeling_outputs, class_name)(**values)


def preprocessors_of(path) -> list:
    """The tokenizer and image processor or feature extractor saved beside a checkpoint, as
    Optimum keeps what the model loaded (and pipelines take them from the model)."""
    tf = require_transformers()
    out = []
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        try:
            out.append(tf.AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError, TypeError):
            pass
    config = os.path.join(path, "preprocessor_config.json")
    if os.path.exists(config):
        with open(config) as f:
            kind = json.load(f)
        auto = tf.AutoImageProcessor if "image_processor_type" in kind else tf.AutoFeatureExtractor
        try:
            out.append(auto.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError, TypeError):
            pass
    return out


class NeuronModelForFeatureExtraction(NeuronTracedModel):
    task = "feature-extraction"
    auto_class = "AutoModel"
    output_names = ("last_hidden_state", "pooler_output")
    output_class = "BaseModelOutputWithPooling"


class NeuronModelForSequenceClassification(NeuronTracedModel):
    task = "text-classification"
    auto_class = "AutoModelForSequenceClassification"
    output_names = ("logits",)
    output_class = "SequenceClassifierOutput"


class NeuronModelForTokenClassification(NeuronTracedModel):
    task = "token-classification"
    auto_class = "AutoModelForTokenClassification"
    output_names = ("logits",)
    output_class = "TokenClassifierOutput"


class NeuronModelForQuestionAnswering(NeuronTracedModel):
    task = "question-answering"
    auto_class = "AutoModelForQuestionAnswering"
    output_names = ("start_logits", "end_logits")
    output_class = "QuestionAnsweringModelOutput"


class NeuronModelForMaskedLM(NeuronTracedModel):
    task = "fill-mask"
    auto_class = "AutoModelForMaskedLM"
    output_names = ("logits",)
    output_class = "MaskedLMOutput"


class NeuronModelForMultipleChoice(NeuronTracedModel):
    task = "multiple-choice"
    auto_class = "AutoModelForMultipleChoice"
    output_names = ("logits",)
    output_class = "MultipleChoiceModelOutput"
    shapes = ("batch_size", "num_choices", "sequence_length")

    @staticmethod
    def _dims(shapes) -> tuple:
        return shapes["batch_size"], shapes["num_choices"], shapes["sequence_length"]

    def _run_padded(self, inputs: dict) -> list:
        choices = inputs["input_ids"].shape[1]
        if choices != self.static["num_choices"]:
            raise ValueError(f"this model was exported for num_choices={self.static['num_choices']}; got "
                             f"{choices} choices")
        return super()._run_padded(inputs)

    def _trim(self, name, out, batch, length, seq_axis):
        return out[:batch]
