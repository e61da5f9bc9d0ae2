"""Optimum Neuron's ``pipeline``: transformers' own pipeline around a kiln model, which it takes
as it takes a PyTorch model (a kiln model can also be passed to ``transformers.pipeline``
directly). Exports a checkpoint first with ``export=True``, at ``input_shapes`` (default
batch 1, 128 tokens, with a logged warning, as Optimum does)."""
from __future__ import annotations

import contextlib
import logging
import os

from kiln.optimum.neuron import modeling

log = logging.getLogger("kiln.optimum")

TASKS = {
    "feature-extraction": modeling.NeuronModelForFeatureExtraction,
    "fill-mask": modeling.NeuronModelForMaskedLM,
    "question-answering": modeling.NeuronModelForQuestionAnswering,
    "text-classification": modeling.NeuronModelForSequenceClassification,
    "sentiment-analysis": modeling.NeuronModelForSequenceClassification,
    "token-classification": modeling.NeuronModelForTokenClassification,
    "ner": modeling.NeuronModelForTokenClassification,
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
        raise ValueError(f"the installed transformers {transformers.__version__} has no {task!r} pipeline (transformers "
                         f"5 removed question-answering's); call the {cls.__name__} model directly")
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
    if tokenizer is None:
        tokenizer = next(iter(model.preprocessors), None)
    if tokenizer is None and source is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    if model.static["batch_size"] > 1 and getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    with quiet_model_check():
        return transformers.pipeline(task, model=model, tokenizer=tokenizer, batch_size=model.static["batch_size"],
                                     **kwargs)


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
    return os.path.exists(os.path.join(path, modeling.MODEL_FILE))
