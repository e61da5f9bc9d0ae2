"""The weights an LLM's ONNX Runtime graphs have in common, stored once in its artifact
(kiln.runtime.ort_pool): each graph reads exactly the bytes it was compiled with, graphs
taken out of the LLM stay loadable, and readers that predate the layout refuse it."""
import json

import onnx
import pytest
import torch

pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.artifact import container  # noqa: E402
from kiln.artifact.container import Artifact  # noqa: E402
from kiln.engines import ort_blob
from kiln.runtime import ort_pool  # noqa: E402
from kiln.errors import ArtifactError  # noqa: E402
from tests.conftest import run_py  # noqa: E402
from tests.test_llm_decoder import PROMPTS  # noqa: E402


def _ort_parts(art):
    """{blob name: blob} of an artifact's ONNX Runtime partitions."""
    return {p["blob"]: art.blobs[p["blob"]] for p in art.manifest["partitions"] if p["engine"] == "onnxruntime"}


def _ranges(blob, data):
    """{initializer or prepacked entry: its bytes}, read through the graph's external data."""
    header, graph, _ = ort_blob.unpack(blob)
    model = onnx.load_from_string(graph)
    out = {}
    for init in model.graph.initializer:
        values = {e.key: e.value for e in init.external_data}
        if "offset" in values:
            start, n = int(values["offset"]), int(values["length"])
            out[init.name] = bytes(data[start:start + n])
        for key, value in values.items():
            if key.startswith("prepacked_"):
                start, n = (int(x) for x in value.partition("|")[2].split(";")[:2])
                out[init.name + "/" + key] = bytes(data[start:start + n])
    return out


@pytest.fixture(scope="module")
def pooled(tiny_llm):
    _, llm, path = tiny_llm
    return llm, Artifact.load(path), path


def test_the_decode_graphs_read_one_copy_of_their_common_weights(pooled):
    llm, outer, path = pooled
    members = [n for n in outer.blobs if n.startswith(ort_pool.PREFIX)]
    assert len(members) == 1, sorted(outer.blobs)
    pool = outer.blobs[members[0]]
    decode = [f"decode/{b}.kiln" for b in llm.decode]
    assert len(decode) >= 2
    own = 0
    for name in decode:
        inner = outer.nested(name, name)
        assert inner.manifest["shared_blobs"] == members
        assert inner.manifest["format_version"] == container.POOLED_FORMAT
        original = Artifact.from_bytes(llm.decode[int(name[7:-5])].to_bytes())
        for blob_name, blob in _ort_parts(inner).items():
            header, _, _ = ort_blob.unpack(blob)
            assert header["data"] == 0 and header["pool"] == members[0] and header["pool_size"] == len(pool)
            # each graph reads, range by range, the very bytes it was compiled with
            before = original.blobs[blob_name]
            h0, _, offset = ort_blob.unpack(before)
            mine = _ranges(before, memoryview(before)[offset:offset + h0["data"]])
            assert mine and _ranges(blob, pool) == mine
            own += h0["data"]
    assert len(pool) < own * 0.6        # stored once, not once per graph


def test_a_pooled_artifact_generates_the_same_tokens_in_a_fresh_process_and_saves_again(pooled, tmp_path):
    llm, _, path = pooled
    expected = llm.generate(PROMPTS, 8, stop_at_eos=False)
    again = tmp_path / "again.kiln"
    code = f"""
import json, kiln
m = kiln.load({str(path)!r})
print(json.dumps(m.generate({PROMPTS!r}, 8, stop_at_eos=False)))
m.save({str(again)!r})
print(json.dumps(kiln.load({str(again)!r}).generate({PROMPTS!r}, 8, stop_at_eos=False)))
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    assert first == expected and second == expected
    resaved = Artifact.load(again)
    assert sum(n.startswith(ort_pool.PREFIX) for n in resaved.blobs) == 1
    assert abs(again.stat().st_size - path.stat().st_size) < 4096


def test_a_graph_taken_out_of_the_llm_carries_its_weights(pooled, tmp_path):
    llm, _, path = pooled
    loaded = kiln.load(path)
    graph = tmp_path / "decode1.kiln"
    loaded.decode[1].save(str(graph))
    alone = Artifact.load(graph)
    assert alone.manifest["shared_blobs"][0] in alone.blobs
    inputs = _decode_inputs(llm)
    expected = llm.decode[1](*inputs)
    for got in (kiln.load(graph)(*inputs), kiln.load(loaded.decode[1].to_bytes())(*inputs)):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_pooled_graph_without_its_llm_or_an_older_reader_is_a_clear_error(pooled, monkeypatch):
    _, outer, path = pooled
    orphan = bytes(outer.blobs["decode/1.kiln"])       # the graph's bytes, without the LLM around them
    with pytest.raises(ArtifactError, match=r"reads its weights from shared/ort-.*load the whole artifact"):
        kiln.load(orphan)
    monkeypatch.setattr(container, "READS_FORMAT", 2)  # a kiln from before the layout
    with pytest.raises(ArtifactError, match="format 3 .*this kiln reads format 2 and older. Upgrade kiln"):
        kiln.load(path)


def test_a_small_saving_is_not_worth_a_pool(tmp_path):
    """Pooling a few kilobytes would cost more padding than it saves and make the artifact
    unreadable by older kilns: the tests' small MLP's buckets stay whole, format 2."""
    from tests import models
    model, x = models.mlp()
    compiled = kiln.trace(model, x, buckets=[torch.randn(1, 16), torch.randn(4, 16)], engine="onnxruntime",
                          cache=False, quiet=True)
    compiled.save(str(tmp_path / "small.kiln"))
    outer = Artifact.load(tmp_path / "small.kiln")
    assert not any(n.startswith(ort_pool.PREFIX) for n in outer.blobs)
    assert outer.manifest["format_version"] == container.FORMAT_VERSION


def test_a_lone_small_graph_stays_whole(pooled):
    llm, _, _ = pooled
    art = Artifact.from_bytes(llm.decode[1].to_bytes())
    out, extra = ort_pool.share({"only.kiln": art})
    assert extra == {}          # one tiny graph: under ort_pool.MIN_SAVING, whatever it repeats
    alone = Artifact.from_bytes(out["only.kiln"])
    assert "shared_blobs" not in alone.manifest and alone.manifest["format_version"] == container.FORMAT_VERSION
    assert {n: bytes(b) for n, b in alone.blobs.items()} == {n: bytes(b) for n, b in art.blobs.items()}


def _decode_inputs(llm):
    """One decode step's inputs for one row: a token, its position and an empty cache."""
    layers, _, heads, window, dim = llm.meta["cache_shape"]
    cache = [torch.zeros(1, heads, window, dim) for _ in range(2 * layers)]
    valid = torch.zeros(1, window, dtype=torch.bool)
    valid[0, :1] = True
    return [torch.tensor([[5]]), torch.tensor([[0]]), *cache, valid]


def test_bucket_variants_share_their_weights_and_load_in_a_fresh_process(tmp_path):
    """A bucketed model's variants (one graph per shape, the same weights) are pooled too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16)).eval()
    x = torch.randn(2, 16)
    compiled = kiln.trace(model, x, buckets=[torch.randn(1, 16), torch.randn(4, 16)], engine="onnxruntime",
                          optlevel=2, cache=False, quiet=True)
    path = tmp_path / "bucketed.kiln"
    compiled.save(str(path))
    outer = Artifact.load(path)
    members = [n for n in outer.blobs if n.startswith(ort_pool.PREFIX)]
    assert len(members) == 1 and outer.manifest["format_version"] == container.POOLED_FORMAT
    whole = sum(len(v.to_bytes()) for v in compiled.variants)
    assert path.stat().st_size < 0.75 * whole
    code = f"""
import torch, kiln
m = kiln.load({str(path)!r})
torch.manual_seed(1)
for n in (1, 3, 4):
    x = torch.randn(n, 16)
    torch.save((x, m(x)), {str(tmp_path)!r} + f"/out{{n}}.pt")
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    for n in (1, 3, 4):
        x, got = torch.load(tmp_path / f"out{n}.pt")
        torch.testing.assert_close(got, compiled(x), rtol=0, atol=0)


def test_a_blob_packed_from_its_weights_file_is_the_blob_packed_from_bytes(tmp_path):
    """The engine reads its weights file straight into the blob (a 540 MB copy fewer per
    SmolLM2 graph): the same bytes as packing them from memory, and a file shorter than its
    header says is an error, never a blob with zeros where weights belong."""
    data = bytes(range(256)) * 41 + b"tail"
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    header = {"graph": 5, "data": len(data), "prepacked": False}
    from_file = ort_blob.pack(header, b"graph", data_file=str(path))
    assert bytes(from_file) == ort_blob.pack(header, b"graph", data)
    got, graph, offset = ort_blob.unpack(from_file)
    assert graph == b"graph" and offset % ort_blob.ALIGN == 0 and bytes(from_file[offset:]) == data
    path.write_bytes(data[:-10])
    with pytest.raises(OSError, match=f"ended after {len(data) - 10} of its {len(data)} bytes"):
        ort_blob.pack(header, b"graph", data_file=str(path))
