"""Dropout's masks, drawn as CPU eager draws them, in about two thirds of its time.

Lazy and eager modes draw each dropout mask on the host when the operation is recorded
(:func:`kiln.device.dispatch._dropout`), from PyTorch's default generator, so a seed gives
CPU eager's masks; a compiled graph's dropout draws its mask the same way
(:mod:`kiln.graph.dropout`). Either way a mask whose draw was predicted comes from the
worker of :mod:`kiln.graph.draw_ahead`, which drew it from the same generator state.

On CPUs other than Intel's, PyTorch's ``bernoulli_(p)`` draws one element at a time: two
32-bit outputs of the Mersenne Twister joined into 64 bits, the low 53 as a double in
[0, 1), kept where it is below ``p``. A 4-layer BERT's training step spends
31 ms of its ~220 on its 14 masks that way (docs/device.md), in eager PyTorch and in kiln.

``random_(0, 2**53)`` on an int64 tensor draws the same two outputs per element in the same
order and keeps the same low 53 bits, with less work per element; the comparison with ``p``
is then one integer comparison over the whole tensor (``u * 2**-53 < p`` exactly when
``u < ceil(p * 2**53)``: both sides are exact in binary). Same bits, same generator state
afterwards. Measured in a BERT-4L lazy-mode step (one process, the two ways alternating),
the 14 masks took 19.6 ms against 27.8: the Mersenne Twister itself, serial in both, is
most of what is left.

That equivalence is PyTorch's implementation, not its contract (on Intel CPUs it draws
through MKL instead, from another stream), so it is checked once per process and dtype
against ``bernoulli_`` itself on a private generator, in a contiguous and a transposed
layout; where it does not hold, masks are drawn by ``bernoulli_`` as before.
"""
from __future__ import annotations

import math
import threading

import torch

from kiln.graph import draw_ahead

_SPAN = 1 << 53
_exact: dict = {}            # dtype -> whether the integer draw gives bernoulli_'s masks here
_lock = threading.Lock()


def keep_mask(meta: torch.Tensor, p: float, *, also_as_values: bool = False):
    """``torch.empty_like(meta, device="cpu").bernoulli_(p)`` as booleans: the same
    elements kept, the default generator left where ``bernoulli_`` leaves it (drawn ahead
    on another thread when a step's masks repeat: :mod:`kiln.graph.draw_ahead`).
    ``also_as_values``: ``(mask, mask.to(meta.dtype))``, the cast made ahead too."""
    like = torch.empty_like(meta, device="meta")        # the layout CPU's empty_like gives (dense or not)
    return draw_ahead.mask((tuple(like.shape), tuple(like.stride()), like.dtype, float(p), also_as_values),
                           _draw)


def _draw(layout, generator):
    shape, stride, dtype, p, also_as_values = layout
    like = torch.empty_strided(shape, stride, dtype=dtype)
    if 0.0 < p < 1.0 and _integer_draw_is_exact(dtype):
        bits = torch.empty_like(like, dtype=torch.int64).random_(0, _SPAN, generator=generator)
        mask = _from_bits(bits, p)
    else:
        mask = like.bernoulli_(p, generator=generator).to(torch.bool)
    return (mask, mask.to(dtype)) if also_as_values else mask


def _from_bits(bits: torch.Tensor, p: float) -> torch.Tensor:
    return bits.lt(math.ceil(p * _SPAN))


def _integer_draw_is_exact(dtype) -> bool:
    exact = _exact.get(dtype)
    if exact is None:
        with _lock:
            exact = _exact.get(dtype)
            if exact is None:
                exact = _exact[dtype] = _probe(dtype)
    return exact


def _probe(dtype) -> bool:
    """Both ways on the same seed, contiguous and transposed: equal masks and equal
    generator states afterwards."""
    try:
        for shape, transpose in (((3, 257), False), ((19, 40), True)):
            ours, theirs = torch.Generator().manual_seed(20261127), torch.Generator().manual_seed(20261127)
            like = torch.empty(shape, dtype=dtype)
            like = like.t() if transpose else like
            expected = torch.empty_like(like).bernoulli_(0.9, generator=theirs).to(torch.bool)
            bits = torch.empty_like(like, dtype=torch.int64).random_(0, _SPAN, generator=ours)
            if not (torch.equal(_from_bits(bits, 0.9), expected)
                    and torch.equal(ours.get_state(), theirs.get_state())):
                return False
        return True
    except (RuntimeError, TypeError):       # a dtype random_ or bernoulli_ refuses
        return False
