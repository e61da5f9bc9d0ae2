"""Partition: split the captured graph into device partitions and host ops.

Supported ops are grouped into maximal partitions by torch.fx's
capability-based partitioner (which keeps the graph acyclic); everything else,
plus partitions smaller than ``min_partition_size`` and ops the user pinned to
the host, runs on the host with PyTorch. This is torch-neuron's fallback model.
"""
from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from kiln.graph import computed_indices, randomness, zero_divisors
from kiln.graph.explain import user_frame


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return getattr(target, "__name__", str(target))


def is_compute(node) -> bool:
    """Nodes that count as operations (getitem only unpacks tuples)."""
    return node.op == "call_function" and node.target is not operator.getitem


@dataclass
class Placement:
    """Where each op goes and why; the basis of analysis reports and partitioning."""
    on_device: dict = field(default_factory=dict)     # node -> True/False
    reasons: dict = field(default_factory=dict)       # node -> reason it is on the host
    unsupported: set = field(default_factory=set)     # nodes the engine cannot run at all
    partitions: list = field(default_factory=list)    # list of lists of nodes, graph order
    grouped: bool = False                             # partitions made (partition.group)


def takes(engine, node, unproven: set | None = None) -> str | None:
    """None if ``engine`` may run ``node``, else why not: what it supports, an operation
    that draws random numbers only where they come from PyTorch's generator, an integer
    division by a tensor only on eager's kernel (:mod:`kiln.graph.zero_divisors`), and an
    index the graph computes only on an engine that checks it unless it is proven in range
    (:mod:`kiln.graph.computed_indices`; ``unproven``: its verdict on the whole graph, where
    the caller has it)."""
    if not getattr(engine, "draws_from_torch", False):
        if randomness.draws(node):
            return randomness.WHY_HOST
        if node.meta.get(randomness.RELAYOUT):
            return randomness.WHY_RELAYOUT
    if getattr(engine, "name", None) != "eager" and zero_divisors.by_a_tensor(node):
        return zero_divisors.WHY_HOST
    if computed_indices.indexes(node) and (not getattr(engine, "checks_indices", False)
                                           or node.target in computed_indices.FROM_END_WHEN_COMPILED):
        if unproven is None:
            unproven = computed_indices.unproven(node.graph.owning_module)
        if node in unproven:
            return computed_indices.WHY_HOST
    return engine.supports(node)


class _Support(OperatorSupportBase):
    def __init__(self, decided):
        super().__init__()
        self.decided = decided

    def is_node_supported(self, submodules, node):
        return self.decided.get(node, False)


def place(gm: torch.fx.GraphModule, engine, options, *, grouped: bool = True) -> Placement:
    """Each operation's verdict on ``engine``, and (``grouped``) its device operations in
    partitions. A caller that may not need the partitions asks for the verdicts alone and
    calls :func:`group` when it does: grouping a bf16 BERT-4L training step's 1,910 nodes
    around the 699 ONNX Runtime leaves on the host took 2-3 s, for a graph that then went
    whole to Inductor (11-29)."""
    placement = Placement()
    host_ops = {_normalise(o) for o in options.ops_on_host}
    named = set()
    unproven = computed_indices.unproven(gm)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = op_name(node.target)
        if node.target is operator.getitem:
            placement.on_device[node] = True   # follows its producer (see below)
            continue
        packet = node.target._schema.name if isinstance(node.target, torch._ops.OpOverload) else name
        named.update({name, packet})
        if name in host_ops or packet in host_ops:
            placement.reasons[node] = "placed on the host by ops_on_host"
            placement.on_device[node] = False
            continue
        reason = takes(engine, node, unproven)
        placement.on_device[node] = reason is None
        if reason is not None:
            placement.reasons[node] = reason
            placement.unsupported.add(node)
    if host_ops - named:      # a misspelt name would otherwise keep nothing on the host, silently
        warnings.warn(f"kiln: ops_on_host names {', '.join(sorted(host_ops - named))}, which this graph has no "
                      f"operation of (names are ATen's, e.g. aten::relu; the graph's: "
                      f"{', '.join(sorted(n for n in named if '::' in n)[:12])}...)", stacklevel=2)
    # getitem of a host op stays on the host with it.
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            placement.on_device[node] = placement.on_device.get(src, False)
    if grouped or options.min_partition_size > 1:      # which may send small groups to the host
        group(gm, placement, options)
    return placement


def group(gm: torch.fx.GraphModule, placement: Placement, options) -> Placement:
    """``placement``'s device operations in partitions, once."""
    if placement.grouped:
        return placement
    placement.grouped = True
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    kept = []
    for nodes in _proposed(gm, placement):
        nodes = sorted(nodes, key=order.__getitem__)
        size = sum(1 for n in nodes if is_compute(n))
        if size == 0:
            continue
        if size < options.min_partition_size:
            for n in nodes:
                placement.on_device[n] = False
                if is_compute(n):
                    placement.reasons[n] = (f"in a device partition of {size} op(s), smaller than "
                                            f"min_partition_size={options.min_partition_size}")
            continue
        kept.append(nodes)
    kept.sort(key=lambda nodes: order[nodes[0]])
    placement.partitions = kept
    return placement


def _proposed(gm: torch.fx.GraphModule, placement: Placement) -> list:
    """Groups of device nodes: one group of all of them when every operation is on the
    device (nothing to keep acyclic around), else torch.fx's capability-based partitioner.
    The partitioner's cost grows faster than the graph: 7.6 s of a SmolLM2 compile per
    30-layer graph (~2,600 nodes), all of it spent finding the one partition."""
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if all(n.op == "call_function" and placement.on_device.get(n, False) for n in ops):
        return [ops] if ops else []
    partitioner = CapabilityBasedPartitioner(gm, _Support(placement.on_device),
                                             allows_single_node_partition=True)
    return [part.nodes for part in partitioner.propose_partitions()]


def _normalise(op) -> str:
    if isinstance(op, str):
        s = op.replace("torch.ops.", "")
        if "::" not in s and "." in s:                    # aten.sort.default -> aten::sort
            ns, rest = s.split(".", 1)
            s = f"{ns}::{rest.split('.')[0]}"
        return s.split(".")[0] if "::" in s else f"aten::{s}"   # a bare name is ATen's: relu -> aten::relu
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return op_name(op)


def split(gm: torch.fx.GraphModule, placement: Placement) -> torch.fx.GraphModule:
    """Fuse each partition into a ``fused_N`` submodule whose weights live inside it."""
    from torch.fx.passes.infra.partitioner import Partition
    partitions = [Partition(id=i, nodes=nodes) for i, nodes in enumerate(placement.partitions)]
    partitioner = CapabilityBasedPartitioner(gm, _Support(placement.on_device),
                                             allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitions)
    for node in list(fused.graph.nodes):
        if node.op == "call_module" and node.target.startswith("fused_"):
            _inline_constants(fused, node)
    fused.graph.eliminate_dead_code()
    fused.recompile()
    return fused


def _inline_constants(parent: torch.fx.GraphModule, call: torch.fx.Node):
    """Move weights (get_attr inputs) into the partition so engines see them as constants."""
    sub = parent.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    keep_args = []
    held = len(list(sub.named_buffers()))     # counted once: counting per weight was quadratic
    for ph, arg in zip(placeholders, call.args):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value = _fetch(parent, arg.target)
            while hasattr(sub, f"w_{held}"):   # a name taken (two names of one tensor count once)
                held += 1
            attr = f"w_{held}"
            sub.register_buffer(attr, value.detach())
            with sub.graph.inserting_before(ph):
                getter = sub.graph.get_attr(attr)
            ph.replace_all_uses_with(getter)
            sub.graph.erase_node(ph)
        else:
            keep_args.append(arg)
    call.args = tuple(keep_args)
    sub.graph.lint()
    sub.recompile()


def _fetch(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def describe_node(node) -> dict:
    return {"op": op_name(node.target), "node": node.name, "location": user_frame(node.meta.get("stack_trace"))}
