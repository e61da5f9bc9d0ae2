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


def pack(header: dict, graph: bytes, data: bytes) -> bytes:
    """The blob; ``data_offset`` has a fixed width so the header's size does not depend on it."""
    head = len(MAGIC) + 4
    size = len(json.dumps(dict(header, data_offset="0" * 12), sort_keys=True).encode())
    offset = -(-(head + size + len(graph)) // ALIGN) * ALIGN
    raw = json.dumps(dict(header, data_offset=f"{offset:012d}"), sort_keys=True).encode()
    padding = offset - (head + len(raw) + len(graph))
    return b"".join([MAGIC, struct.pack("<I", len(raw)), raw, graph, bytes(padding), data])


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


def relocate(graph: bytes, location: str, base: int, keep_prepacked: bool) -> bytes:
    """Point the graph's external data at ``location`` + ``base``; drop the prepacked
    entries unless they were made for this host's kernels."""
    import onnx
    model = onnx.ModelProto()
    model.ParseFromString(graph)
    for init in model.graph.initializer:
        if not init.external_data:
            continue
        entries = []
        for e in init.external_data:
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
        del init.external_data[:]
        for key, value in entries:
            init.external_data.add(key=key, value=value)
    return model.SerializeToString()


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
