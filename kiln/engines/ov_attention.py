"""Attention nodes decomposed one by one, for OpenVINO.

OpenVINO's fused ScaledDotProductAttention is wrong with grouped-query heads (keys and
values repeated by ``expand``; see :func:`kiln.engines.openvino._for_openvino`), so such a
partition gets torch's own core-ATen decomposition of SDPA. That used to be a re-trace of
the whole partition (``make_fx`` with the core-ATen table): for SmolLM2's 30-layer graphs
about two thirds of each OpenVINO build, to change 30 nodes out of some 2,500. Here each
SDPA node is traced alone (the same decomposition table, on inputs of its shapes) and its
decomposition put in its place; every other node stays as it was. The build is checked
against eager like any other.
"""
from __future__ import annotations

import torch


def decompose(gm: torch.fx.GraphModule, graph: torch.fx.Graph, chosen) -> torch.fx.GraphModule:
    """A GraphModule of ``graph`` (a copy of ``gm``'s graph, sharing its weights) where each
    node ``chosen(node)`` picks is replaced by its core-ATen decomposition."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    table = core_aten_decompositions()
    constants: dict = {}
    traced: dict = {}        # nodes alike (every layer's attention) share one trace
    for node in [n for n in graph.nodes if n.op == "call_function" and chosen(n)]:
        inputs = [a for a in node.all_input_nodes]
        key = (node.target, tuple((tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in inputs),
               repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: inputs.index(a))))
        if key not in traced:
            examples = [torch.zeros(a.meta["val"].shape, dtype=a.meta["val"].dtype) for a in inputs]

            def call(*values, node=node, inputs=inputs):
                env = dict(zip(inputs, values))
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
                return node.target(*args, **kwargs)

            with torch.no_grad():
                traced[key] = make_fx(call, decomposition_table=table)(*examples)
        sub = traced[key]
        env = {}
        placeholders = iter(inputs)
        with graph.inserting_before(node):
            for s in sub.graph.nodes:
                if s.op == "placeholder":
                    env[s] = next(placeholders)
                elif s.op == "get_attr":
                    name = f"_kiln_sdpa_{len(traced)}_{s.target}"
                    constants[name] = getattr(sub, s.target)
                    env[s] = graph.get_attr(name)
                    env[s].meta.update(s.meta)
                elif s.op == "output":
                    result = torch.fx.node.map_arg(s.args[0], lambda a: env[a])
                else:
                    env[s] = graph.node_copy(s, lambda a: env[a])
        node.replace_all_uses_with(result)
        graph.erase_node(node)
    graph.lint()
    attributes = {n.target: constants[n.target] if n.target in constants else _attribute(gm, n.target)
                  for n in graph.nodes if n.op == "get_attr"}
    return torch.fx.GraphModule(attributes, graph)


def _attribute(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module
