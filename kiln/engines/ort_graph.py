"""The small graph toolkit kiln's fusions of an optimised ONNX graph share
(:mod:`kiln.engines.ort_decoder`, :mod:`kiln.engines.ort_gqa`): producers and readers,
small constants, static shapes, and edits applied at once in a topological order."""
from __future__ import annotations

import collections
import heapq

import numpy as np

from kiln.engines import ort_rewrites

MS = "com.microsoft"


class Graph(ort_rewrites.GraphIndex):
    """:class:`~kiln.engines.ort_rewrites.GraphIndex` (producers, readers, static shapes)
    of an optimised graph, with edits: nodes added and removed are applied by
    :meth:`commit`, which also drops what nothing reads and restores a topological order."""

    def __init__(self, graph):
        from onnx import numpy_helper
        super().__init__(graph)
        self.nodes = list(graph.node)
        self.inits = self.initializers
        self.inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
        self.input_types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
        self.shapes.update(self.inputs)
        self._from_array = numpy_helper.from_array
        self.removed: set = set()
        self.added: list = []
        self._names = 0

    def const(self, name):
        """A small constant's value; None for a weight ORT saved as external data."""
        init = self.inits.get(name)
        if init is None or init.data_location == 1:
            return None
        return self._numpy(init)

    def op(self, name, op_type, domain=""):
        """The node producing ``name`` when it is ``op_type`` and not already replaced."""
        n = self.producer.get(name)
        if n is None or n.op_type != op_type or (n.domain or "") != domain or id(n) in self.removed:
            return None
        return n

    def users(self, name) -> list:
        return [n for n in self.consumers.get(name, []) if id(n) not in self.removed]

    def constant(self, array, hint: str) -> str:
        self._names += 1
        name = f"kiln_decoder/{hint}_{self._names}"
        self.graph.initializer.append(self._from_array(np.asarray(array), name))
        self.inits[name] = self.graph.initializer[-1]
        return name

    def fresh(self, hint: str) -> str:
        self._names += 1
        return f"kiln_decoder/{hint}_{self._names}"

    def add(self, op_type, inputs, outputs, domain="", **attrs):
        from onnx import helper
        node = helper.make_node(op_type, inputs, outputs, name=self.fresh(op_type), domain=domain, **attrs)
        self.added.append(node)
        for o in outputs:
            self.producer[o] = node
        for i in inputs:
            self.consumers[i].append(node)
        return node

    def add_output(self, name, shape, elem_type=1):
        """A new float (``elem_type`` 1) graph output ``name`` of static ``shape``."""
        from onnx import helper
        self.graph.output.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        self.outputs.add(name)

    def remove(self, *nodes):        # marked here, dropped by commit()
        self.removed.update(id(n) for n in nodes)

    def commit(self):
        nodes = [n for n in self.nodes + self.added if id(n) not in self.removed]
        nodes = live(nodes, self.outputs)
        del self.graph.node[:]
        self.graph.node.extend(topological(nodes, set(self.inputs) | set(self.inits)))
        read = {i for n in self.graph.node for i in n.input} | self.outputs
        ort_rewrites.drop_unread_initializers(self.graph, read)


def live(nodes, outputs) -> list:
    """``nodes`` less those whose outputs nothing reads (repeatedly)."""
    while True:
        read = {i for n in nodes for i in n.input} | outputs
        kept = [n for n in nodes if any(o in read for o in n.output if o)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept


def topological(nodes, available) -> list:
    """A topological order that keeps the given order wherever it can."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [sum(1 for i in set(n.input) if i in producer) for n in nodes]
    readers = collections.defaultdict(list)
    for k, n in enumerate(nodes):
        for i in set(n.input):
            if i in producer:
                readers[producer[i]].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for r in readers[k]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        raise ValueError("decoder fusions left a cycle in the graph")
    return order


def scalar(g, name):
    value = g.const(name)
    return None if value is None or value.size != 1 else float(value.reshape(()))


def attr(node, name, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def single_user(g, value, op_type):
    users = g.users(value)
    if len(users) != 1 or users[0].op_type != op_type or value in g.outputs:
        return None
    return users[0]


def target(g, reshape):
    """A ``Reshape``'s output shape with its ``-1`` and ``0`` resolved (from the input's
    static shape), or None where it is not known."""
    shape = g.const(reshape.input[1])
    if shape is None:
        return None
    shape = [int(d) for d in shape.reshape(-1)]
    source = g.shapes.get(reshape.input[0])
    if not attr(reshape, "allowzero", 0) and 0 in shape:
        if source is None:
            return None
        shape = [source[k] if d == 0 else d for k, d in enumerate(shape)]
    if -1 in shape:
        if source is None or shape.count(-1) != 1:
            return None
        known = int(np.prod([d for d in shape if d != -1]))
        if known == 0:
            return None
        shape[shape.index(-1)] = int(np.prod(source)) // known
    return shape
