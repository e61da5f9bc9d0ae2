"""Random numbers in a graph: who draws them, and how a check draws the same ones twice.

A training graph from ``torch.compile`` holds dropout (``aten.native_dropout``) and other
operations that draw from PyTorch's generator. Eager PyTorch draws them in program order
from the default generator, so a seed gives a run's masks. kiln keeps that:

* Such an operation runs where it draws from PyTorch's own generator: on the host, or in
  an engine that calls PyTorch's random kernels in the graph's order (Inductor, built with
  ``fallback_random``; ``Engine.draws_from_torch``). ONNX Runtime's ``Dropout`` and
  OpenVINO's ``RandomUniform`` draw from generators of their own: a compiled graph would
  give other masks than eager for the same seed, and its check against eager could never
  pass (it failed, so a BERT's training forward ran uncompiled).
* A random op draws in memory order, so its input is laid out as eager's was before it
  runs (:func:`lay_out_as_eager`, at capture): a partition's outputs are contiguous where
  eager's may be views.
* A check runs the graph twice, eagerly and compiled: both runs start from one snapshot
  of the generators (:class:`Draws`), or the compiled run would be compared against
  masks it never drew.
* A compile leaves the caller's generators as it found them (:func:`unchanged`): the
  check's runs, and -O2's timing runs, draw numbers the caller's next eager call would
  otherwise have drawn, so a ``torch.compile`` graph's first call (which compiles, then
  runs) gave other masks than eager for the same seed.
"""
from __future__ import annotations

import contextlib

import torch

WHY_HOST = ("draws random numbers: runs where it draws from PyTorch's generator, so that a "
            "seed gives eager's numbers")


def draws(node) -> bool:
    """Whether an FX node is an ATen operation that draws from a random generator. PyTorch
    tags every operation that may (``nondeterministic_seeded``), attention included for
    its ``dropout_p``: attention without dropout, and dropout outside training or at
    ``p=0``, draw nothing."""
    target = getattr(node, "target", None)
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" in names:
        return bool(_argument(node, names, "dropout_p"))
    for flag in ("train", "training"):   # dropout(input, p, train), lstm(..., dropout, train), rrelu
        if flag in names:
            rate = next((r for r in ("p", "dropout") if r in names), None)
            return bool(_argument(node, names, flag)) and (rate is None or bool(_argument(node, names, rate)))
    return True


def _argument(node, names, name):
    i = names.index(name)
    if i < len(node.args):
        return node.args[i]
    if name in node.kwargs:
        return node.kwargs[name]
    return node.target._schema.arguments[i].default_value


def draws_random(gm) -> bool:
    """Whether any operation of ``gm`` draws random numbers."""
    return any(node.op == "call_function" and draws(node) for node in gm.graph.nodes)


RELAYOUT = "kiln_layout_for_draws"      # node meta: laid out for a random op (see below)
WHY_RELAYOUT = ("lays out a random op's input as eager's, so that its numbers land where "
                "eager's do: on the host, with it")


def lay_out_as_eager(gm) -> int:
    """Give each random op's tensor inputs eager's memory layout; returns how many it did.

    A random op draws in memory order: CPU's ``native_dropout`` draws its mask into a
    tensor laid out like its input, so the same numbers land on other elements when the
    input is laid out otherwise. ONNX Runtime's outputs are always contiguous, and eager's
    input may not be: in a transformer layer's training graph, dropout after attention
    reads a transposed tensor, and on the host after an ONNX Runtime partition it drew
    eager's numbers into the wrong places. Where the graph's metadata says eager's input
    is not contiguous, the input is copied into eager's strides first
    (``empty_strided`` + ``copy``, marked :data:`RELAYOUT` so that they run with the
    random op: on the host, or in an engine that draws from PyTorch, which may take the
    copy away when its own layout is eager's already)."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not draws(node):
            continue
        for i, arg in enumerate(node.args):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor) or val.is_contiguous() or _symbolic(val):
                continue
            with gm.graph.inserting_before(node):
                empty = gm.graph.call_function(torch.ops.aten.empty_strided.default,
                                               (list(val.shape), list(val.stride())),
                                               {"dtype": val.dtype, "device": val.device})
                copied = gm.graph.call_function(torch.ops.aten.copy.default, (empty, arg))
            empty.meta.update(val=val, **{RELAYOUT: True})
            copied.meta.update(val=val, **{RELAYOUT: True})
            for key in ("stack_trace", "nn_module_stack"):
                if key in node.meta:
                    empty.meta[key] = copied.meta[key] = node.meta[key]
            node.update_arg(i, copied)
            done += 1
    if done:
        gm.recompile()
    return done


def _symbolic(val) -> bool:
    return not all(isinstance(d, int) for d in (*val.shape, *val.stride()))


class Draws:
    """A snapshot of PyTorch's default generators (the CPU's, and each GPU's once CUDA is
    initialised); :meth:`restore` sets them back, so that the next run draws the same
    numbers as the run after the snapshot did."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def restore(draws: Draws | None):
    """``draws.restore()``, where there is a snapshot (a ``Captured``'s ``draws``: the
    generators as they were when its eager outputs were computed)."""
    if draws is not None:
        draws.restore()


@contextlib.contextmanager
def unchanged():
    """The block's draws do not count: the generators are set back afterwards, whether it
    finished or raised."""
    before = Draws()
    try:
        yield before
    finally:
        before.restore()
