"""Dropout's mask drawn apart from the graph, so that the rest of the graph stays whole.

A ``torch.compile`` training forward holds ``aten.native_dropout``, which must draw
eager's masks: it runs on the host, or in an engine that calls PyTorch's random kernels
(Inductor; :mod:`kiln.graph.randomness`). On ONNX Runtime that split every forward into
partitions around each dropout, and with ``whole_graph`` sent the whole forward to
Inductor's C++ build (17 s for the tests' CNN, which has one dropout).

But the mask depends on nothing the graph computes: CPU's ``native_dropout(x, p)`` draws
``empty_like(x).bernoulli_(1 - p)`` (x's shape, strides and dtype; never its values), then
returns ``x * mask * (1 / (1 - p))`` and the mask as booleans. :func:`draw_masks_apart`
writes it so: a ``kiln::dropout_keep_mask`` node draws the boolean mask from x's metadata
alone (on the host, from PyTorch's generator, with the device's faster exact draw,
:mod:`kiln.graph.draws`), and the cast and the products are ordinary operators any
engine runs. The draws take no input from the graph, so they run
first, in the graph's order, and the rest is one partition. Checked on this machine for
contiguous and transposed inputs: the same masks and the same float32 outputs, bit for bit,
as ``native_dropout``. Only float32 inputs are rewritten (a bf16 ``native_dropout`` rounds
its product otherwise); anything else keeps the operator.
"""
from __future__ import annotations

import operator

import torch

from kiln.graph import draws

aten = torch.ops.aten


@torch.library.custom_op("kiln::dropout_keep_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_keep_mask(size: list[int], stride: list[int], dtype: torch.dtype, keep: float) -> torch.Tensor:
    """CPU ``native_dropout``'s mask, alone: True where an element is kept, drawn as into a
    tensor of x's layout and dtype (:func:`kiln.graph.draws.keep_mask`, the device's draw)."""
    return draws.keep_mask(torch.empty_strided(size, stride, dtype=dtype, device="meta"), keep)


@dropout_keep_mask.register_fake
def _(size, stride, dtype, keep):
    return torch.empty_strided(size, stride, dtype=torch.bool)


def draw_masks_apart(gm: torch.fx.GraphModule) -> int:
    """Rewrite each float32 training ``native_dropout`` of ``gm`` as a mask draw and
    products (module docstring); returns how many it rewrote."""
    done = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.native_dropout.default]:
        if _rewrite(gm.graph, node):
            done += 1
    if done:
        gm.recompile()
    return done


def is_mask_draw(node) -> bool:
    """A ``kiln::dropout_keep_mask`` node: it reads nothing the graph computes, so leaving it
    on the host splits nothing."""
    return getattr(node, "target", None) is dropout_keep_mask_op()


def _rewrite(graph, node) -> bool:
    x, p = node.args[0], float(node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    val, outs = x.meta.get("val") if isinstance(x, torch.fx.Node) else None, node.meta.get("val")
    if train is False or not 0.0 < p < 1.0 or not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return False
    if not all(isinstance(d, int) for d in (*val.shape, *val.stride())) or not isinstance(outs, (tuple, list)):
        return False
    users = list(node.users)
    if not all(u.target is operator.getitem for u in users):
        return False
    source = _before_relayout(x)
    keep = 1.0 - p
    with graph.inserting_before(node):
        flags = graph.call_function(dropout_keep_mask_op(), (list(val.shape), list(val.stride()), val.dtype, keep))
        mask = graph.call_function(aten._to_copy.default, (flags,), {"dtype": val.dtype})
        kept = graph.call_function(aten.mul.Tensor, (source, mask))
        out = graph.call_function(aten.mul.Tensor, (kept, 1.0 / keep))
    for new, meta in ((flags, outs[1]), (mask, val), (kept, val), (out, outs[0])):
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}, val=meta)
    for user in users:
        user.replace_all_uses_with(out if user.args[1] == 0 else flags)
        graph.erase_node(user)
    graph.erase_node(node)
    if source is not x and not x.users:              # capture's copy, now unread
        empty = x.args[0]
        graph.erase_node(x)
        if not empty.users:
            graph.erase_node(empty)
    return True


def _before_relayout(x):
    """x itself, or what capture copied into eager's layout for the draw
    (:func:`kiln.graph.randomness.lay_out_as_eager`): the products need no such copy, the
    mask takes eager's layout from x's strides."""
    from kiln.graph.randomness import RELAYOUT
    if x.meta.get(RELAYOUT) and x.target is aten.copy.default:
        return x.args[1]
    return x


def dropout_keep_mask_op():
    return torch.ops.kiln.dropout_keep_mask.default
