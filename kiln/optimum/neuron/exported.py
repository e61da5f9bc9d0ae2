"""Which kiln.optimum class a saved directory belongs to, for the messages that name it when
another class loads it, the directory a ``from_pretrained`` call names, and the export-time
check of the positions a model can embed.
"""
from __future__ import annotations

import json
import os

import torch

from kiln.errors import CompilerArgsError

# from_pretrained's Hub keywords: nothing is downloaded, so they mean nothing here, except
# ``subfolder``, which names the directory inside ``model_id`` (as transformers reads it)
HUB_KEYWORDS = ("token", "revision", "force_download", "cache_dir", "subfolder", "trust_remote_code")


def local_directory(model_id, kwargs: dict) -> str:
    """The directory ``from_pretrained(model_id, ..., **kwargs)`` reads: ``model_id``, or
    ``model_id/subfolder``; the Hub keywords are taken out of ``kwargs``. Until 12-03 a
    ``subfolder`` was dropped, so a checkpoint in ``model_id`` itself was exported in its place."""
    path = os.fspath(model_id)
    subfolder = kwargs.get("subfolder") or ""
    for name in HUB_KEYWORDS:
        kwargs.pop(name, None)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory; kiln.optimum loads local checkpoint directories "
                                "only (nothing is downloaded)")
    if subfolder:
        inner = os.path.join(path, os.fspath(subfolder))
        if not os.path.isdir(inner):
            raise FileNotFoundError(f"{path} has no subfolder {os.fspath(subfolder)!r} ({inner} is not a directory)")
        path = inner
    return path


def exported_task(path) -> str | None:
    """The task of a directory kiln.optimum saved (its config.json's kiln ``neuron`` section), else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            neuron = json.load(f).get("neuron")
    except (OSError, ValueError):
        return None
    return neuron.get("task") if isinstance(neuron, dict) and neuron.get("compiler_type") == "kiln" else None


CLASS_OF_TASK = {"feature-extraction": "NeuronModelForFeatureExtraction",
                 "text-classification": "NeuronModelForSequenceClassification",
                 "token-classification": "NeuronModelForTokenClassification",
                 "question-answering": "NeuronModelForQuestionAnswering", "fill-mask": "NeuronModelForMaskedLM",
                 "multiple-choice": "NeuronModelForMultipleChoice",
                 "image-classification": "NeuronModelForImageClassification",
                 "audio-classification": "NeuronModelForAudioClassification",
                 "automatic-speech-recognition": "NeuronModelForCTC",
                 "text2text-generation": "NeuronModelForSeq2SeqLM", "text-generation": "NeuronModelForCausalLM"}


def exported_class(path) -> str | None:
    """The kiln.optimum class a directory was exported with (its ``neuron`` section's task, or
    a causal LM's ``neuron_config.json``), else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            neuron = json.load(f).get("neuron")
    except (OSError, ValueError, AttributeError):
        neuron = None
    if isinstance(neuron, dict) and neuron.get("compiler_type") == "kiln":
        if neuron.get("library_name") == "sentence_transformers":
            return "NeuronSentenceTransformers"
        return CLASS_OF_TASK.get(neuron.get("task"))
    try:
        with open(os.path.join(path, "neuron_config.json")) as f:
            causal = json.load(f)
    except (OSError, ValueError):
        return None
    return "NeuronModelForCausalLM" if isinstance(causal, dict) and causal.get("compiler") == "kiln" else None


def wrong_class(path, exported: str | None, asked: str) -> str:
    """The message for a directory loaded with another class than the one it was exported as."""
    task = exported_task(path) or {v: k for k, v in CLASS_OF_TASK.items()}.get(exported)
    if not exported:
        return f"{path} was exported for task {task!r}; load it with that task's class, not {asked}"
    return (f"{path} was exported for task {task!r}, by kiln as {exported}, not {asked}: load it with "
            f"{exported}.from_pretrained")


def check_positions(model, config, length: int) -> None:
    """Refuse a ``sequence_length`` past the positions a model can embed when they start after
    ``padding_idx + 1`` (RoBERTa, XLM-R, CamemBERT, Longformer...: 514 position embeddings hold
    512 tokens), found as sentence-transformers finds the offset: a module with an int
    ``padding_idx`` beside a learned ``position_embeddings`` table."""
    for module in model.modules():
        padding_idx = getattr(module, "padding_idx", None)
        table = getattr(module, "position_embeddings", None)
        if isinstance(padding_idx, int) and isinstance(table, torch.nn.Embedding):
            usable = table.num_embeddings - padding_idx - 1
            if length > usable:
                raise CompilerArgsError(
                    f"sequence_length={length} exceeds the {usable} tokens {config.model_type} has position "
                    f"embeddings for ({table.num_embeddings} positions, numbered from padding_idx + 1 = "
                    f"{padding_idx + 1}); use sequence_length <= {usable}")
            return
