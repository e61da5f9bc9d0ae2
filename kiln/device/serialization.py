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

import functools

import torch

from kiln.device import walk


def install(name: str):
    """Wrap ``torch.load`` once (module doc)."""
    if getattr(torch.load, "_kiln_map_location", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(f, map_location=None, *args, **kwargs):
        if isinstance(map_location, dict) and any(_names(v, name) for v in map_location.values()):
            return _load_mapped(original, f, map_location, name, args, kwargs)
        if not _names(map_location, name):
            return original(f, map_location, *args, **kwargs)
        return to_device(original(f, "cpu", *args, **kwargs), torch.device(map_location))

    load._kiln_map_location = True
    torch.load = torch.serialization.load = load      # libraries call either; the second segfaulted
    _guard_storage_moves(name)


def _load_mapped(original, f, mapping: dict, name: str, args, kwargs):
    """``map_location={"cuda:0": "kiln", ...}`` (a CUDA checkpoint onto the device): the
    storages mapped to the device load to the CPU and their tensors move after; the rest
    go where the mapping says, as PyTorch would send them."""
    device, chosen = None, set()

    def locate(storage, location):
        nonlocal device
        target = mapping.get(location, location)
        if _names(target, name):
            device = torch.device(target)
            chosen.add(storage.data_ptr())
            return storage
        return torch.serialization.default_restore_location(storage, str(target))

    obj = original(f, locate, *args, **kwargs)
    return obj if device is None else to_device(obj, device, only=chosen)


def _guard_storage_moves(name: str):
    """A storage moved to the device (``storage.to("kiln")``, or a ``map_location`` function
    returning one) made PyTorch allocate a storage through an allocator a Python backend
    lacks, and the process died (a segfault). It is an error saying what to do instead."""
    import torch._utils as utils
    import torch.storage as storage_module
    original = utils._to
    if getattr(original, "_kiln", False):
        return

    def _to(self, device, non_blocking=False):
        if torch.device(device).type == name:
            raise RuntimeError(
                f"kiln's device keeps no storages of its own (its tensors are host memory), so a storage "
                f"cannot be moved to '{device}': load to the CPU and move the tensors (tensor.to('{name}')); "
                f"torch.load(f, map_location='{name}') does that")
        return original(self, device, non_blocking)

    _to._kiln = True
    utils._to = storage_module._to = _to


def _names(location, name: str) -> bool:
    if isinstance(location, torch.device):
        return location.type == name
    return isinstance(location, str) and location.split(":")[0] == name


def to_device(obj, device: torch.device, only=None):
    """``obj`` (a loaded checkpoint) with its CPU tensors on ``device``: tensors sharing a
    storage (and dtype) become views of one device tensor, as they were views of one
    storage; parameters stay parameters; modules move whole; dicts, lists and tuples keep
    their types, and a state dict its ``_metadata`` (``load_state_dict`` reads the modules'
    versions from it). ``only``: the storages (by data pointer) whose tensors move; all when
    None."""
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

    def one(v):
        if isinstance(v, torch.nn.Module):
            return v.to(device)
        chosen = only is None or v.untyped_storage().data_ptr() in only
        return move(v) if v.device.type == "cpu" and chosen else v

    return walk.rebuild(obj, one, lambda v: isinstance(v, (torch.Tensor, torch.nn.Module)))
