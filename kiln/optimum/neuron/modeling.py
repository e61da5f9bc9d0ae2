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
from kiln.errors import ArtifactError, CompilerArgsError
from kiln.optimum.neuron import options as neuron_options
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
    """What transformers asks of any model it is handed: ``eval()``, and ``to(device)``,
    which must refuse a device the compiled graphs do not run on."""

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
        path = os.fspath(model_id)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: not a directory; kiln.optimum loads local checkpoint directories "
                                    "only (nothing is downloaded)")
        if export:
            return cls._export(path, config, **kwargs)
        for loading in ("token", "revision", "force_download", "cache_dir", "subfolder", "trust_remote_code"):
            kwargs.pop(loading, None)
        if kwargs:
            raise CompilerArgsError(f"{', '.join(sorted(kwargs))} only apply with export=True; this loads an "
                                    "already exported model")
        return cls._load(path, file_name or MODEL_FILE)

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        tf = require_transformers()
        for loading in ("token", "revision", "force_download", "cache_dir", "subfolder", "trust_remote_code"):
            kwargs.pop(loading, None)
        opts = neuron_options.parse(cls.task, cls.shapes, kwargs)
        config = config or tf.AutoConfig.from_pretrained(path, local_files_only=True)
        if "neuron" in config.to_dict():
            raise CompilerArgsError(f"{path} is already an exported model: load it without export=True")
        limit = getattr(config, "max_position_embeddings", None)
        if limit and opts.shapes.get("sequence_length", 0) > limit:
            raise CompilerArgsError(f"sequence_length={opts.shapes['sequence_length']} exceeds the {limit} positions "
                                    f"{config.model_type} has position embeddings for; use sequence_length <= {limit}")
        model = getattr(tf, cls.auto_class).from_pretrained(path, config=config, local_files_only=True).eval()
        example = cls._example(model, config, opts.shapes)
        with torch.no_grad():
            eager = model(**example, return_dict=True)
        outputs = [k for k in cls.output_names if eager.get(k) is not None]
        compiled = trace(_Traced(model, example, outputs).eval(), tuple(example.values()),
                         name=f"{type(model).__name__} ({cls.task})", **opts.trace)
        neuron = dict(opts.neuron, input_names=list(example), output_names=outputs,
                      model_type=config.model_type)
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
                raise ArtifactError(f"{path} was exported for task {task!r}; load it with that task's class, "
                                    f"not {cls.__name__} ({cls.task!r})")
            raise FileNotFoundError(f"{model_path} does not exist: {path} holds no model kiln exported; pass "
                                    "export=True to compile a Hugging Face checkpoint")
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        neuron = getattr(config, "neuron", None)
        if not isinstance(neuron, dict) or neuron.get("compiler_type") != "kiln":
            raise ArtifactError(f"{path}/config.json has no kiln 'neuron' section (compiler_type 'kiln'): it was "
                                "not saved by kiln.optimum; export it with export=True")
        if neuron.get("task") != cls.task:
            raise ArtifactError(f"{path} was exported for task {neuron.get('task')!r}; load it with that "
                                f"task's class, not {cls.__name__} ({cls.task!r})")
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
        given.pop("return_dict", None)
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
        return _output(self.output_class, dict(zip(self.output_names, outs)))

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
        batch, static_batch = inputs[self.main_input_name].shape[0], self.static["batch_size"]
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
        pad_id = getattr(self.config, "pad_token_id", None) or 0
        padded = []
        for n in self.input_names:
            v = inputs[n]
            fill = pad_id if n == "input_ids" else 0
            v = torch.nn.functional.pad(v, (0, want - length), value=fill)
            if batch < self.static["batch_size"]:
                v = torch.cat([v, v[:1].expand(self.static["batch_size"] - batch, *v.shape[1:])])
            padded.append(v.contiguous())
        outs = self.model(*padded)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return [self._trim(name, o, batch, length, seq_axis) for name, o in zip(self.output_names, outs)]

    def _trim(self, name, out, batch, length, seq_axis):
        out = out[:batch]
        if name in PER_TOKEN or (name == "logits" and self.task in ("token-classification", "fill-mask")):
            out = out.narrow(seq_axis, 0, length)
        return out

    # -- what transformers' pipelines ask of a model --------------------------------------

    def can_generate(self) -> bool:
        return False


def _output(class_name: str, values: dict):
    from transformers import modeling_outputs
    return getattr(modeling_outputs, class_name)(**values)


def exported_task(path) -> str | None:
    """The task of a directory kiln.optimum saved (its config.json's kiln ``neuron`` section), else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            neuron = json.load(f).get("neuron")
    except (OSError, ValueError):
        return None
    return neuron.get("task") if isinstance(neuron, dict) and neuron.get("compiler_type") == "kiln" else None


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
