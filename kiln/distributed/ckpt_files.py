"""Checkpoint files: written atomically, read without running code.

Shared by the trainer's checkpoints (:mod:`kiln.distributed.checkpoint`), ZeRO-1's
deprecated per-rank files (:mod:`kiln.distributed.zero1`) and the legacy
``parallel_layers.save/load``. Every write goes through :func:`kiln.atomic.write_atomic`
(temp file, fsync, rename), so a killed save never leaves half a file under the real
name; every read is ``torch.load(weights_only=True)``, so a file can hold tensors and
plain values but never makes the loader run code.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

from kiln.atomic import write_atomic
from kiln.errors import KilnError


class CheckpointError(KilnError, RuntimeError):
    """A checkpoint that cannot be written or loaded here (the message says why)."""


def to_cpu(obj):
    """``obj`` with every tensor copied to host memory (device tensors included)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        out.update((k, to_cpu(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):             # a module state_dict's version info
            out._metadata = obj._metadata
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_file(obj, path: str) -> None:
    """``torch.save`` to ``path`` atomically (readers see the old file or the new one)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def load_file(path: str, what: str = "checkpoint file"):
    """``torch.load(path, weights_only=True, map_location='cpu')``: no code from the file runs."""
    if not os.path.exists(path):
        raise CheckpointError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:          # pickle.UnpicklingError names the global it refused
        if "weights_only" not in str(e) and "Unsupported global" not in str(e):
            raise
        raise CheckpointError(
            f"{what} {path} holds Python objects other than tensors, containers, numbers and strings; "
            "kiln loads checkpoints with torch.load(weights_only=True) so that a file cannot run code. "
            "Save plain values (e.g. user_content={'step': 3}), or allow the class with "
            f"torch.serialization.add_safe_globals([...]) if you trust the file. ({str(e).splitlines()[0]})"
        ) from None
