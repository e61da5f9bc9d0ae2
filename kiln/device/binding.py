"""Giving pending device tensors the data a flush computed for them.

After a flush each live tensor's cell takes its host tensor (:func:`bind`): checked
against the shape and dtype it was recorded with, laid out with the strides it was
recorded with, never sharing memory with another tensor that is not its view; and each
view is re-derived from its base's new data, so the two share memory as views must.
"""
from __future__ import annotations

import torch

from kiln.device import tensor as dt
from kiln.device import walk


def bind(trace, bound):
    """Give each ``(cell, host tensor)`` of a flushed ``trace`` its data; re-derive views."""
    bind_values(storages(trace), [(cell, trace.metas[cell.value], data) for cell, data in bound])


def storages(trace) -> set:
    """The storages of ``trace``'s inputs (outputs must not share them unless views)."""
    return {d.untyped_storage().data_ptr() for _, d in trace.inputs if d.numel()}


def bind_values(seen, bound) -> list:
    """:func:`bind` of ``(cell, meta, host tensor)`` triples, ``seen`` the inputs' storages;
    the host tensors as given to the cells. A triple whose cell is None is checked and laid
    out the same way, and given to no cell (:mod:`kiln.device.inflight`: a value whose
    tensor was rebound while its program ran)."""
    seen = set(seen)
    views, given = [], []
    for cell, meta, data in bound:
        if data.shape != meta.shape or data.dtype != meta.dtype:
            raise RuntimeError(f"kiln device: a compiled graph returned {data.dtype}{list(data.shape)} "
                               f"where {meta.dtype}{list(meta.shape)} was expected")
        if data.numel() > 1 and data.stride() != meta.stride() and _dense(meta):
            data = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype).copy_(data)
        ptr = data.untyped_storage().data_ptr() if data.numel() else None
        if ptr is not None and ptr in seen and (cell is None or cell.live_base() is None):
            data = data.clone()       # never let two tensors share memory that are not views
        elif ptr is not None:
            seen.add(ptr)
        given.append(data)
        if cell is None:
            continue
        cell.data, cell.value = data, None
        if cell.live_base() is not None:
            views.append(cell)
    for cell in views:
        _rederive(cell)
    return given


def _dense(meta) -> bool:
    return meta.is_contiguous() or meta.is_contiguous(memory_format=torch.channels_last) \
        if meta.dim() == 4 else meta.is_contiguous() or (meta.dim() == 2 and meta.t().is_contiguous())


def _rederive(cell):
    """Make a view's data a real view of its base's data again (after a flush)."""
    base = cell.live_base()
    if base is None or base._kc.data is None:
        return
    _, func, args, kwargs, index = cell.base
    res = func(base.host(), *host(args), **host(kwargs))
    cell.data = res if index is None else res[index]


def _host_one(a):
    if isinstance(a, dt.DeviceTensor):
        return a.host()
    if isinstance(a, torch.device) and a.type == dt.device_type():
        return torch.device("cpu")
    return a


def host(tree):
    return walk.tmap(_host_one, tree)
