"""Optimum Neuron's ``pipeline``: transformers' own pipeline around a kiln model, which it takes
as it takes a PyTorch model (a kiln model can also be passed to ``transformers.pipeline``
directly). Exports a checkpoint first with ``export=True``, at ``input_shapes`` (default
batch 1, 128 tokens, with a logged warning, as Optimum does)."""
from __future__ import annotations

import contextlib
import copy
import logging
import os

from kiln.optimum.neuron import causal, media, modeling, seq2seq

log = logging.getLogger("kiln.optimum")

TASKS = {
    "feature-extraction": modeling.NeuronModelForFeatureExtraction,
    "fill-mask": modeling.NeuronModelForMaskedLM,
    "question-answering": modeling.NeuronModelForQuestionAnswering,
    "text-classification": modeling.NeuronModelForSequenceClassification,
    "sentiment-analysis": modeling.NeuronModelForSequenceClassification,
    "token-classification": modeling.NeuronModelForTokenClassification,
    "ner": modeling.NeuronModelForTokenClassification,
    "text-generation": causal.NeuronModelForCausalLM,
    "image-classification": media.NeuronModelForImageClassification,
    "audio-classification": media.NeuronModelForAudioClassification,
    "automatic-speech-recognition": media.NeuronModelForCTC,
    # transformers 5 has none of these three pipelines: asking is a clear error naming generate()
    "text2text-generation": seq2seq.NeuronModelForSeq2SeqLM,
    "summarization": seq2seq.NeuronModelForSeq2SeqLM,
    "translation": seq2seq.NeuronModelForSeq2SeqLM,
}
DEFAULT_SHAPES = {"batch_size": 1, "sequence_length": 128}


def pipeline(task, model=None, tokenizer=None, feature_extractor=None, image_processor=None, use_fast=True,
             export=False, input_shapes=None, compiler_args=None, token=None, revision=None,
             trust_remote_code=None, **kwargs):
    """``transformers.pipeline(task, ...)`` on a kiln model: ``model`` a kiln model, or a local
    directory (exported with ``export=True``, else one kiln.optimum saved)."""
    import transformers
    cls = TASKS.get(task)
    if cls is None:
        raise ValueError(f"task {task!r} is not supported by kiln.optimum.neuron.pipeline; supported: "
                         f"{', '.join(sorted(TASKS))}")
    from transformers.pipelines import SUPPORTED_TASKS, TASK_ALIASES
    if TASK_ALIASES.get(task, task) not in SUPPORTED_TASKS:
        call = f"{cls.__name__}.generate()" if hasattr(cls, "generate") else f"the {cls.__name__} model"
        raise ValueError(f"task {task!r} is not supported by kiln.optimum.neuron.pipeline with the installed "
                         f"transformers {transformers.__version__}: it has no {task!r} pipeline (transformers 5 "
                         f"removed it); call {call} directly")
    if model is None:
        raise ValueError("pass model= (a local checkpoint directory or a kiln model): nothing is downloaded")
    source = None
    if isinstance(model, (str, os.PathLike)):
        source = os.fspath(model)
        exported = _is_exported(source)
        if export and exported:
            raise ValueError(f"{source}: This model has already been exported to Neuron format; load it "
                             "with export=False")
        if not export and not exported:
            raise ValueError(f"{source}: The model must be exported to Neuron format first: pass export=True")
        if export:
            if not input_shapes:
                log.warning("kiln.optimum: no input_shapes given; exporting at %s", DEFAULT_SHAPES)
            model = cls.from_pretrained(source, export=True, **(compiler_args or {}),
                                        **(input_shapes or DEFAULT_SHAPES))
        else:
            model = cls.from_pretrained(source)
    elif export:
        raise ValueError("This model has already been exported to Neuron format: pass export=False")
    parts = {"tokenizer": tokenizer, "feature_extractor": feature_extractor, "image_processor": image_processor}
    for p in model.preprocessors:
        kind = _kind(p, transformers)
        if kind and parts[kind] is None:
            parts[kind] = p
    if parts["tokenizer"] is None and source is not None and cls.main_input_name == "input_ids":
        parts["tokenizer"] = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    tok = parts["tokenizer"]
    if tok is not None and model.static["batch_size"] > 1 and getattr(tok, "pad_token_id", None) is None:
        tok.pad_token_id = tok.eos_token_id
    length = model.static.get("sequence_length")
    if tok is not None and length and cls is not causal.NeuronModelForCausalLM \
            and (tok.model_max_length or length + 1) > length:
        parts["tokenizer"] = tok = copy.copy(tok)       # truncation=True cuts at the compiled length, not 512
        tok.model_max_length = length
    if task == "feature-extraction" and "pipeline_class" not in kwargs:
        kwargs["pipeline_class"] = _feature_extraction()
    batch_size = _batch_size(model, kwargs.pop("batch_size", None))
    with quiet_model_check():
        return transformers.pipeline(task, model=model, batch_size=batch_size,
                                     **{k: v for k, v in parts.items() if v is not None}, **kwargs)


def _batch_size(model, asked) -> int:
    """The pipeline's batch: the compiled one (as Optimum passes it), or the caller's
    ``batch_size`` where the model takes batches of that size (any up to the compiled one; a
    larger one with ``dynamic_batch_size=True``, run in chunks, and always for an LLM, whose
    ``generate`` does that itself). Until 12-03 a caller's ``batch_size`` was passed on beside
    the compiled one: a TypeError from transformers."""
    static = model.static["batch_size"]
    if asked is None:
        return static
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise ValueError(f"batch_size={asked!r}: give a positive integer (the model was compiled for batches "
                         f"of {static})")
    if asked > static and not isinstance(model, causal.NeuronModelForCausalLM) \
            and not getattr(model, "neuron", {}).get("dynamic_batch_size"):
        raise ValueError(f"batch_size={asked}: the model was exported for batches of at most {static}; pass "
                         f"batch_size <= {static}, or export with a larger batch_size or dynamic_batch_size=True")
    return asked


def _feature_extraction():
    """transformers' feature-extraction pipeline, each text's vectors cut back to its own tokens:
    run in batches (of the compiled batch size) a text's vectors would otherwise include the
    positions padded to the batch's longest text, which transformers' pipeline (one text at a
    time by default) does not return."""
    import torch
    from transformers.pipelines.feature_extraction import FeatureExtractionPipeline

    class KilnFeatureExtractionPipeline(FeatureExtractionPipeline):
        def preprocess(self, inputs, **tokenize_kwargs):
            model_inputs = super().preprocess(inputs, **tokenize_kwargs)
            model_inputs["kiln_tokens"] = torch.tensor([model_inputs["input_ids"].shape[-1]])
            return model_inputs

        def _forward(self, model_inputs):
            tokens = model_inputs.pop("kiln_tokens")
            return {"features": self.model(**model_inputs)[0], "kiln_tokens": tokens}

        def postprocess(self, model_outputs, return_tensors=False):
            n, features = int(model_outputs["kiln_tokens"].reshape(-1)[0]), model_outputs["features"]
            features = features[:, -n:] if self.tokenizer.padding_side == "left" else features[:, :n]
            return features if return_tensors else features.tolist()

    return KilnFeatureExtractionPipeline


def _kind(preprocessor, transformers) -> str | None:
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.image_processing_base import ImageProcessingMixin
    if isinstance(preprocessor, transformers.PreTrainedTokenizerBase):
        return "tokenizer"
    if isinstance(preprocessor, ImageProcessingMixin):
        return "image_processor"
    if isinstance(preprocessor, FeatureExtractionMixin):
        return "feature_extractor"
    return None


@contextlib.contextmanager
def quiet_model_check():
    """transformers logs an error for a model class it does not know (``check_model_type``),
    then runs it: a kiln model is such a class, and nothing is wrong."""
    logger = logging.getLogger("transformers.pipelines.base")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _is_exported(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, *part, modeling.MODEL_FILE)) for part in ((), ("encoder",)))
