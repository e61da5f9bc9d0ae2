"""The captured graph(s), placed: which operations go to which engine partition, which
stay on the host, and the blockers that placement reveals.

One clean ``torch.export`` capture is what ``kiln.trace`` compiles; when that fails, each of
Dynamo's graphs (:mod:`kiln.port.probe`) is captured and placed on its own, so a model with a
graph break still gets every host op named at its line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from kiln.compiler.phases import plan
from kiln.graph.partition import describe_node, is_compute, op_name
from kiln.port import findings
from kiln.port.probe import origin
from kiln.progress import Progress


@dataclass
class Placed:
    """One graph as the picture and the report need it."""
    name: str
    engine: str                                     # the engine placement used
    nodes: list = field(default_factory=list)       # [{name, op, partition (int|None), where}]
    edges: list = field(default_factory=list)       # [(i, j)] between compute nodes
    partitions: list = field(default_factory=list)  # [{id, num_ops, engine}]
    total_ops: int = 0
    host_ops: int = 0
    notes: list = field(default_factory=list)


def place(captured, options, dynamo_gm=None) -> tuple:
    """Plan ``captured`` as ``kiln.trace`` would at ``options``; (Placed, blockers). Auto-cast
    is left to the compile: it rewrites the graph in place (casts inserted), and the compile
    that follows plans the same graph again; the engines each partition ended on come from
    the compiled model."""
    planned = plan(captured, dataclasses.replace(options, auto_cast="none"), Progress(quiet=True))
    placement, report = planned.placement, planned.report
    part_of = {n: i for i, nodes in enumerate(placement.partitions) for n in nodes}
    gm = captured.graph_module

    by_name = {n.name: n for n in dynamo_gm.graph.nodes} if dynamo_gm is not None else None

    def where(node):
        return origin(node, by_name) if by_name is not None else describe_node(node)["location"]

    placed = Placed(captured.model_name, planned.engine.name, total_ops=report.total_ops,
                    host_ops=report.host_ops, notes=list(report.notes))
    index = {}
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        index[node] = len(placed.nodes)
        placed.nodes.append({"name": node.name, "op": op_name(node.target), "partition": part_of.get(node),
                             "where": where(node)})
    for node, i in index.items():
        for user in node.users:
            if user in index:
                placed.edges.append((i, index[user]))
            else:   # through a getitem to its users
                placed.edges += [(i, index[u]) for u in user.users if u in index]
    placed.partitions = [{"id": i, "num_ops": sum(1 for n in nodes if is_compute(n)), "engine": planned.engine.name}
                         for i, nodes in enumerate(placement.partitions)]
    return placed, _blockers(gm, placement, report, where)


def _blockers(gm, placement, report, where) -> list:
    out = []
    first_at = {}
    for node in gm.graph.nodes:
        if is_compute(node) and not placement.on_device.get(node):
            first_at.setdefault(op_name(node.target), where(node))
    for u in report.unsupported_ops:
        out.append(findings.host_op(u["op"], u["reason"], u["count"], first_at.get(u["op"]),
                                    u.get("engine_unsupported", True)))
    seen = set()
    for node in gm.graph.nodes:
        if is_compute(node) and _new_unbacked(node) and op_name(node.target) not in seen:
            seen.add(op_name(node.target))
            out.append(findings.dynamic_shape(op_name(node.target), where(node)))
    return out


def _new_unbacked(node) -> bool:
    """Whether ``node`` makes a size from values (nonzero, unique), not merely passes one on."""
    made = free_unbacked_symbols(node.meta.get("val"))
    if not made:
        return False
    given = set()
    for arg in node.all_input_nodes:
        given |= free_unbacked_symbols(arg.meta.get("val"))
    return bool(made - given)
