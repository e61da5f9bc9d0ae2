"""``torch.load(f, map_location=<kiln's device>)``.

Why: ``torch.load`` moves each storage to ``map_location`` itself, in a device context
(``torch.kiln.device(...)``) and with ``torch.UntypedStorage(n, device=...)``. A Python
backend has no storage allocator, so that path cannot work for kiln's device (with the
context provided it crashes the process). Checkpoints hold CPU tensors (a device tensor is
saved as its host data), so loading to the device is loading to the CPU and moving: this
does that when ``map_location`` names kiln's device, keeping tensors that shared a storage
in the file views of one device tensor (a tied weight stays tied), and moving a whole
pickled module with ``.to``. Any other ``map_location`` is ``torch.load``'s own.
"""
from __future__ import annotations

import copy
import functools

import torch


def install(name: str):
    """Wrap ``torch.load`` once (module doc)."""
    if getattr(torch.load, "_kiln_map_location", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(f, map_location=None, *args, **kwargs):
        if not _names(map_location, name):
            return original(f, map_location, *args, **kwargs)
        return to_device(original(f, "cpu", *args, **kwargs), torch.device(map_location))

    load._kiln_map_location = True
    torch.load = load


def _names(location, name: str) -> bool:
    if isinstance(location, torch.device):
        return location.type == name
    return isinstance(location, str) and location.split(":")[0] == name


def to_device(obj, device: torch.device):
    """``obj`` (a loaded checkpoint) with its CPU tensors on ``device``: tensors sharing a
    storage (and dtype) become views of one device tensor, as they were views of one
    storage; parameters stay parameters; modules move whole; dicts, lists and tuples keep
    their types, and a state dict its ``_metadata`` (``load_state_dict`` reads the modules'
    versions from it)."""
    bases: dict = {}

    def move(t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.dtype)
        if key not in bases:
            whole = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
            bases[key] = whole.to(device)
        moved = bases[key].as_strided(t.shape, t.stride(), t.storage_offset())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(moved, requires_grad=t.requires_grad)
        return moved.requires_grad_(t.requires_grad) if t.requires_grad else moved

    def walk(v):
        if isinstance(v, torch.Tensor):
            return move(v) if v.device.type == "cpu" else v
        if isinstance(v, torch.nn.Module):
            return v.to(device)
        if isinstance(v, dict):
            out = copy.copy(v)              # its type and attributes (an OrderedDict's _metadata)
            for k, item in v.items():
                out[k] = walk(item)
            return out
        if isinstance(v, list):
            return [walk(item) for item in v]
        if isinstance(v, tuple):
            items = [walk(item) for item in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        return v
    return walk(obj)
