"""One copy of the weights that an artifact's ONNX Runtime graphs have in common.

Why: an LLM artifact holds a decode graph per batch size (and verify, chunk and window
graphs), each an ONNX Runtime partition with every weight of the model in its external
data. SmolLM2 int4's decode graphs for 1 and 8 rows carried the same 272 MB twice: 39 %
of a 696 MB file, twice the page cache, twice the reads.

How: :func:`share` takes the graphs' artifacts and moves the external data of their ONNX
Runtime partitions into one member of the enclosing artifact, ``shared/ort-<digest>.bin``,
each distinct range stored once (weights and ONNX Runtime's prepacked copies alike, found
by their bytes). Each partition keeps its graph, whose external-data offsets now point into
that member, and says so in its header (``pool``: the member's name); the graph's
manifest lists the member in ``shared_blobs``, which the loader resolves in the nearest
enclosing artifact (:meth:`kiln.artifact.container.Artifact.shared`). At load ONNX Runtime
maps each range where it lies in the file, so every session reads the same pages.

Nothing but bytes moves: a range is shared only where its bytes are equal, so each graph
reads exactly the weights it was compiled with. Artifacts that use a pool carry
:data:`POOLED_FORMAT`, which older kilns refuse with their upgrade message instead of
failing inside ONNX Runtime.
"""
from __future__ import annotations

import xxhash

from kiln.artifact.container import POOLED_FORMAT, Artifact
from kiln.engines import ort_blob
from kiln.errors import ArtifactError

PREFIX = "shared/ort-"
# bytes a pool must save to be used: each pooled graph costs up to a page of padding, and an
# artifact that needs no pool stays readable by kilns from before it (format 2)
MIN_SAVING = 64 << 10


def serialized(models: dict) -> tuple[dict, bool]:
    """``{name: loaded or compiled graph}`` -> ``({blob name: bytes}, pooled)``: the graphs'
    artifacts with their common ONNX Runtime weights stored once (:func:`share`; the member
    among the blobs) where every graph is a compiled one, each whole otherwise (a GPU's
    wrappers). An artifact that holds such blobs is written as :data:`POOLED_FORMAT`."""
    arts = {name: getattr(m, "_artifact", None) for name, m in models.items()}
    if None in arts.values():
        return {name: m.to_bytes() for name, m in models.items()}, False
    blobs, extra = share(arts)
    blobs.update(extra)
    return blobs, bool(extra)


def share(arts: dict) -> tuple[dict, dict]:
    """``{name: graph artifact}`` -> ``({name: artifact bytes}, {member: bytes})``: every
    graph's artifact serialized, its ONNX Runtime partitions reading their external data
    from the returned member, where ranges read twice or more (by two partitions, or twice by
    one) add up to :data:`MIN_SAVING`; the artifacts as they are (self-contained) otherwise."""
    parts = []                                         # (graph name, blob name, header, model, data)
    for name, art in arts.items():
        for part in art.manifest.get("partitions", []):
            blob = art.blobs.get(part.get("blob"))
            if part.get("engine") == "onnxruntime" and blob is not None and ort_blob.is_packed(blob):
                parts.append((name, part["blob"], *_external(art, blob)))
    found = []                                         # per partition: [(start, key, chunk)]
    uses, align = {}, {}
    for _, _, header, model, data in parts:
        found.append([])
        for start, length in _ranges(model):
            chunk = data[start:start + length]
            key = (xxhash.xxh3_128_digest(chunk), length)
            found[-1].append((start, key, chunk))
            uses[key] = uses.get(key, 0) + 1
            align[key] = max(align.get(key, 1), _alignment(start))   # the strictest any reader had
    saved = sum((n - 1) * key[1] for key, n in uses.items())
    if saved < MIN_SAVING:      # nothing in common, or too little to pay for the pages of padding
        return {name: art.self_contained().to_bytes() for name, art in arts.items()}, {}
    pool, placed, places = bytearray(), {}, []
    for ranges in found:
        places.append({})
        for start, key, chunk in ranges:
            if key not in placed:
                pool.extend(bytes(-len(pool) % align[key]))
                placed[key] = len(pool)
                pool.extend(chunk)
            places[-1][start] = placed[key]
    member = f"{PREFIX}{xxhash.xxh3_128_hexdigest(pool)}.bin"
    rebuilt = {name: dict(art.blobs) for name, art in arts.items()}
    for (name, blob_name, header, model, _), ranges in zip(parts, places):
        _point_at_pool(model, ranges)
        graph = model.SerializeToString()
        pooled = dict(header, graph=len(graph), data=0, pool=member, pool_size=len(pool))
        rebuilt[name][blob_name] = ort_blob.pack(pooled, graph, b"")
    out, pooled_graphs = {}, {p[0] for p in parts}
    for name, art in arts.items():
        if name not in pooled_graphs:
            out[name] = art.self_contained().to_bytes()
            continue
        manifest = dict(art.manifest, format_version=POOLED_FORMAT, shared_blobs=[member])
        blobs = {k: v for k, v in rebuilt[name].items() if not k.startswith(PREFIX)}
        out[name] = Artifact(manifest, blobs).to_bytes()
    return out, {member: bytes(pool)}


def _external(art, blob) -> tuple:
    """``(header, model, data)``: a partition's header, its graph parsed, and the bytes its
    external-data offsets index (its own data, or the pool it already reads from)."""
    import onnx
    header, graph, offset = ort_blob.unpack(blob)
    if header.get("pool"):
        found = art.shared(header["pool"])
        if found is None:
            raise ArtifactError(f"a graph reads its weights from {header['pool']}, which is not at hand: "
                                "save it from the model it was loaded with")
        data = memoryview(found[0]).cast("B")
    else:
        data = memoryview(blob).cast("B")[offset:offset + header["data"]]
    model = onnx.ModelProto()
    model.ParseFromString(graph)
    return header, model, data


def _entries(model):
    for init in model.graph.initializer:
        if init.external_data:
            yield init.external_data


def _ranges(model):
    """Every ``(offset, length)`` the graph reads from its external data: each initializer's,
    and each of ONNX Runtime's prepacked copies (``prepacked_i``: ``kernel|offset;length;…``)."""
    for entries in _entries(model):
        values = {e.key: e.value for e in entries}
        if "offset" in values:
            yield int(values["offset"]), int(values["length"])
        for key, value in values.items():
            if key.startswith("prepacked_"):
                yield ort_blob.prepacked_span(value)


def _point_at_pool(model, ranges: dict):
    """Rewrite the graph's offsets (``ranges``: old offset -> offset in the pool)."""
    for entries in _entries(model):
        for e in entries:
            if e.key == "offset":
                e.value = str(ranges[int(e.value)])
            elif e.key.startswith("prepacked_"):
                e.value = ort_blob.moved_prepacked(e.value, ranges.__getitem__)


def _alignment(offset: int) -> int:
    """The alignment a range had in its own data (the largest power of two dividing its
    offset, at most a page), kept in the pool, so each range is laid out at least as ONNX
    Runtime wrote it (it maps its external data; its kernels may rely on the alignment)."""
    return ort_blob.ALIGN if offset == 0 else min(ort_blob.ALIGN, offset & -offset)
