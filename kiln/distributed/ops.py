"""The collectives as functional operators: ``torch.ops.kiln.all_reduce(x, group, op)``,
``torch.ops.kiln.all_gather(x, dim, size, group)``, ``torch.ops.kiln.reduce_scatter(x,
dim, size, group)``.

Why operators of kiln's own rather than ``dist.all_reduce`` in a forward: an in-place
collective on a process-group object cannot be captured by ``torch.export``, and
PyTorch's functional collectives name groups by a process-local handle. These are pure
functions of their input whose group is a symbolic name (:mod:`kiln.distributed.groups`)
and whose size is in the signature, so shape propagation needs no group: a tensor-parallel
model captures to one graph, no engine claims these nodes, and the compiled graph's host
program runs them between engine partitions (``kiln.runtime.program`` resolves them by
name once this module is imported, which loading a tensor-parallel artifact does).
"""
from __future__ import annotations

import torch

from kiln.distributed import groups

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("all_reduce(Tensor x, str group, str op='sum') -> Tensor")
_LIB.define("all_gather(Tensor x, int dim, int size, str group) -> Tensor")
_LIB.define("reduce_scatter(Tensor x, int dim, int size, str group) -> Tensor")


def _all_reduce(x, group, op="sum"):
    return groups.get(group).all_reduce(x, op)


def _all_gather(x, dim, size, group):
    g = groups.get(group)
    _check_size(g, size, group)
    return g.all_gather(x, dim)


def _reduce_scatter(x, dim, size, group):
    g = groups.get(group)
    _check_size(g, size, group)
    return g.reduce_scatter(x, dim)


def _check_size(g, size, name):
    if g.size != size:
        raise groups.CollectiveError(f"the graph was built for a {name!r} group of {size} ranks; this one has "
                                     f"{g.size}: load it with tp_degree={size}")


for _key in ("CPU", "CUDA"):
    _LIB.impl("all_reduce", _all_reduce, _key)
    _LIB.impl("all_gather", _all_gather, _key)
    _LIB.impl("reduce_scatter", _reduce_scatter, _key)


def _gathered(x, dim, size):
    shape = list(x.shape)
    shape[dim] *= size
    return x.new_empty(shape)


def _scattered(x, dim, size):
    shape = list(x.shape)
    shape[dim] //= size
    return x.new_empty(shape)


_LIB.impl("all_reduce", lambda x, group, op="sum": torch.empty_like(x), "Meta")
_LIB.impl("all_gather", lambda x, dim, size, group: _gathered(x, dim, size), "Meta")
_LIB.impl("reduce_scatter", lambda x, dim, size, group: _scattered(x, dim, size), "Meta")


def _register_fake(name, fn):
    """FakeTensor's shape function for ``name``. Older torch (2.11, the GPU image's) refuses a
    fake implementation for an operator that already has a Meta kernel; there FakeTensor uses
    the Meta kernel registered above, which computes the same shapes."""
    try:
        torch.library.register_fake(name)(fn)
    except RuntimeError as e:
        if "Meta" not in str(e) and "abstract" not in str(e):
            raise


def _fake_all_reduce(x, group, op="sum"):
    return torch.empty_like(x)


def _fake_all_gather(x, dim, size, group):
    return _gathered(x, dim, size)


def _fake_reduce_scatter(x, dim, size, group):
    return _scattered(x, dim, size)


_register_fake("kiln::all_reduce", _fake_all_reduce)
_register_fake("kiln::all_gather", _fake_all_gather)
_register_fake("kiln::reduce_scatter", _fake_reduce_scatter)


def all_reduce(x, group: str = "tp", op: str = "sum"):
    return torch.ops.kiln.all_reduce(x, group, op)


def all_gather(x, dim: int, size: int, group: str = "tp"):
    return torch.ops.kiln.all_gather(x, dim, size, group)


def reduce_scatter(x, dim: int, size: int, group: str = "tp"):
    return torch.ops.kiln.reduce_scatter(x, dim, size, group)
