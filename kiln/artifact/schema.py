"""Load-time checks of an artifact's manifest: every field the runtime reads, with its type.

The blobs of an artifact are checked against the digests in its manifest, but
the manifest itself is taken as the JSON it is. So before the runtime reads a
field it is checked here (type, range, and that what it points at exists), and
a damaged or hand-edited manifest is refused with an :class:`ArtifactError`
naming the field, instead of failing later with a ``KeyError`` or
``TypeError`` (or at call time, or by allocating whatever a size says).

``check_container`` covers what every artifact has (blob table, kind, target);
``check_io`` and ``check_partitions`` what a compiled model reads; the host
program is checked by :func:`kiln.runtime.program.verify`, bucket and pipeline
metadata by their loaders with :func:`check_buckets` and :func:`check_pipeline`.
"""
from __future__ import annotations

import math

import torch

from kiln.errors import ArtifactError

MAX_DEPTH = 64          # nesting of structures and program arguments
MAX_DIM = 2 ** 62       # a dim size or count beyond any real tensor
MAX_ELEMENTS = 2 ** 40  # a tensor spec's element count beyond any real input (4 TiB of float32)


class Fail:
    """Raises ArtifactError for ``source`` naming the manifest field at fault."""

    def __init__(self, source: str):
        self.source = source

    def __call__(self, path: str, what: str):
        raise ArtifactError(f"{self.source}: manifest field {path} {what}; the artifact is corrupt "
                            "or was edited. Recompile the model or copy the file again")


def kind_of(value) -> str:
    """The JSON type of ``value``, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_TYPES = {"object": dict, "list": list, "string": str}


def need(fail: Fail, path: str, value, kind: str):
    """``value`` if it is of JSON ``kind`` (object, list, string, integer, number, scalar)."""
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind == "scalar":
        ok = value is None or isinstance(value, (bool, int, float, str))
    else:
        ok = isinstance(value, _TYPES[kind])
    if not ok:
        fail(path, f"must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not {kind_of(value)}")
    return value


def field(fail: Fail, obj: dict, key: str, path: str, kind: str, default=KeyError):
    """``obj[key]`` checked to be of ``kind``; missing: ``default``, or a failure."""
    where = f"{path}.{key}" if path else key
    if key not in obj:
        if default is KeyError:
            fail(where, "is missing")
        return default
    return need(fail, where, obj[key], kind)


def index(fail: Fail, path: str, value, n: int, what: str) -> int:
    need(fail, path, value, "integer")
    if not 0 <= value < n:
        fail(path, f"is {value}, but there {'is' if n == 1 else 'are'} {n} {what}")
    return value


def dtype(fail: Fail, path: str, value) -> torch.dtype:
    need(fail, path, value, "string")
    found = getattr(torch, value, None)
    if not isinstance(found, torch.dtype):
        fail(path, f"names no torch dtype ({value!r})")
    return found


# -- every artifact ------------------------------------------------------------------------------

def check_container(manifest: dict, source: str):
    """The blob table, kind, name and target: what reading and dispatching use."""
    fail = Fail(source)
    for name, meta in field(fail, manifest, "blobs", "", "object", {}).items():
        path = f"blobs[{name!r}]"
        need(fail, path, meta, "object")
        size = field(fail, meta, "size", path, "integer")
        if not 0 <= size < MAX_DIM:
            fail(f"{path}.size", f"is {size}")
        digests = [k for k in ("xxh3c", "crc32", "sha256") if k in meta]
        if not digests:
            fail(path, "has no digest (xxh3c, crc32 or sha256)")
        for k in digests:
            field(fail, meta, k, path, "integer" if k == "crc32" else "string")
    field(fail, manifest, "kind", "", "string", None)
    field(fail, manifest, "model_name", "", "string", None)
    for i, name in enumerate(field(fail, manifest, "shared_blobs", "", "list", [])):
        need(fail, f"shared_blobs[{i}]", name, "string")
    if manifest.get("cache") is not None:
        field(fail, manifest, "cache", "", "object")
    check_target(manifest.get("target", {}), source)


def check_target(target, source: str):
    fail = Fail(source)
    need(fail, "target", target, "object")
    if target.get("arch") is not None:
        field(fail, target, "arch", "target", "string")
    for i, feature in enumerate(field(fail, target, "isa", "target", "list", [])):
        need(fail, f"target.isa[{i}]", feature, "string")
    field(fail, target, "device", "target", "string", None)
    cuda = field(fail, target, "cuda", "target", "object", {})
    for key in ("name", "capability"):
        field(fail, cuda, key, "target.cuda", "string", None)


# -- compiled models -----------------------------------------------------------------------------

def check_specs(fail: Fail, value, path: str) -> list:
    """A list of tensor specs ``{name, shape, dtype}``."""
    need(fail, path, value, "list")
    for i, spec in enumerate(value):
        p = f"{path}[{i}]"
        need(fail, p, spec, "object")
        field(fail, spec, "name", p, "string")
        shape = field(fail, spec, "shape", p, "list")
        for d, size in enumerate(shape):
            need(fail, f"{p}.shape[{d}]", size, "integer")
            if not 0 <= size < MAX_DIM:
                fail(f"{p}.shape[{d}]", f"is {size}")
        if math.prod(shape) > MAX_ELEMENTS:     # what serving's warm-up and benchmarks would allocate
            fail(f"{p}.shape", f"is {shape}: {math.prod(shape)} elements, more than any real tensor ({MAX_ELEMENTS})")
        dtype(fail, f"{p}.dtype", field(fail, spec, "dtype", p, "string"))
        if "range" in spec:         # an indexing input's accepted range (kiln.graph.index_ranges)
            r = spec["range"]
            if not (isinstance(r, list) and len(r) in (3, 4) and all(type(x) is int for x in r[:2])
                    and isinstance(r[2], str) and r[0] < r[1] and (len(r) == 3 or type(r[3]) is int)):
                fail(f"{p}.range", f"is {r!r}, not [low, high, operator] (and an exempt value) with "
                     "integers low < high")
    return value


_NODES = ("t", "none", "const", "tuple", "list", "dict", "namedtuple", "model_output")


def check_structure(fail: Fail, node, path: str, leaves: list, depth: int = 0):
    """A structure tree (see kiln.artifact.specs); its tensor leaves are appended to ``leaves``."""
    if depth > MAX_DEPTH:
        fail(path, f"nests deeper than {MAX_DEPTH}")
    need(fail, path, node, "object")
    kinds = [k for k in _NODES if k in node]
    extra = set(node) - set(_NODES) - {"class"}
    if len(kinds) != 1 or extra:
        fail(path, f"must be one structure node ({', '.join(_NODES)}), has keys {sorted(node)}")
    kind = kinds[0]
    if kind == "t":
        leaves.append(need(fail, f"{path}.t", node["t"], "integer"))
    elif kind == "const":
        need(fail, f"{path}.const", node["const"], "scalar")
    elif kind in ("tuple", "list"):
        for i, sub in enumerate(need(fail, f"{path}.{kind}", node[kind], "list")):
            check_structure(fail, sub, f"{path}.{kind}[{i}]", leaves, depth + 1)
    elif kind != "none":
        seen = set()
        for i, item in enumerate(need(fail, f"{path}.{kind}", node[kind], "list")):
            p = f"{path}.{kind}[{i}]"
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
                fail(p, f"must be a [name, structure] pair, not {kind_of(item)}")
            if item[0] in seen:
                fail(p, f"repeats the key {item[0]!r}")
            seen.add(item[0])
            check_structure(fail, item[1], p, leaves, depth + 1)
        if kind != "dict":
            field(fail, node, "class", path, "string", None)


def check_io(manifest: dict, source: str):
    """``inputs`` and ``outputs``: names, structures and tensor specs that agree."""
    fail = Fail(source)
    for side in ("inputs", "outputs"):
        io = field(fail, manifest, side, "", "object")
        tensors = check_specs(fail, field(fail, io, "tensors", side, "list"), f"{side}.tensors")
        structure = field(fail, io, "structure", side, "object")
        leaves: list = []
        check_structure(fail, structure, f"{side}.structure", leaves)
        if leaves != list(range(len(tensors))):
            fail(f"{side}.structure", f"has tensor leaves {leaves[:8]}{'...' if len(leaves) > 8 else ''}, "
                 f"not one per entry of {side}.tensors ({len(tensors)}) in order")
    args = field(fail, manifest["inputs"], "args", "inputs", "list")
    for i, a in enumerate(args):
        need(fail, f"inputs.args[{i}]", a, "string")
    top = manifest["inputs"]["structure"]
    if "dict" not in top:
        fail("inputs.structure", "must be a dict of the model's arguments")
    names = [k for k, _ in top["dict"]]
    if names != args:
        fail("inputs.args", f"is {args}, but the input structure has arguments {names}")


def check_partitions(manifest: dict, blobs, source: str) -> list:
    """``partitions``: engine, blob (present), and I/O specs of each."""
    fail = Fail(source)
    parts = field(fail, manifest, "partitions", "", "list")
    for i, part in enumerate(parts):
        p = f"partitions[{i}]"
        need(fail, p, part, "object")
        field(fail, part, "engine", p, "string")
        blob = field(fail, part, "blob", p, "string")
        if blob not in blobs:
            fail(f"{p}.blob", f"names {blob!r}, which is not among the artifact's blobs")
        if "id" in part:
            need(fail, f"{p}.id", part["id"], "scalar")
        for j, kind in enumerate(field(fail, part, "nonfinite", p, "list", [])):
            if kind not in ("nan", "+inf", "-inf"):
                fail(f"{p}.nonfinite[{j}]", f"is {kind!r}, not 'nan', '+inf' or '-inf'")
        for side in ("inputs", "outputs"):
            check_specs(fail, field(fail, part, side, p, "list"), f"{p}.{side}")
    return parts


def check_model(manifest: dict, blobs, source: str):
    """What :class:`kiln.runtime.model.CompiledModel` reads (the program: ``program.verify``)."""
    check_io(manifest, source)
    check_partitions(manifest, blobs, source)
    field(Fail(source), manifest, "program", "", "object")


# -- wrappers -------------------------------------------------------------------------------------

def nested_blob(fail: Fail, value, path: str, blobs) -> str:
    need(fail, path, value, "string")
    if value not in blobs or not value.endswith(".kiln"):
        fail(path, f"names {value!r}, which is not a nested artifact in this one")
    return value


def check_buckets(manifest: dict, blobs, source: str) -> dict:
    """The ``buckets`` metadata of a bucketed model, before its variants are loaded."""
    fail = Fail(source)
    meta = field(fail, manifest, "buckets", "", "object")
    variants = field(fail, meta, "variants", "buckets", "list")
    if not variants:
        fail("buckets.variants", "is empty")
    axes = field(fail, meta, "axes", "buckets", "list")
    if not axes:
        fail("buckets.axes", "is empty")
    for k, v in enumerate(variants):
        p = f"buckets.variants[{k}]"
        need(fail, p, v, "object")
        nested_blob(fail, v.get("blob"), f"{p}.blob", blobs)
        sizes = field(fail, v, "sizes", p, "list")
        if len(sizes) != len(axes):
            fail(f"{p}.sizes", f"has {len(sizes)} sizes for {len(axes)} axes")
        for a, s in enumerate(sizes):
            need(fail, f"{p}.sizes[{a}]", s, "integer")
            if not 0 < s < MAX_DIM:
                fail(f"{p}.sizes[{a}]", f"is {s}")
    for a, ax in enumerate(axes):
        p = f"buckets.axes[{a}]"
        need(fail, p, ax, "object")
        members = field(fail, ax, "inputs", p, "list")
        if not members:
            fail(f"{p}.inputs", "is empty")
        for j, m in enumerate(members):
            if (not isinstance(m, list) or len(m) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_DIM for x in m)):
                fail(f"{p}.inputs[{j}]", "must be an [input, dim] pair of integers")
        sizes = field(fail, ax, "sizes", p, "list")
        if [v["sizes"][a] for v in variants] != sizes:
            fail(f"{p}.sizes", f"is {sizes}, but the variants' sizes on this axis are "
                 f"{[v['sizes'][a] for v in variants]}")
    for key, value in field(fail, meta, "pad_values", "buckets", "object").items():
        if not key.isdigit():
            fail(f"buckets.pad_values[{key!r}]", "must be keyed by an input index")
        if not isinstance(value, bool):
            need(fail, f"buckets.pad_values[{key!r}]", value, "number")
    for j, od in enumerate(field(fail, meta, "output_dims", "buckets", "list")):
        if (not isinstance(od, list) or len(od) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_DIM for x in od)):
            fail(f"buckets.output_dims[{j}]", "must be an [output, dim, axis] triple of integers")
        index(fail, f"buckets.output_dims[{j}][2]", od[2], len(axes), "axes")
    return meta


def check_pipeline(manifest: dict, blobs, source: str) -> dict:
    """The ``pipeline`` metadata, before its stages are loaded."""
    fail = Fail(source)
    check_io(manifest, source)
    meta = field(fail, manifest, "pipeline", "", "object")
    stages = field(fail, meta, "stages", "pipeline", "list")
    if not stages:
        fail("pipeline.stages", "is empty")
    n_inputs = len(manifest["inputs"]["tensors"])
    outputs_of = []

    def ref(r, path, before):
        if not isinstance(r, list) or not r or r[0] not in ("input", "stage"):
            fail(path, "must be ['input', i] or ['stage', k, j]")
        if r[0] == "input":
            if len(r) != 2:
                fail(path, "must be ['input', i]")
            index(fail, f"{path}[1]", r[1], n_inputs, "inputs")
        else:
            if len(r) != 3:
                fail(path, "must be ['stage', k, j]")
            index(fail, f"{path}[1]", r[1], before, "earlier stages")
            index(fail, f"{path}[2]", r[2], outputs_of[r[1]], f"outputs of stage {r[1]}")

    for k, st in enumerate(stages):
        p = f"pipeline.stages[{k}]"
        need(fail, p, st, "object")
        nested_blob(fail, st.get("blob"), f"{p}.blob", blobs)
        for j, r in enumerate(field(fail, st, "inputs", p, "list")):
            ref(r, f"{p}.inputs[{j}]", k)
        n = field(fail, st, "num_outputs", p, "integer")
        if not 0 <= n < MAX_DIM:
            fail(f"{p}.num_outputs", f"is {n}")
        outputs_of.append(n)
        field(fail, st, "cost_share", p, "number", 0.0)
    outs = field(fail, meta, "outputs", "pipeline", "list")
    if len(outs) != len(manifest["outputs"]["tensors"]):
        fail("pipeline.outputs", f"has {len(outs)} entries for {len(manifest['outputs']['tensors'])} "
             "output tensors")
    for j, r in enumerate(outs):
        ref(r, f"pipeline.outputs[{j}]", len(stages))
    return meta


def same_spec(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
