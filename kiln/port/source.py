"""What ``kiln port MODEL`` names, loaded: a model and the example call it is ported at.

Three spellings: a factory ``package.module:function`` returning ``(model, example_inputs)``
(the one every ``kiln`` command takes); a ``.py`` file (``file.py:function`` names the
factory, else the file defines one of ``FACTORIES`` or module-level ``model`` and
``example_inputs``); a Hugging Face checkpoint directory, loaded with its architecture's
auto class at static shapes (batch 1, 128 tokens by default), as ``kiln export`` would.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.factory import check_no_arguments, load_factory

FACTORIES = ("make_model", "get_model", "model_and_inputs", "factory")


@dataclass
class Subject:
    """The model to port and how it is called."""
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    name: str
    source: str
    kind: str                         # "factory" | "file" | "huggingface"
    task: str | None = None
    architecture: str | None = None
    hazards: list = field(default_factory=list)   # shape facts the source already knows

    def call(self, args=None, kwargs=None):
        return self.model(*(self.args if args is None else args), **(self.kwargs if kwargs is None else kwargs))


def resolve(spec: str, batch_size: int | None = None, sequence_length: int | None = None) -> Subject:
    """Load ``spec`` (see the module docstring); a clear error for anything else."""
    path, _, attr = spec.partition(":") if not os.path.isdir(spec) else (spec, "", "")
    if os.path.isdir(path):
        return _huggingface(path, batch_size, sequence_length)
    if path.endswith(".py"):
        if not os.path.exists(path):
            raise KilnError(f"{path}: no such file")
        made = _from_file(path, attr)
        return _subject(made, spec, "file")
    if attr:
        return _subject(load_factory(spec, None), spec, "factory")
    raise KilnError(f"cannot port {spec!r}: give a factory package.module:function, a .py file "
                    "(file.py or file.py:function) or a Hugging Face checkpoint directory")


def _subject(made, spec, kind) -> Subject:
    if not (isinstance(made, tuple) and len(made) == 2):
        raise KilnError(f"{spec} must give (model, example_inputs)")
    model, example = made
    if not isinstance(model, torch.nn.Module):
        raise KilnError(f"{spec} gave a {type(model).__name__}, not a torch.nn.Module")
    if isinstance(example, dict):
        args, kwargs = (), dict(example)
    elif isinstance(example, (tuple, list)):
        args, kwargs = tuple(example), {}
    else:
        args, kwargs = (example,), {}
    return Subject(model.eval(), args, kwargs, type(model).__name__, spec, kind)


def _from_file(path: str, attr: str):
    name = "kiln_port_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # a script run at import: kiln port said nothing and exited (until 12-03)
        raise KilnError(f"{path} exited while being imported (SystemExit({e.code!r})): kiln port imports the "
                        "file to find its model; put the script's own run under if __name__ == '__main__':") from None
    except Exception as e:   # the user's file: any error in it is theirs to see, with its type
        raise KilnError(f"{path} failed to import: {type(e).__name__}: {e}") from e
    if attr:
        if not callable(getattr(module, attr, None)):
            raise KilnError(f"{path} has no function {attr!r}")
        check_no_arguments(getattr(module, attr), f"{path}:{attr}")
        return getattr(module, attr)()
    for candidate in FACTORIES:
        if callable(getattr(module, candidate, None)):
            check_no_arguments(getattr(module, candidate), f"{path}:{candidate}")    # a TypeError until 12-03
            return getattr(module, candidate)()
    if hasattr(module, "model") and hasattr(module, "example_inputs"):
        return module.model, module.example_inputs
    raise KilnError(f"{path} defines none of {', '.join(FACTORIES)} and no module-level model and "
                    "example_inputs; name the factory: kiln port file.py:function")


def _huggingface(path: str, batch_size, sequence_length) -> Subject:
    try:
        import transformers
    except ImportError:
        raise KilnError("porting a Hugging Face directory needs transformers: pip install transformers") from None
    from kiln.optimum.neuron import exporter
    try:
        task = exporter.infer_task(path)
    except KilnError as e:      # kiln export's advice ("pass --task") names a flag kiln port lacks
        said = str(e).split("; pass --task")[0]
        if said == str(e):
            raise
        raise KilnError(f"{said}; kiln port takes the task from config.json's architectures (e.g. "
                        "BertForMaskedLM): name one there, or port a factory (kiln port file.py:function)") from None
    with open(os.path.join(path, "config.json")) as f:
        arch = (json.load(f).get("architectures") or ["?"])[0]
    shapes = {"batch_size": batch_size or 1, "sequence_length": sequence_length or 128}
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit and shapes["sequence_length"] > limit and sequence_length is None:
        shapes["sequence_length"] = limit
    if task == "text-generation":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
        ids = torch.randint(1, max(int(config.vocab_size), 2), (shapes["batch_size"], shapes["sequence_length"]),
                            generator=torch.Generator().manual_seed(0))
        example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        model.config.use_cache = False
    else:
        cls = exporter.CLASSES[task]
        if task == "sentence-similarity":
            cls = exporter.CLASSES["feature-extraction"]
        model = getattr(transformers, cls.auto_class).from_pretrained(path, local_files_only=True).eval()
        example = cls._example(model, config, {**_media_shapes(config), **shapes})
    subject = _subject((model, example), path, "huggingface")
    subject.task, subject.architecture, subject.name = task, arch, arch
    if "input_ids" in example:
        subject.hazards.append(_sequence_hazard(shapes, limit, list(example)))
    return subject


def _media_shapes(config) -> dict:
    out = {}
    for key in ("num_channels", "image_size"):
        if getattr(config, key, None):
            out[key if key != "image_size" else "height"] = getattr(config, key)
    if "height" in out:
        out["width"] = out["height"]
    out["audio_sequence_length"] = 16000
    return out


def _sequence_hazard(shapes, limit, names) -> dict:
    seq = shapes["sequence_length"]
    sizes = sorted({s for s in (16, 32, 64, 128, 256, 512, 1024) if s <= seq} | {seq})
    buckets = ", ".join(f"'{n}': {{1: {sizes}}}" for n in names)
    return {"what": f"text inputs are compiled at sequence_length {seq}, batch {shapes['batch_size']}: "
                    "other lengths are padded to it (kiln.optimum) or need buckets",
            "fix": f"kiln.trace(model, example, buckets={{{buckets}}}) or kiln export --sequence_length N"
                   + (f" (at most {limit} positions)" if limit else "")}
