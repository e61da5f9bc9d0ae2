"""Sentence-transformers' pooling, as its ``Pooling`` and ``Normalize`` modules compute it,
read from a sentence-transformers directory: the served embeddings
(:mod:`kiln.serving.embeddings`) and ``kiln.optimum``'s ``NeuronSentenceTransformers`` pool an
encoder's last hidden state with it.

Both spellings of the pooling config are read: sentence-transformers 6's
``{"pooling_mode": "mean"}`` (a name or a list of names, concatenated) and the older
``pooling_mode_mean_tokens: true`` flags.
"""
from __future__ import annotations

import json
import os

import torch

from kiln.errors import KilnError

# sentence-transformers' legacy flags, in its order (several on are concatenated in this order)
LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
MODES = tuple(LEGACY_MODES.values())
SERVED = ("mean", "cls", "max")      # what the server's embeddings pool with (kiln.serving.embeddings)


def read_json(directory: str, *parts, default=None):
    path = os.path.join(directory, *parts)
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def module_kind(entry: dict) -> str:
    """A ``modules.json`` entry's class name (``...modules.pooling.Pooling`` -> ``Pooling``)."""
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def pooling_config(directory: str, config: dict) -> tuple:
    """``(modes, include_prompt)`` of a ``Pooling`` module's config.json, as sentence-transformers
    reads it: ``modes`` a tuple of names."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for k, m in LEGACY_MODES.items() if config.get(k) is True) or ("mean",)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise KilnError(f"{directory}: pooling mode {unknown or modes} is not one sentence-transformers has; "
                        f"kiln pools with {list(MODES)}")
    return modes, bool(config.get("include_prompt", True))


def pooling_of(directory: str) -> tuple:
    """``(mode, normalize, max_seq_length)`` from a sentence-transformers directory's
    modules (mean pooling, not normalized, no limit, for a plain Hugging Face directory), for
    the server's embeddings: one of :data:`SERVED`. A module they do not compute (``Dense``,
    ...) is an error naming it, never dropped."""
    modules = read_json(directory, "modules.json", default=[])
    kinds = [module_kind(m) for m in modules]
    other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if other:
        raise KilnError(f"{directory}: modules.json lists {', '.join(other)}, which kiln's embeddings do not "
                        "apply (they pool and normalize only); kiln.optimum's NeuronSentenceTransformers "
                        "applies Dense modules")
    mode = "mean"
    for m in modules:
        if module_kind(m) == "Pooling":
            config = read_json(directory, m.get("path", ""), "config.json", default={})
            modes, _ = pooling_config(directory, config)
            if len(modes) != 1 or modes[0] not in SERVED:
                on = {k: v for k, v in config.items() if k.startswith("pooling_mode") and v not in (False, None)}
                raise KilnError(f"{directory}: pooling {on} is not supported for embeddings; kiln serves one of "
                                f"{list(SERVED)}")
            mode = modes[0]
    transformer = next((m.get("path", "") for m in modules if module_kind(m) == "Transformer"), "")
    limit = (read_json(directory, transformer, "sentence_bert_config.json", default={}) or {}).get("max_seq_length")
    return mode, "Normalize" in kinds, limit


def exclude_prompt(mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """The attention mask with the first ``prompt_length`` real tokens of each row zeroed, as
    sentence-transformers' ``Pooling(include_prompt=False)`` leaves the prompt out."""
    mask = mask.clone()
    pad_lengths = mask.to(torch.int32).argmax(dim=1)
    if pad_lengths.sum() == 0:
        mask[:, :prompt_length] = 0
    else:
        positions = torch.arange(mask.size(1)).unsqueeze(0)
        mask[positions < (pad_lengths + prompt_length).unsqueeze(1)] = 0
    return mask


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode="mean", normalize: bool = False,
         prompt_length: int | None = None) -> torch.Tensor:
    """``[rows, S, H]`` (or ``[rows, H]``, already pooled) -> ``[rows, H * len(modes)]`` over the
    attention ``mask``, so padding never counts; ``mode`` a name or a sequence of names
    (concatenated), each as sentence-transformers' ``Pooling`` computes it."""
    hidden = hidden.float()
    if hidden.dim() == 3:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
        original = mask
        if prompt_length:
            mask = exclude_prompt(mask, prompt_length)
        m = mask.unsqueeze(-1).to(hidden.dtype)
        outs = []
        for each in modes:
            if each == "cls":
                first = mask.to(torch.int).argmax(dim=1)
                outs.append(hidden[torch.arange(hidden.shape[0]), first])
            elif each == "max":
                outs.append(hidden.masked_fill(m == 0, float("-inf")).max(1).values)
            elif each in ("mean", "mean_sqrt_len_tokens"):
                count = m.sum(1).clamp(min=1e-9)
                outs.append((hidden * m).sum(1) / (count if each == "mean" else torch.sqrt(count)))
            elif each == "weightedmean":
                weights = torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype).view(1, -1, 1)
                if original.numel():
                    weights = weights - original.to(torch.int32).argmax(dim=1).view(-1, 1, 1)
                weighted = m * weights
                outs.append((hidden * weighted).sum(1) / weighted.sum(1).clamp(min=1e-9))
            elif each == "lasttoken":
                seq = hidden.shape[1]
                values, index = mask.flip(1).max(1)
                index = torch.where(values == 0, seq - 1, index)
                outs.append((hidden * m)[torch.arange(hidden.shape[0]), seq - index - 1])
            else:
                raise KilnError(f"pooling mode {each!r} is not one of {list(MODES)}")
        hidden = torch.cat(outs, dim=-1)
    if normalize:
        hidden = torch.nn.functional.normalize(hidden, p=2, dim=-1)
    return hidden
