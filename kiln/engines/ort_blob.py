"""The ONNX Runtime engine's blob: its layout, and how its external data is found.

Blob layout: ``b"KILNORT2"``, a little-endian uint32 header length, a JSON
header (``graph``: size of the ONNX graph; ``data_offset``, ``data``: where
the external data starts, page-aligned, and its size; ``prepacked``;
``isa``; ``onnxruntime``: the version that wrote it), the graph, zero padding,
the data; ``opset``, the ONNX opset the partition was exported at (absent before issue 16); a
``transformers`` build adds ``variant`` and ``fused`` (fused op counts; older ones also
``rewrites``); ``rewritten``, what :mod:`kiln.engines.ort_rewrites` rewrote (absent before
issue 17, and where nothing matched). Blobs of older kilns are a plain ONNX model and still load.
A blob whose data lies in a member shared with other graphs (:mod:`kiln.runtime.ort_pool`)
has ``data`` 0, ``pool`` (the member's name) and ``pool_size``; its graph's offsets index
that member.
"""
from __future__ import annotations

import json
import struct

from kiln.errors import ArtifactError

MAGIC = b"KILNORT2"
ALIGN = 4096


def is_packed(blob) -> bool:
    """Whether ``blob`` is this engine's current blob layout (header, graph, data)."""
    return bytes(blob[:len(MAGIC)]) == MAGIC


def pack(header: dict, graph: bytes, data: bytes = b"", *, data_file: str | None = None):
    """The blob; ``data_offset`` has a fixed width so the header's size does not depend on it.

    ``data_file``: the data is that file's (``header["data"]`` bytes), read straight into its
    place in the blob. Read into a buffer of its own and then joined, a 540 MB graph's weights
    were allocated and copied twice (2.3 s a graph of SmolLM2's float32 build, at an hour when
    a fresh page cost these VMs ~15 µs to fault in); the blob is then a ``bytearray``, which every reader of
    blobs takes as it takes the read-only views of a loaded artifact."""
    head = len(MAGIC) + 4
    size = len(json.dumps(dict(header, data_offset="0" * 12), sort_keys=True).encode())
    offset = -(-(head + size + len(graph)) // ALIGN) * ALIGN
    raw = json.dumps(dict(header, data_offset=f"{offset:012d}"), sort_keys=True).encode()
    padding = offset - (head + len(raw) + len(graph))
    if data_file is None:
        return b"".join([MAGIC, struct.pack("<I", len(raw)), raw, graph, bytes(padding), data])
    length = int(header["data"])
    blob = bytearray(offset + length)
    blob[:offset] = b"".join([MAGIC, struct.pack("<I", len(raw)), raw, graph, bytes(padding)])
    with open(data_file, "rb") as f:
        view = memoryview(blob)[offset:]
        done = 0
        while done < length:
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{data_file} ended after {done} of its {length} bytes while the blob was packed")
            done += n
    return blob


def unpack(blob):
    view = memoryview(blob)
    head = len(MAGIC) + 4
    try:
        (size,) = struct.unpack("<I", view[len(MAGIC):head])
        header = json.loads(bytes(view[head:head + size]))
        offset = int(header["data_offset"])
        graph = bytes(view[head + size:head + size + header["graph"]])
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ArtifactError(f"kiln ONNX Runtime blob has a corrupt header: {e}") from None
    if len(graph) != header["graph"] or offset + header["data"] > len(view):
        raise ArtifactError("kiln ONNX Runtime blob is shorter than its header says")
    return header, graph, offset


def relocate(graph: bytes, location: str, base: int, keep_prepacked: bool,
             stored: str = "weights.bin", size: int | None = None) -> bytes:
    """Point the graph's external data at ``location`` + ``base``; drop the prepacked
    entries unless they were made for this host's kernels.

    Every tensor of the graph is visited (initializers, node attributes such as a
    Constant's value, subgraphs, sparse tensors, functions): each one with external data
    must name the blob's own data (``stored``, what the compile wrote) within its ``size``
    bytes (the engine's load always says), or the blob is refused. ONNX Runtime reads an external-data location relative to
    the folder it is told (the artifact's), so a tensor left naming ``.ssh/id_rsa`` or
    ``/etc/passwd`` read that file into the model's outputs before."""
    import onnx
    model = onnx.ModelProto()
    model.ParseFromString(graph)
    for tensor in external_tensors(model):
        values = _checked(tensor, stored, size)
        entries = []
        for e in tensor.external_data:
            key, value = e.key, e.value
            if key == "location":
                value = location
            elif key == "offset":
                value = str(int(value) + base)
            elif key.startswith("prepacked_"):
                if not keep_prepacked:
                    continue
                value = moved_prepacked(value, lambda offset: offset + base)
            entries.append((key, value))
        if "offset" not in values:
            entries.append(("offset", str(base)))
        del tensor.external_data[:]
        for key, value in entries:
            tensor.external_data.add(key=key, value=value)
    return model.SerializeToString()


def refuse_external(graph: bytes) -> None:
    """An older kiln's plain ONNX blob holds its weights inline: refuse one whose tensors
    name external data (ONNX Runtime would read it from the working directory)."""
    import onnx
    model = onnx.ModelProto()
    model.ParseFromString(graph)
    for tensor in external_tensors(model):
        location = next((e.value for e in tensor.external_data if e.key == "location"), None)
        raise ArtifactError(f"kiln ONNX Runtime blob's tensor {tensor.name!r} reads external data "
                            f"from {location!r}; a blob without kiln's own data may name none: "
                            "the artifact was edited or is not kiln's")


def external_tensors(model):
    """Each tensor of ``model`` that has external data, wherever it lies."""
    import onnx
    external = onnx.TensorProto.EXTERNAL
    return [t for t in _tensors(model) if t.data_location == external or len(t.external_data)]


def _tensors(model):
    def graph(g):
        yield from g.initializer
        for sparse in g.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        yield from nodes(g.node)

    def nodes(ns):
        for node in ns:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                for sparse in [a.sparse_tensor] * a.HasField("sparse_tensor") + list(a.sparse_tensors):
                    yield from (sparse.values, sparse.indices)
                if a.HasField("g"):
                    yield from graph(a.g)
                for g in a.graphs:
                    yield from graph(g)

    yield from graph(model.graph)
    for f in model.functions:
        yield from nodes(f.node)


_KEYS = ("location", "offset", "length", "checksum")


def _checked(tensor, stored: str, size: int | None) -> dict:
    """``tensor``'s external-data entries, refused unless they name the blob's own data."""
    values = {e.key: e.value for e in tensor.external_data}
    where = f"kiln ONNX Runtime blob's tensor {tensor.name!r}"
    if values.get("location") != stored:
        raise ArtifactError(f"{where} reads external data from {values.get('location')!r}, not from "
                            "the blob's own data: the artifact was edited or is not kiln's")
    spans, size = [], float("inf") if size is None else size
    try:
        spans.append((int(values.get("offset", 0)), int(values.get("length", 0))))
        spans += [prepacked_span(v) for k, v in values.items() if k.startswith("prepacked_")]
    except (ValueError, IndexError):
        raise ArtifactError(f"{where} has a corrupt external-data entry") from None
    unknown = [k for k in values if k not in _KEYS and not k.startswith("prepacked_")]
    if unknown or any(o < 0 or n < 0 or o + n > size for o, n in spans):
        raise ArtifactError(f"{where} reads outside the blob's own data ({size} bytes) or has "
                            f"unknown entries {unknown}: the artifact was edited or is not kiln's")
    return values


def prepacked_span(value: str) -> tuple[int, int]:
    """``(offset, length)`` of a prepacked entry's value (``kernel|offset;length;...``, as
    ONNX Runtime writes it beside its external data)."""
    offset, length = value.partition("|")[2].split(";")[:2]
    return int(offset), int(length)


def moved_prepacked(value: str, move) -> str:
    """A prepacked entry's value with its offset ``move(offset)``."""
    kernel, _, span = value.partition("|")
    offset, _, rest = span.partition(";")
    return f"{kernel}|{move(int(offset))};{rest}"


def pooled_data(header, shared) -> tuple:
    """``(data, origin, offset)`` of the shared weights a pooled partition reads
    (:mod:`kiln.runtime.ort_pool`), or a clear error where they cannot be found."""
    found = shared(header["pool"]) if shared is not None else None
    if found is None:
        raise ArtifactError(f"this ONNX Runtime partition reads its weights from {header['pool']}, a "
                            "member of the artifact that held it, which is missing here: load the "
                            "whole artifact (the LLM's or bucketed model's .kiln), not the graph cut out of it")
    data, origin = found
    if len(data) != header.get("pool_size"):
        raise ArtifactError(f"{header['pool']} holds {len(data)} bytes where the partition expects "
                            f"{header.get('pool_size')}: the artifact is corrupt or was edited")
    return memoryview(data).cast("B"), origin, 0
