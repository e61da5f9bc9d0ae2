"""torch_xla's ``utils.serialization`` (``xser.save`` / ``xser.load``, NxD's and Neuron's
checkpoint format for large models) on kiln, in torch_xla's own layout, so checkpoints
written by torch_xla on a Neuron host load here.

The layout: ``path`` is a ``torch.save`` of the data with each device tensor replaced by a
``TensorReference(tid)``, and tensor ``tid`` is ``path.tensors/tensor_{tid}.pt``, one
``torch.save`` of a CPU tensor each (torch_xla writes them one at a time so a large model
never needs a second copy in host memory). CPU tensors stay in ``path``.

Loading runs no code from the files: they are read with ``weights_only=True``, with
``TensorReference`` allowed under both its names (torch_xla's
``torch_xla.utils.serialization.TensorReference`` and this module's). The loaded tensors are
on the CPU, as torch_xla's are.

Writes never leave a mixed checkpoint: the tensors' folder and the reference file are each
written beside their targets and renamed into place, the reference file last, and the folder
holds ``.kiln-ref-sha256``, the hash of the reference file it belongs to. A save interrupted
between the two renames leaves the old reference file beside the new tensors; ``load`` finds
the hashes differ and says so, instead of handing back tensors under the wrong names.
Folders torch_xla wrote have no such file and are read as they are. Files kiln writes name
this module's ``TensorReference``; torch_xla itself cannot read those reference files (its
tensor files it can).
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile

import torch

from kiln.atomic import write_atomic
from kiln.device import walk


class TensorReference:
    """Stands for tensor ``tid`` of the checkpoint's tensors folder."""

    def __init__(self, tid: int):
        self.tid = tid


_HASH = ".kiln-ref-sha256"
_SAFE = [TensorReference, (TensorReference, "torch_xla.utils.serialization.TensorReference")]


def _folder(path: str) -> str:
    return path + ".tensors"


def _tensor_file(folder: str, tid: int) -> str:
    return os.path.join(folder, f"tensor_{tid}.pt")


def _is_device_tensor(v) -> bool:
    from kiln.device.tensor import DeviceTensor
    return isinstance(v, DeviceTensor)


def save(data, path, master_only: bool = True, global_master: bool = False):
    """Write ``data`` (any nesting of containers) in torch_xla's layout; by the master only
    unless ``master_only`` is False (then each rank needs a path of its own)."""
    from kiln.compat import xla_model
    if master_only and not xla_model.is_master_ordinal(local=not global_master):
        return
    path = os.fspath(path)
    folder = _folder(path)
    parent = os.path.dirname(os.path.abspath(path))
    staging = tempfile.mkdtemp(prefix=".tensors-", dir=parent)
    count = [0]

    def convert(t):
        tid = count[0]
        count[0] += 1
        torch.save(t.detach().cpu().clone(), _tensor_file(staging, tid))
        return TensorReference(tid)

    try:
        buffer = io.BytesIO()
        torch.save(walk.rebuild(data, convert, _is_device_tensor), buffer)
        with open(os.path.join(staging, _HASH), "w") as f:
            f.write(hashlib.sha256(buffer.getvalue()).hexdigest())
        old = None
        if os.path.isdir(folder):
            old = tempfile.mkdtemp(prefix=".old-tensors-", dir=parent)
            os.rename(folder, os.path.join(old, "t"))
        os.rename(staging, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        write_atomic(path, lambda f: f.write(buffer.getvalue()))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def load(path):
    """What :func:`save` (or torch_xla's ``xser.save``) wrote, its tensors on the CPU."""
    path = os.fspath(path)
    folder = _folder(path)
    with open(path, "rb") as f:
        raw = f.read()
    stamp = os.path.join(folder, _HASH)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() != hashlib.sha256(raw).hexdigest():
                raise RuntimeError(f"{path} and its tensors folder {folder} come from different saves (a save was "
                                   "interrupted between writing the two): the checkpoint is not usable; save it again")
    with torch.serialization.safe_globals(_SAFE):
        refs = torch.load(io.BytesIO(raw), weights_only=True)

    def convert(ref):
        tensor_path = _tensor_file(folder, ref.tid)
        if not os.path.exists(tensor_path):
            raise FileNotFoundError(f"{path} refers to tensor {ref.tid}, but {tensor_path} is missing: the "
                                    "checkpoint's tensors folder is incomplete")
        return torch.load(tensor_path, weights_only=True)

    return walk.rebuild(refs, convert, lambda v: isinstance(v, TensorReference))
