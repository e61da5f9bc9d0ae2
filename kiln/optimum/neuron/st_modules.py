"""A sentence-transformers directory read as sentence-transformers reads it, for
``NeuronSentenceTransformers``: where the ``Transformer`` module lives, the modules after it
(``Pooling``, ``Dense``, ``Normalize``; any other is an error naming it, never dropped), the
length texts are cut at, ``do_lower_case``, and ``config_sentence_transformers.json``'s prompts
and similarity function.

The modules after the encoder run on the host in torch, on the trimmed token embeddings, in
``modules.json``'s order: pooling as :mod:`kiln.runtime.pooling`, a ``Dense`` as
sentence-transformers' (``activation(linear(x))``, plus its residual when ``use_residual``),
``Normalize`` as ``F.normalize(p=2, dim=-1)``. The ``Dense`` weights are saved beside
``model.kiln`` in :data:`WEIGHTS_FILE`.
"""
from __future__ import annotations

import importlib
import logging
import os

import numpy as np
import torch

from kiln.errors import ArtifactError, CompilerArgsError
from kiln.runtime.pooling import module_kind, pooling_config, pool, read_json

log = logging.getLogger("kiln.optimum")
WEIGHTS_FILE = "sentence_transformers_modules.safetensors"
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")
DEFAULT_PROMPTS = {"query": "", "document": ""}     # SentenceTransformer's, filled by the saved ones


def read(directory: str) -> tuple:
    """``(transformer_dir, plan, weights)``: the directory holding the encoder, the JSON-able
    plan kept in the saved ``neuron`` section, and the ``Dense`` tensors by name."""
    modules = read_json(directory, "modules.json", default=None)
    if modules is None:                  # a plain Hugging Face directory: sentence-transformers mean-pools it
        modules = [{"type": "Transformer", "path": ""}, {"type": "Pooling", "path": None}]
    if not modules or module_kind(modules[0]) != "Transformer":
        raise CompilerArgsError(f"{directory}/modules.json: the first module is "
                                f"{module_kind(modules[0]) if modules else 'missing'}; kiln exports a Transformer "
                                "module followed by Pooling, Dense and Normalize")
    transformer = os.path.join(directory, modules[0].get("path") or "")
    steps, weights = [], {}
    for entry in modules[1:]:
        kind, sub = module_kind(entry), os.path.join(directory, entry.get("path") or "")
        config = read_json(sub, "config.json", default={}) if entry.get("path") is not None else {}
        if kind == "Pooling":
            if any(s["type"] == "Pooling" for s in steps):
                raise CompilerArgsError(f"{directory}/modules.json lists two Pooling modules")
            modes, include_prompt = pooling_config(sub, config)
            steps.append({"type": "Pooling", "modes": list(modes), "include_prompt": include_prompt})
            continue
        if not any(s["type"] == "Pooling" for s in steps):
            raise CompilerArgsError(f"{directory}/modules.json: {kind} ({entry.get('path')}) comes before any "
                                    "Pooling module; kiln applies modules to the pooled sentence embedding only")
        names = (config.get("module_input_name", "sentence_embedding"), config.get("module_output_name"))
        if any(n not in (None, "sentence_embedding") for n in names):
            raise CompilerArgsError(f"{sub}: {kind} reads or writes {names}; kiln applies it to the "
                                    "sentence_embedding only")
        if kind == "Normalize":
            steps.append({"type": "Normalize"})
        elif kind == "Dense":
            steps.append(_dense(sub, config, f"dense.{len(weights)}", weights))
        else:
            raise CompilerArgsError(f"{directory}/modules.json lists a {entry.get('type')} module "
                                    f"({entry.get('path')!r}), which kiln does not apply; it applies Transformer, "
                                    "Pooling, Dense and Normalize modules (never drops one)")
    if not any(s["type"] == "Pooling" for s in steps):
        raise CompilerArgsError(f"{directory}/modules.json has no Pooling module, so there is no sentence "
                                "embedding to compute")
    plan = {"steps": steps, **_transformer_settings(transformer), **_model_settings(directory)}
    return transformer, plan, weights


def _dense(sub: str, config: dict, key: str, weights: dict) -> dict:
    path = config.get("activation_function") or "torch.nn.modules.activation.Tanh"
    if not path.startswith("torch."):          # as sentence-transformers without trust_remote_code
        log.warning("kiln.optimum: %s: activation function %r is not a torch one; falling back to Tanh, as "
                    "sentence-transformers does without trust_remote_code", sub, path)
        path = "torch.nn.modules.activation.Tanh"
    _activation(path)                           # refuse one that cannot be built now, not at the first call
    found = _dense_weights(sub)
    step = {"type": "Dense", "key": key, "in_features": int(config["in_features"]),
            "out_features": int(config["out_features"]), "bias": bool(config.get("bias", True)),
            "activation_function": path, "use_residual": bool(config.get("use_residual", False))}
    wanted = ["linear.weight"] + (["linear.bias"] if step["bias"] else [])
    if step["use_residual"] and step["in_features"] != step["out_features"]:
        wanted.append("residual.weight")
    missing = [w for w in wanted if w not in found]
    if missing:
        raise CompilerArgsError(f"{sub}: the Dense weights have no {', '.join(missing)}")
    for w in wanted:
        weights[f"{key}.{w}"] = found[w].float().contiguous()
    return step


def _dense_weights(sub: str) -> dict:
    if os.path.exists(os.path.join(sub, "model.safetensors")):
        from safetensors.torch import load_file
        return load_file(os.path.join(sub, "model.safetensors"))
    if os.path.exists(os.path.join(sub, "pytorch_model.bin")):
        return torch.load(os.path.join(sub, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise CompilerArgsError(f"{sub}: a Dense module with no model.safetensors or pytorch_model.bin")


def _activation(path: str):
    """The activation module named ``path``; only torch's are imported (a saved directory's
    plan names one too, and loading must not import what a file names)."""
    module, _, name = path.rpartition(".")
    if not module.startswith("torch.nn"):
        raise CompilerArgsError(f"Dense activation_function {path!r} is not a torch.nn module; kiln imports no other")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise CompilerArgsError(f"Dense activation_function {path!r} is not importable") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise CompilerArgsError(f"Dense activation_function {path!r} is not a torch.nn.Module class")
    return cls()


def _transformer_settings(transformer: str) -> dict:
    """The length sentence-transformers cuts texts at (``max_seq_length`` in
    sentence_bert_config.json, else the tokenizer's ``model_max_length`` capped at the
    position embeddings) and ``do_lower_case``."""
    sbert = read_json(transformer, "sentence_bert_config.json", default={}) or {}
    limit = sbert.get("max_seq_length")
    if limit is None:
        limit = (read_json(transformer, "tokenizer_config.json", default={}) or {}).get("model_max_length")
        positions = (read_json(transformer, "config.json", default={}) or {}).get("max_position_embeddings")
        if isinstance(positions, int) and positions != -1:
            limit = positions if not isinstance(limit, (int, float)) else min(limit, positions)
    limit = int(limit) if isinstance(limit, (int, float)) and limit < 2 ** 31 else None
    return {"max_seq_length": limit, "do_lower_case": bool(sbert.get("do_lower_case", False))}


def _model_settings(directory: str) -> dict:
    config = read_json(directory, "config_sentence_transformers.json", default={}) or {}
    prompts = dict(DEFAULT_PROMPTS, **{k: ("" if v is None else v) for k, v in (config.get("prompts") or {}).items()})
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CompilerArgsError(f"{directory}/config_sentence_transformers.json: default_prompt_name {default!r} "
                                f"is not one of its prompts {list(prompts)}")
    similarity = config.get("similarity_fn_name") or "cosine"
    if similarity not in SIMILARITIES:
        raise CompilerArgsError(f"{directory}/config_sentence_transformers.json: similarity_fn_name "
                                f"{similarity!r} is not one of {list(SIMILARITIES)}")
    return {"prompts": prompts, "default_prompt_name": default, "similarity_fn_name": similarity}


def lowercase_tokenizer(tokenizer) -> None:
    """``do_lower_case`` as sentence-transformers applies it: a ``Lowercase`` normalizer first in
    a fast tokenizer (kept when the tokenizer is saved), ``do_lower_case`` on a slow one."""
    if getattr(tokenizer, "is_fast", False):
        from tokenizers.normalizers import Lowercase, Sequence
        normalizer = tokenizer.backend_tokenizer.normalizer
        if isinstance(normalizer, Lowercase) or (isinstance(normalizer, Sequence) and
                                                 any(isinstance(n, Lowercase) for n in normalizer)):
            return
        parts = [Lowercase()] + (list(normalizer) if isinstance(normalizer, Sequence) else
                                 [normalizer] if normalizer is not None else [])
        tokenizer.backend_tokenizer.normalizer = Sequence(parts)
    else:
        try:
            tokenizer.do_lower_case = True
        except AttributeError:
            tokenizer.basic_tokenizer.do_lower_case = True


def legacy_plan(neuron: dict) -> dict:
    """The plan of a directory saved before the plan was kept (pooling and normalize only)."""
    steps = [{"type": "Pooling", "modes": [neuron.get("pooling_mode", "mean")], "include_prompt": True}]
    if neuron.get("normalize"):
        steps.append({"type": "Normalize"})
    return {"steps": steps, "max_seq_length": neuron.get("max_seq_length"), "do_lower_case": False,
            "prompts": dict(DEFAULT_PROMPTS), "default_prompt_name": None, "similarity_fn_name": "cosine"}


def apply(plan: dict, weights: dict, hidden: torch.Tensor, mask: torch.Tensor,
          prompt_length: int | None = None) -> torch.Tensor:
    """The sentence embedding: the plan's modules on the token embeddings, in order."""
    x = None
    for step in plan["steps"]:
        if step["type"] == "Pooling":
            x = pool(hidden, mask, step["modes"], prompt_length=None if step["include_prompt"] else prompt_length)
        elif step["type"] == "Normalize":
            x = torch.nn.functional.normalize(x, p=2, dim=-1)
        else:
            k = step["key"]
            out = _activation(step["activation_function"])(
                torch.nn.functional.linear(x, weights[f"{k}.linear.weight"], weights.get(f"{k}.linear.bias")))
            if step["use_residual"]:
                out = out + (x if step["in_features"] == step["out_features"] else
                             torch.nn.functional.linear(x, weights[f"{k}.residual.weight"]))
            x = out
    return x


def save_weights(weights: dict, directory: str) -> None:
    if weights:
        from safetensors.torch import save
        from kiln.atomic import write_atomic
        data = save(weights)
        write_atomic(os.path.join(directory, WEIGHTS_FILE), lambda f: f.write(data))


def load_weights(plan: dict, directory: str) -> dict:
    if not any(s["type"] == "Dense" for s in plan["steps"]):
        return {}
    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.exists(path):
        raise ArtifactError(f"{path} does not exist: this model's Dense modules need their weights")
    from safetensors.torch import load_file
    return load_file(path)


def similarity(name: str, a, b, pairwise: bool = False) -> torch.Tensor:
    """sentence-transformers' similarity functions: ``cosine``, ``dot``, and the negative
    ``euclidean`` and ``manhattan`` distances; every row of ``a`` with every row of ``b``, or
    row ``i`` with row ``i`` when ``pairwise``."""
    a, b = (_as_tensor(x) for x in (a, b))
    if not pairwise:
        a, b = (x.unsqueeze(0) if x.dim() == 1 else x for x in (a, b))
    if name == "cosine":
        a, b = (torch.nn.functional.normalize(x, p=2, dim=-1) for x in (a, b))
        name = "dot"
    if name == "dot":
        return (a * b).sum(dim=-1) if pairwise else torch.mm(a, b.transpose(0, 1))
    if name == "manhattan":
        return -torch.sum(torch.abs(a - b), dim=-1) if pairwise else -torch.cdist(a, b, p=1.0)
    if name == "euclidean":
        return -torch.linalg.vector_norm(a - b, dim=-1) if pairwise else -torch.cdist(a, b, p=2.0)
    raise ValueError(f"similarity_fn_name {name!r} is not one of {list(SIMILARITIES)}")


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, list):
        x = torch.stack([torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in x])
    elif not isinstance(x, torch.Tensor):
        x = torch.as_tensor(np.asarray(x))
    if torch.is_floating_point(x) and torch.finfo(x.dtype).bits < 32:
        x = x.float()
    return x
