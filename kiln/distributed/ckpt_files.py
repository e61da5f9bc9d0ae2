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
import torch.distributed as dist

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
        if "Unsupported global" not in str(e):
            # torch's "Weights only load failed" says the same for bytes that are no pickle at
            # all; until 12-03 a damaged file was told to allow classes with add_safe_globals
            detail = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line
                           or "Unsupported operand" in line), str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise CheckpointError(f"{what} {path} is damaged or not a torch.save file ({detail}): copy it again "
                                  "from where it was saved, or resume from another checkpoint") from None
        raise CheckpointError(
            f"{what} {path} holds Python objects other than tensors, containers, numbers and strings; "
            "kiln loads checkpoints with torch.load(weights_only=True) so that a file cannot run code. "
            "Save plain values (e.g. user_content={'step': 3}), or allow the class with "
            f"torch.serialization.add_safe_globals([...]) if you trust the file. ({str(e).splitlines()[0]})"
        ) from None


def agree(failed, doing: str = "load") -> None:
    """Where the ranks of a checkpoint call meet, in place of a barrier: every rank learns
    whether any rank failed, and all raise (the failing rank its own error, the others one
    naming it). With a barrier a rank whose load raised left, and the others waited in the
    barrier for it (the legacy loader until 11-30; ``load_checkpoint`` and ``save_checkpoint``
    until 12-03, where a script that caught the error went on and its next collective was
    paired with the others' barrier, or hung)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if failed is None else f"{type(failed).__name__}: {failed}")
    if failed is not None:
        raise failed
    bad = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if bad:
        rank, error = bad[0]
        raise CheckpointError(f"rank {rank} could not {doing} its checkpoint ({error}), so the model's shards "
                              f"are not all {'loaded' if doing == 'load' else 'saved'}")
