"""Outputs that are the model's constants are fresh tensors at each call.

A graph that returns a buffer (``return self.b, self.l(x) + self.b``) has that output as
one of the program's host constants: every call returned the same tensor, so a caller
that wrote to it (``out[0].add_(100)``) changed what every later call returned, while
the outputs computed from the constant still used its first value. Each output whose
storage is a host constant's is cloned instead. Constants that are outputs are small
in practice (a buffer, a table); the check is a set lookup per output, made only by a
model whose program has host constants.
"""
from __future__ import annotations

import torch


def storages(constants: dict) -> frozenset:
    """The storages (by address) of a program's host constants."""
    return frozenset(v.untyped_storage().data_ptr() for v in constants.values()
                     if isinstance(v, torch.Tensor) and v.device.type != "meta")


def fresh(outs: list, held: frozenset) -> list:
    """``outs`` with each tensor that shares one of ``held``'s storages cloned."""
    if not any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held for o in outs):
        return outs
    return [o.clone() if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held else o
            for o in outs]
