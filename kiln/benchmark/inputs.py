"""What a benchmark runs on: a target's kind, a factory's inputs resized to a batch, inputs made from specs.

Both the parent (to compile a factory) and every model copy (to call it) need
these, so they live apart from either.
"""
from __future__ import annotations

import os

from kiln.factory import load_factory
from kiln.runtime import alloc

ADVICE = "Benchmark smaller batches (--batch-sizes)"


def is_factory(target) -> bool:
    """Whether ``target`` names a ``module:function`` factory (not an artifact file or a model)."""
    return isinstance(target, str) and ":" in target and not os.path.exists(target)


def factory_inputs(spec, path, batch):
    """(model, args, kwargs) from a factory, the example's dim 0 resized to ``batch``."""
    import torch
    model, example = load_factory(spec, path)
    args, kwargs = ((), example) if isinstance(example, dict) else \
        ((example,) if isinstance(example, torch.Tensor) else tuple(example), {})

    # the example's batch is its first tensor's dim 0; an input without it (a bias every row
    # shares) is not resized (it was, to the batch: a broadcast bias of 8 became one of 1 or 2)
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()), None)
    example_batch = None if first is None else first.shape[0]

    def resize(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != example_batch or t.shape[0] == batch:
            return t
        reps = -(-batch // t.shape[0])
        shape = (reps * t.shape[0], *t.shape[1:])
        return alloc.allocate(lambda: t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].contiguous(),
                              f"kiln bench: the example input resized to batch {batch}", shape, t.dtype, ADVICE)
    return model.eval(), tuple(resize(a) for a in args), {k: resize(v) for k, v in kwargs.items()}


def inputs_from_specs(specs, batch, compiled_batch):
    """Inputs for an artifact benchmarked without its factory: random floats, ones for ids and masks."""
    import torch
    g = torch.Generator().manual_seed(0)
    out = []
    for s in specs:
        shape, what = list(s.shape), f"kiln bench: input {s.name!r}"
        if shape and compiled_batch is not None and shape[0] == compiled_batch:
            shape[0], what = batch, f"{what} at batch {batch}"
        if s.dtype.is_floating_point:
            def make():
                return torch.randn(shape, generator=g).to(s.dtype)
        else:   # ids and masks: 1 is a valid token id and an "attend" mask value
            def make():
                return torch.ones(shape, dtype=s.dtype)
        # the shape is the artifact's (its batch replaced): checked before it is allocated
        out.append(alloc.allocate(make, what, shape, s.dtype,
                                  f"{ADVICE}, or check the artifact's input specs (kiln inspect)"))
    return tuple(out)
