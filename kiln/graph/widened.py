"""A bf16/fp16 graph's answers judged against the same graph computed in float32.

Two correct bf16 implementations of a deep network each land a couple of bf16 ulps from
the exact answer, and so more than two ulps from each other: Inductor's whole build of
BERT-base in bf16 differed from eager's bf16 by 0.094 on a last hidden state of magnitude
4.2 (three ulps) and 6 ulps on its pooler output, over the validation gate's bf16 floor,
while against BERT-base in float32 Inductor was off by 0.050 and eager by 0.070 (the pooler
0.0148 and 0.0175; 11-29). Comparing each with the float32 computation tells the better
answer from the worse one: a build no further from it than eager's own bf16 is (with
:data:`MARGIN`) is as right as eager.

The float32 computation is the captured graph itself with every bf16/fp16 value widened:
its weights and float inputs cast up, every dtype argument naming the narrow type replaced
by float32. Nothing of the user's model is called again.
"""
from __future__ import annotations

import copy

import torch

from kiln.graph.validation import NARROW
# the build's largest error against float32, per output, may exceed eager's by this factor
MARGIN = 1.25
# float32 ulps of an output's largest magnitude a build may be off where eager is exact
SLACK_ULPS = 8
# weights widened to float32 at most (bytes): a larger graph is judged by the gate alone
MAX_WIDENED_BYTES = 2 << 30


def widened(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``gm`` computing in float32 where it computed in bf16/fp16, or None when its
    weights would take more than :data:`MAX_WIDENED_BYTES` in float32."""
    size = sum(t.numel() * 4 for t in _tensors(gm) if t.dtype in NARROW)
    if size > MAX_WIDENED_BYTES:
        return None
    wide = copy.deepcopy(gm)
    for module in wide.modules():
        for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if t.dtype in NARROW:
                setattr(module, name, torch.nn.Parameter(t.detach().float(), requires_grad=False)
                        if isinstance(t, torch.nn.Parameter) else t.detach().float())
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.dtype in NARROW:
                setattr(module, name, value.float())
    for node in wide.graph.nodes:
        node.args, node.kwargs = _wide(node.args), _wide(node.kwargs)
    wide.recompile()
    return wide


def nearer_than_eager(gm, inputs, eager: list, actual: list) -> dict | None:
    """``{"reference": "float32", "outputs": [...]}`` when every float output of ``actual``
    is no further from ``gm`` computed in float32 (on ``inputs``) than ``eager``'s is, times
    :data:`MARGIN`; None when some output is further, or the graph cannot be widened."""
    wide = widened(gm)
    if wide is None:
        return None
    try:
        with torch.no_grad():
            out = wide(*[t.float() if isinstance(t, torch.Tensor) and t.dtype in NARROW else t for t in inputs])
    except Exception:  # noqa: BLE001 - a graph that does not run widened is judged by the gate alone
        return None
    truth = list(out) if isinstance(out, (list, tuple)) else [out]
    outputs = []
    for t, e, a in zip(truth, eager, actual):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            continue
        if t.shape != e.shape or t.shape != a.shape:
            return None
        t64 = t.double()
        err_eager = (e.double() - t64).abs().max().item() if e.numel() else 0.0
        err_build = (a.double() - t64).abs().max().item() if a.numel() else 0.0
        # plus float32's own slack (an output eager computes in float32 from float32 values is
        # exact against the widened graph; a build may sum it in another order)
        slack = SLACK_ULPS * torch.finfo(torch.float32).eps * (t64.abs().max().item() if t.numel() else 0.0)
        outputs.append({"eager_error": err_eager, "build_error": err_build})
        if not err_build <= err_eager * MARGIN + slack:          # NaN fails too
            return None
    return {"reference": "float32", "margin": MARGIN, "outputs": outputs}


def _wide(value):
    if isinstance(value, torch.dtype):
        return torch.float32 if value in NARROW else value
    if isinstance(value, (list, tuple)):
        return type(value)(_wide(v) for v in value)
    if isinstance(value, dict):
        return {k: _wide(v) for k, v in value.items()}
    return value


def _tensors(gm):
    yield from gm.parameters()
    yield from gm.buffers()
    for module in gm.modules():
        yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))
