"""Sentence-transformers' pooling, as its ``Pooling`` and ``Normalize`` modules compute it,
read from a sentence-transformers directory: the served embeddings
(:mod:`kiln.serving.embeddings`) and ``kiln.optimum``'s ``NeuronSentenceTransformers`` pool an
encoder's last hidden state with it.
"""
from __future__ import annotations

import json
import os

import torch

from kiln.errors import KilnError

POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}


def _read_json(directory: str, *parts, default=None):
    path = os.path.join(directory, *parts)
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def pooling_of(directory: str) -> tuple:
    """``(mode, normalize, max_seq_length)`` from a sentence-transformers directory's
    modules (mean pooling, not normalized, no limit, for a plain Hugging Face directory)."""
    modules = _read_json(directory, "modules.json", default=[])
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    mode = "mean"
    if "Pooling" in kinds:
        config = _read_json(directory, kinds["Pooling"].get("path", ""), "config.json", default={})
        on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        unknown = [k for k in on if k not in POOLING_MODES]
        if len(on) != 1 or unknown:
            raise KilnError(f"{directory}: pooling {on} is not supported for embeddings; kiln pools one of "
                            f"{sorted(POOLING_MODES.values())}")
        mode = POOLING_MODES[on[0]]
    limit = (_read_json(directory, "sentence_bert_config.json", default={}) or {}).get("max_seq_length")
    return mode, "Normalize" in kinds, limit


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str = "mean", normalize: bool = False) -> torch.Tensor:
    """``[rows, S, H]`` (or ``[rows, H]``, already pooled) -> ``[rows, H]`` over the attention
    ``mask``, so padding never counts."""
    hidden = hidden.float()
    if hidden.dim() == 3:
        m = mask.unsqueeze(-1).to(hidden.dtype)
        if mode == "mean":
            hidden = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        elif mode == "cls":
            hidden = hidden[:, 0]
        else:
            hidden = hidden.masked_fill(m == 0, -1e9).max(1).values
    if normalize:
        hidden = torch.nn.functional.normalize(hidden, p=2, dim=1)
    return hidden
