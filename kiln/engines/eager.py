"""The eager engine: the partition run by PyTorch itself, op by op.

The reference engine: it runs every ATen operator exactly as PyTorch does, so
its answers are eager's, and it is what other engines are held to. It is not
in the default order (kiln picks it only when named, ``engine="eager"``), and
it is what a PyTorch device will run partitions no compiler takes.

The blob is data, not code: the partition's graph as JSON (each node's ATen
operator by name, its arguments as tagged JSON values) and its weights as
safetensors. Loading resolves operator names only among ``torch.ops.aten``'s
operators, keyword names only among the operator's declared arguments, and
values only among a fixed set of types (numbers, strings, dtypes, devices,
layouts, memory formats), so a blob can call ATen operators and nothing else:
no pickle, no Python from the file (the code fx generates from the graph is
made of those checked names and the values' ``repr``), hence ``native_code``
is False and unsigned artifacts load. Operators that touch files or storages
(``from_file``, ``save``, ``set_`` from a Storage: :mod:`kiln.engines.safe_ops`, the
host program's rule too) are refused both ways.

A call runs the rebuilt GraphModule under ``no_grad``, with the runtime's
thread count set for the calling thread only (``kiln.engines.openmp``). The
module only reads its weights, so threads may call it at once. Outputs that
share memory with an input or a weight are copied, as other engines' are
fresh tensors.

Blob layout: ``b"KILNEAG1"``, a little-endian uint32 header length, a JSON
header (``torch``: the version that wrote it; ``inputs``: [shape, dtype] per
input; ``nodes``: the graph), then the safetensors bytes of the weights.
"""
from __future__ import annotations

import json
import operator
import re
import struct

import torch

from kiln.engines import openmp, safe_ops
from kiln.engines.base import Engine
from kiln.errors import ArtifactError

_MAGIC = b"KILNEAG1"
_OP = re.compile(r"^aten\.(?!__)(\w+)\.(\w+)$")
_CONSTANT = re.compile(r"^c\d+$")


class EagerEngine(Engine):
    name = "eager"
    draws_from_torch = True  # it is PyTorch
    checks_indices = True
    title = "PyTorch eager"
    devices = ("cpu",)
    priority: dict = {}          # not a default candidate: chosen only when named
    package = "torch"
    modules = ("torch", "safetensors")
    blob_suffix = ".eager"

    def version(self) -> str:
        return torch.__version__

    def supports(self, node) -> str | None:
        reason = self.not_aten(node)
        target = node.target
        if reason is not None or not isinstance(target, torch._ops.OpOverload):
            return reason            # an ATen-less node it may still take: tuple unpacking
        refused = safe_ops.refusal(target)
        if refused is not None:
            return f"the eager engine runs only operators that compute: {refused}"
        try:
            _Encoder().value((node.args, tuple(node.kwargs.values())))
        except TypeError as e:
            return str(e)
        return None

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        if variant is not None:
            raise ValueError(f"unknown eager variant {variant!r}")
        if getattr(options, "device", "cpu") == "cuda":
            raise RuntimeError("the eager engine runs partitions on the CPU")
        if getattr(options, "quantize", None):
            raise RuntimeError("the eager engine does not quantize")
        for node in partition.graph.nodes:
            reason = node.op == "call_function" and self.supports(node)
            if reason:
                raise RuntimeError(f"{node.target} cannot run on the eager engine: {reason}")
        encoder = _Encoder(partition)
        nodes = [encoder.node(n) for n in partition.graph.nodes]
        header = {"torch": torch.__version__, "nodes": nodes,
                  "inputs": [[list(t.shape), _dtype_name(t.dtype)] for t in example_inputs]}
        return _pack(header, encoder.weights())

    def load(self, blob, runtime_options, origin=None, shared=None):
        header, weights = _unpack(blob)
        try:
            module = _rebuild(header["nodes"], weights)
            inputs = [(tuple(int(d) for d in shape), _dtype(name)) for shape, name in header["inputs"]]
        except ArtifactError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
            raise ArtifactError(f"kiln eager blob (torch {header.get('torch')}) cannot be rebuilt "
                                f"by torch {torch.__version__}: {type(e).__name__}: {e}") from None
        return EagerRunner(module, inputs, runtime_options.resolved_threads())


# -- the graph as data ------------------------------------------------------------

class _Encoder:
    """fx nodes and their arguments as tagged JSON values; tensors become named weights."""

    def __init__(self, module=None):
        self.module = module
        self.index: dict = {}           # fx node -> its position
        self.tensors: dict = {}         # id(tensor) -> (name, tensor)

    def node(self, n) -> dict:
        self.index[n] = len(self.index)
        if n.op == "placeholder":
            return {"op": "placeholder"}
        if n.op == "get_attr":
            return {"op": "get_attr", "target": self.tensor(_fetch(self.module, n.target))}
        if n.op == "output":
            return {"op": "output", "args": self.value(n.args[0])}
        if n.op != "call_function":
            raise RuntimeError(f"the eager engine cannot store a {n.op} node ({n.target})")
        target = "getitem" if n.target is operator.getitem else str(n.target)
        return {"op": "call_function", "target": target, "args": self.value(list(n.args)),
                "kwargs": {str(k): self.value(v) for k, v in n.kwargs.items()}}

    def tensor(self, t) -> str:
        if id(t) not in self.tensors:
            self.tensors[id(t)] = (f"c{len(self.tensors)}", t)
        return self.tensors[id(t)][0]

    def weights(self) -> dict:
        # safetensors stores each tensor's own bytes: no views, no shared storage
        return {name: t.detach().contiguous().clone() for name, t in self.tensors.values()}

    def value(self, v):
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if v == v and abs(v) != float("inf") else {"float": repr(v)}
        if isinstance(v, torch.fx.Node):
            if v not in self.index:
                if self.module is None:
                    return {"node": -1}     # supports(): only the argument's kind matters
                raise RuntimeError(f"node {v.name} is used before it is defined")
            return {"node": self.index[v]}
        if isinstance(v, (list, tuple)):
            return {"tuple" if isinstance(v, tuple) else "list": [self.value(x) for x in v]}
        if isinstance(v, torch.dtype):
            return {"dtype": _dtype_name(v)}
        if isinstance(v, torch.device):
            return {"device": str(v)}
        if isinstance(v, (torch.layout, torch.memory_format)):
            return {type(v).__name__: str(v).removeprefix("torch.")}
        if isinstance(v, complex):
            return {"complex": [self.value(v.real), self.value(v.imag)]}
        if isinstance(v, torch.Tensor) and self.module is not None:
            return {"tensor": self.tensor(v)}
        if isinstance(v, torch.Tensor):
            return None
        raise TypeError(f"an argument of type {type(v).__name__} cannot be stored as data")


def _rebuild(nodes: list, weights: dict) -> torch.fx.GraphModule:
    """The GraphModule the encoded nodes describe; every name is checked, nothing executed."""
    root = torch.nn.Module()
    for name, tensor in weights.items():
        if not _CONSTANT.match(name):
            raise ArtifactError(f"kiln eager blob has a weight named {name!r}")
        root.register_buffer(name, tensor)
    graph, made = torch.fx.Graph(), []
    for i, spec in enumerate(nodes):
        op = spec["op"]
        if op == "placeholder":
            made.append(graph.placeholder(f"in{len(made)}"))
        elif op == "get_attr":
            if spec["target"] not in weights:
                raise ArtifactError(f"kiln eager blob's node {i} reads a missing weight")
            made.append(graph.get_attr(spec["target"]))
        elif op == "call_function":
            op = _operator(spec["target"])
            args, kwargs = _decode(spec["args"], made), _keywords(op, spec["kwargs"], made)
            made.append(graph.call_function(op, tuple(args), kwargs))
        elif op == "output" and i == len(nodes) - 1:
            graph.output(_decode(spec["args"], made))
        else:
            raise ArtifactError(f"kiln eager blob has a node {i} of kind {op!r}")
    return torch.fx.GraphModule(root, graph)


def _operator(name: str):
    if name == "getitem":
        return operator.getitem
    match = _OP.match(str(name))
    if not match:
        raise ArtifactError(f"kiln eager blob calls {name!r}, which is not an ATen operator it runs")
    overload = getattr(getattr(torch.ops.aten, match.group(1)), match.group(2))
    if not isinstance(overload, torch._ops.OpOverload) or overload.namespace != "aten":
        raise ArtifactError(f"kiln eager blob calls {name!r}, which is not an ATen operator")
    return safe_ops.check(overload, "kiln eager blob")     # the host program's rule


def _keywords(op, raw: dict, made) -> dict:
    """Keyword arguments, each named in the operator's schema: fx writes their names into
    the code it generates, so a name must be one the operator declares, not any string."""
    allowed = {a.name for a in op._schema.arguments} if op is not operator.getitem else set()
    if not isinstance(raw, dict) or any(k not in allowed or not k.isidentifier() for k in raw):
        raise ArtifactError(f"kiln eager blob passes {op} keywords it does not take: {str(raw)[:80]}")
    return {k: _decode(v, made) for k, v in raw.items()}


_TAGS = {
    "float": lambda v, made: float(v) if v in ("inf", "-inf", "nan") else _bad(v),
    "node": lambda v, made: made[v] if isinstance(v, int) and 0 <= v < len(made) else _bad(v),
    "list": lambda v, made: [_decode(x, made) for x in v],
    "tuple": lambda v, made: tuple(_decode(x, made) for x in v),
    "dtype": lambda v, made: _dtype(v),
    "device": lambda v, made: torch.device(v),
    "layout": lambda v, made: _torch_value(v, torch.layout),
    "memory_format": lambda v, made: _torch_value(v, torch.memory_format),
    "complex": lambda v, made: complex(_decode(v[0], made), _decode(v[1], made)),
}


def _decode(v, made):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        (tag, value), = v.items()
        if tag in _TAGS:
            return _TAGS[tag](value, made)
    return _bad(v)


def _bad(v):
    raise ArtifactError(f"kiln eager blob holds a value it cannot decode: {str(v)[:80]}")


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name):
    return _torch_value(name, torch.dtype)


def _torch_value(name, kind):
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, kind):
        raise ArtifactError(f"kiln eager blob names {name!r}, which is not a torch {kind.__name__}")
    return value


def _fetch(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise RuntimeError(f"get_attr {target} is a {type(obj).__name__}, not a tensor")
    return obj


# -- blob -----------------------------------------------------------------------

def _pack(header: dict, weights: dict) -> bytes:
    from safetensors.torch import save
    raw = json.dumps(header, sort_keys=True).encode()
    return b"".join([_MAGIC, struct.pack("<I", len(raw)), raw, save(weights) if weights else b""])


def _unpack(blob) -> tuple[dict, dict]:
    from safetensors.torch import load
    view = memoryview(blob)
    start = len(_MAGIC) + 4
    if len(view) < start or bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise ArtifactError("not a kiln eager blob (bad magic)")
    (size,) = struct.unpack("<I", view[len(_MAGIC):start])
    try:
        header = json.loads(bytes(view[start:start + size]))
        rest = bytes(view[start + size:])
        weights = load(rest) if rest else {}
    except Exception as e:  # noqa: BLE001 - json and safetensors raise their own kinds
        raise ArtifactError(f"kiln eager blob is corrupt: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise ArtifactError("kiln eager blob has a corrupt header")
    return header, weights


# -- run ------------------------------------------------------------------------

class EagerRunner:
    """Calls the rebuilt partition with a list of tensors; safe from several threads."""

    def __init__(self, module, inputs: list, threads: int):
        self.module, self.inputs, self.threads = module, inputs, threads
        self._weights = {t.untyped_storage().data_ptr() for t in module.buffers()}

    def signature(self):
        """Inputs' (shape, dtype) as compiled; outputs' count is the graph's."""
        out = next(n for n in reversed(self.module.graph.nodes) if n.op == "output").args[0]
        count = len(out) if isinstance(out, (list, tuple)) else 1
        return list(self.inputs), [(None, None)] * count

    def __call__(self, inputs):
        with torch.no_grad(), openmp.threads(self.threads):
            out = self.module(*inputs)
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        shared = self._weights | {t.untyped_storage().data_ptr() for t in inputs}
        return [t.clone() if t.untyped_storage().data_ptr() in shared else t for t in outs]
