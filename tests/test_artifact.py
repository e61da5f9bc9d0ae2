"""The .kiln file: round trip, integrity checks, target checks, atomic writes."""
import json
import os
import zipfile

import pytest
import torch

import kiln
from kiln.artifact.container import Artifact, FORMAT_VERSION, READS_FORMAT
from kiln.atomic import write_atomic
from tests import models
from tests.conftest import assert_close, run_py


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    model, x = models.mlp()
    compiled = kiln.trace(model, x)
    path = tmp_path_factory.mktemp("art") / "mlp.kiln"
    compiled.save(path)
    return path, model, x


def _rewrite(src, dst, edit_manifest=None, edit_blob=None):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.namelist():
            if item == "signature.json" and edit_manifest:
                continue   # an edited manifest is no longer the signed one (older kilns signed nothing)
            data = zin.read(item)
            if item == "manifest.json" and edit_manifest:
                m = json.loads(data)
                edit_manifest(m)
                data = json.dumps(m).encode()
            elif item not in ("manifest.json", "signature.json") and edit_blob:
                data = edit_blob(item, data)
            zout.writestr(item, data)


def test_manifest_contents(mlp_artifact):
    path, _, _ = mlp_artifact
    with zipfile.ZipFile(path) as z:
        m = json.loads(z.read("manifest.json"))
        names = z.namelist()
    assert m["format"] == "kiln-artifact" and m["format_version"] == FORMAT_VERSION
    assert m["kiln_version"] == kiln.__version__
    assert m["engine"]["name"] == "onnxruntime" and m["engine"]["version"]
    assert m["target"]["arch"] and isinstance(m["target"]["isa"], list)
    assert m["compile_options"]["optlevel"] == 2
    assert m["inputs"]["tensors"] == [{"name": "x", "shape": [2, 16], "dtype": "float32"}]
    assert m["outputs"]["tensors"][0]["shape"] == [2, 4]
    for name, meta in m["blobs"].items():
        assert name in names and len(meta["sha256"]) == 64
    assert not any(n.endswith((".pkl", ".pt")) for n in names)  # nothing pickled


def test_round_trip(mlp_artifact):
    path, model, x = mlp_artifact
    loaded = kiln.load(path)
    assert_close(loaded(x), model(x).detach())
    assert_close(kiln.load(path.read_bytes())(x), model(x).detach())


def test_load_in_fresh_process_without_model_code(mlp_artifact):
    path, model, x = mlp_artifact
    torch.save(x, path.parent / "x.pt")
    torch.save(model(x).detach(), path.parent / "y.pt")
    code = f"""
import sys, torch, kiln
m = kiln.load({str(path)!r})
x = torch.load({str(path.parent / 'x.pt')!r}); y = torch.load({str(path.parent / 'y.pt')!r})
torch.testing.assert_close(m(x), y, atol=1e-4, rtol=1e-4)
assert not any(k.startswith('tests') for k in sys.modules), 'model code was imported'
# ONNX Runtime's blobs load without its exporter (onnxscript: a slow import, compiling only)
print('OK', [p['engine'] for p in m.manifest['partitions']], 'onnxscript' in sys.modules)
"""
    r = run_py(code, cwd=str(path.parent))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    assert r.stdout.split("OK", 1)[1].strip() == "['onnxruntime'] False", r.stdout


def test_truncated_artifact(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    data = path.read_bytes()
    bad = tmp_path / "trunc.kiln"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(kiln.ArtifactError, match="truncated"):
        kiln.load(bad)


def test_corrupted_blob(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    bad = tmp_path / "corrupt.kiln"

    def flip(name, data):
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF
        return bytes(b)

    _rewrite(path, bad, edit_blob=flip)
    with pytest.raises(kiln.ArtifactError, match="checksum mismatch"):
        kiln.load(bad)


def _bomb(src, dst, member, inflated=72 << 20, declare=None, manifest_size=None):
    """``src`` rewritten with ``member`` deflated and inflating to ``inflated`` bytes of zeros
    (70 KB in the file); ``declare``: the uncompressed size its directory entry then claims;
    ``manifest_size``: the blob size the manifest records."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compresslevel=1) as zout:
        for item in zin.namelist():
            data = zin.read(item)
            if item == "manifest.json" and manifest_size is not None:
                m = json.loads(data)
                m["blobs"][member]["size"] = manifest_size
                data = json.dumps(m).encode()
            if item == "signature.json":
                continue
            if item != member:
                zout.writestr(item, data)
                continue
            info = zipfile.ZipInfo(item)
            info.compress_type = zipfile.ZIP_DEFLATED
            with zout.open(info, "w") as f:
                if item == "manifest.json":
                    f.write(data[:-1])
                zeros = b" " * (8 << 20)
                for _ in range(inflated // len(zeros)):
                    f.write(zeros)
                if item == "manifest.json":
                    f.write(data[-1:])
    if declare is not None:        # rewrite the central directory's uncompressed size
        raw = bytearray(dst.read_bytes())
        pos = raw.find(b"PK\x01\x02")
        while pos >= 0:
            name_len = int.from_bytes(raw[pos + 28:pos + 30], "little")
            if raw[pos + 46:pos + 46 + name_len] == member.encode():
                raw[pos + 24:pos + 28] = declare.to_bytes(4, "little")
            pos = raw.find(b"PK\x01\x02", pos + 4)
        dst.write_bytes(bytes(raw))


def test_a_zip_bomb_is_refused_before_it_inflates(mlp_artifact, tmp_path, monkeypatch):
    """Deflated members are inflated only up to what they declare, and only when that fits:
    the manifest's cap, the size the manifest records for a blob. 72 MB of spaces in 70 KB
    cost 72 MB of memory (the probe's 3 GB ones, 6.5 GB) before the checksum failed."""
    from kiln.artifact.container import manifest_of
    path, _, _ = mlp_artifact
    read = []
    real_read = zipfile.ZipExtFile.read
    monkeypatch.setattr(zipfile.ZipExtFile, "read", lambda self, n=-1: read.append(r := real_read(self, n)) or r)
    blob = next(n for n in zipfile.ZipFile(path).namelist() if n.startswith("partitions/"))
    bomb = tmp_path / "bomb.kiln"
    _bomb(path, bomb, "manifest.json")
    for load in (kiln.load, manifest_of):
        with pytest.raises(kiln.ArtifactError, match=r"manifest.json declares 755\d{5} bytes uncompressed"):
            load(str(bomb))
    _bomb(path, bomb, blob)      # the manifest records the blob's real size
    with pytest.raises(kiln.ArtifactError, match=rf"blob {blob} is 75497472 bytes in the archive but the manifest "
                                                 "records"):
        kiln.load(bomb)
    _bomb(path, bomb, blob, declare=10240, manifest_size=10240)   # a lying size: stops after it
    with pytest.raises(kiln.ArtifactError, match=f"blob {blob} cannot be read"):
        kiln.load(bomb)
    assert sum(map(len, read)) < 8 << 20


def test_an_input_no_machine_could_hold_is_refused_and_a_failed_warm_up_names_it(mlp_artifact, tmp_path,
                                                                                monkeypatch):
    """A manifest's input of 2^41 x 16 elements loaded; kiln serve's warm-up then failed with the
    allocator's own message, naming no input (the probe's [2^32, 8]: 128 GB)."""
    from kiln.serving.models import warmup_inputs
    path, _, _ = mlp_artifact
    bad = tmp_path / "huge.kiln"
    _rewrite(path, bad, edit_manifest=lambda m: m["inputs"]["tensors"][0].update(shape=[2 ** 41, 16]))
    with pytest.raises(kiln.ArtifactError, match=r"inputs.tensors\[0\].shape.*35184372088832 elements, more than"):
        kiln.load(bad)
    model = kiln.load(path)

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory")
    monkeypatch.setattr(torch, "zeros", refuse)
    with pytest.raises(kiln.KilnError, match=r"warm-up: input 'x' of shape \[2, 16\] \(torch.float32\) needs 128 "
                                             "bytes.*DefaultCPUAllocator"):
        warmup_inputs(model)


@pytest.mark.parametrize("dropped", [("xxh3c",), ("xxh3c", "crc32")], ids=["crc32", "sha256"])
def test_older_artifacts_are_checked_by_their_digests(mlp_artifact, tmp_path, dropped):
    """Artifacts written before the manifest recorded xxh3c (or crc32) still load, and are
    still verified, by CRC-32 (or SHA-256)."""
    path, _, x = mlp_artifact

    def drop(m):
        for meta in m["blobs"].values():
            for key in dropped:
                del meta[key]

    old = tmp_path / "old.kiln"
    _rewrite(path, old, edit_manifest=drop)
    torch.testing.assert_close(kiln.load(old)(x), kiln.load(path)(x), rtol=0, atol=0)
    bad = tmp_path / "old-corrupt.kiln"
    _rewrite(path, bad, edit_manifest=drop, edit_blob=lambda name, data: data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(kiln.ArtifactError, match="checksum mismatch"):
        kiln.load(bad)


def test_blobs_are_page_aligned_views_of_the_mapped_file(mlp_artifact):
    path, _, _ = mlp_artifact
    art = Artifact.load(path)
    with zipfile.ZipFile(path) as z:
        for name, data in art.blobs.items():
            assert isinstance(data, memoryview) and data.readonly
            origin = art.origin(name)
            assert origin.offset % 4096 == 0 and origin.unchanged()
            with open(path, "rb") as f:
                f.seek(origin.offset)
                assert f.read(len(data)) == bytes(data) == z.read(name)


def test_onnxruntime_maps_weights_and_survives_the_file_being_replaced(tmp_path):
    """The engine maps weights from the .kiln file; saving another model over the same
    path (a rename) must not change a model already loaded, nor one re-placed later."""
    from kiln.engines.onnxruntime import graph_of
    model, x = models.mlp()
    path = tmp_path / "m.kiln"
    kiln.trace(model, x, cache=False).save(path)
    loaded = kiln.load(path)
    blob = loaded._artifact.blobs[loaded.manifest["partitions"][0]["blob"]]
    assert bytes(blob[:8]) == b"KILNORT2"
    external = [i for i in graph_of(blob).graph.initializer if i.external_data]
    assert external, "weights should be external data, not inside the protobuf"
    other = models.MLP().eval()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(3)
    kiln.trace(other, x, cache=False).save(path)                 # replaces the file by rename
    expected = model(x).detach()
    assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)
    loaded.to_core(0)                                            # reloads the engine: a private copy
    assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(kiln.load(path)(x), expected, atol=1e-3)
    path.unlink()                                                # e.g. a cache eviction
    loaded.to_core(0)
    assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)


def test_prepacked_weights_are_dropped_on_another_cpu(mlp_artifact, monkeypatch):
    """Prepacked layouts are the compiling CPU's; elsewhere ORT packs the plain weights."""
    from kiln.engines import onnxruntime as ort_engine
    path, model, x = mlp_artifact
    art = Artifact.load(path)
    header, _, _ = ort_engine._unpack(art.blobs["partitions/0.onnx"])
    prepacked = [e for i in ort_engine.graph_of(art.blobs["partitions/0.onnx"]).graph.initializer
                 for e in i.external_data if e.key.startswith("prepacked_")]
    assert header["prepacked"] and prepacked and header["isa"] == ort_engine._isa()
    seen = []
    relocate = ort_engine._relocate
    monkeypatch.setattr(ort_engine, "_relocate", lambda *a: seen.append(a[3]) or relocate(*a))
    monkeypatch.setattr(ort_engine, "_isa", lambda: ["sse4_2"])       # a different CPU
    assert_close(kiln.load(path)(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    assert seen == [False]


def test_kiln_ort_prepacked_heap_lets_ort_pack(mlp_artifact, monkeypatch):
    from kiln.engines import onnxruntime as ort_engine
    path, model, x = mlp_artifact
    seen = []
    relocate = ort_engine._relocate
    monkeypatch.setattr(ort_engine, "_relocate", lambda *a: seen.append(a[3]) or relocate(*a))
    monkeypatch.setenv("KILN_ORT_PREPACKED", "heap")
    assert_close(kiln.load(path)(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("KILN_ORT_PREPACKED", "map")
    kiln.load(path)
    assert seen == [False, True]
    monkeypatch.setenv("KILN_ORT_PREPACKED", "sometimes")
    with pytest.raises(kiln.KilnError, match="KILN_ORT_PREPACKED"):
        kiln.load(path)


def test_plain_onnx_blobs_of_older_kilns_still_load(mlp_artifact, tmp_path):
    import onnx
    from kiln.engines import onnxruntime as ort_engine
    path, model, x = mlp_artifact
    art = Artifact.load(path)
    blob = art.blobs["partitions/0.onnx"]
    header, graph, offset = ort_engine._unpack(blob)
    (tmp_path / "weights.bin").write_bytes(bytes(blob[offset:offset + header["data"]]))
    plain = ort_engine._relocate(graph, "weights.bin", 0, keep_prepacked=False)
    (tmp_path / "model.onnx").write_bytes(plain)
    embedded = onnx.load(str(tmp_path / "model.onnx"))          # reads the external data in
    old = Artifact(dict(art.manifest), {**{k: bytes(v) for k, v in art.blobs.items()},
                                        "partitions/0.onnx": embedded.SerializeToString()})
    old.save(tmp_path / "old.kiln")
    assert_close(kiln.load(tmp_path / "old.kiln")(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_flipped_byte_in_file(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    bad = tmp_path / "flip.kiln"
    bad.write_bytes(bytes(data))
    with pytest.raises(kiln.ArtifactError):
        kiln.load(bad)


def test_foreign_files(tmp_path):
    notzip = tmp_path / "a.kiln"
    notzip.write_text("hello")
    with pytest.raises(kiln.ArtifactError, match="not a kiln artifact"):
        kiln.load(notzip)
    other = tmp_path / "b.kiln"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("data.txt", "x")
    with pytest.raises(kiln.ArtifactError, match="without manifest.json"):
        kiln.load(other)
    with pytest.raises(kiln.ArtifactError, match="no such file"):
        kiln.load(tmp_path / "missing.kiln")
    # a torch.save file is named as one (until 12-03 it was called a TorchScript archive)
    torch.save({"w": torch.ones(2)}, tmp_path / "sd.pt")
    with pytest.raises(kiln.ArtifactError, match="a torch.save file .*torch.load"):
        kiln.load(tmp_path / "sd.pt")


def test_newer_format_version(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    bad = tmp_path / "future.kiln"
    _rewrite(path, bad, edit_manifest=lambda m: m.update(format_version=READS_FORMAT + 1))
    with pytest.raises(kiln.ArtifactError, match=rf"reads format {READS_FORMAT} and older. Upgrade kiln"):
        kiln.load(bad)


def test_missing_isa_features_named(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    bad = tmp_path / "amx.kiln"

    def needs_more(m):
        m["target"]["isa"] = m["target"]["isa"] + ["amx_tile", "sve2"]

    _rewrite(path, bad, edit_manifest=needs_more)
    from kiln.host.target import host_features
    missing = [f for f in ("amx_tile", "sve2") if f not in host_features()]
    with pytest.raises(kiln.TargetMismatchError) as info:
        kiln.load(bad)
    for f in missing:
        assert f in str(info.value)


def test_missing_engine(mlp_artifact, tmp_path):
    path, _, _ = mlp_artifact
    bad = tmp_path / "engine.kiln"

    def other_engine(m):
        for p in m["partitions"]:
            p["engine"] = "tensorrt"

    _rewrite(path, bad, edit_manifest=other_engine)
    with pytest.raises(kiln.EngineUnavailableError, match="tensorrt"):
        kiln.load(bad)


def test_atomic_write_leaves_no_partial_file(tmp_path):
    target = tmp_path / "out.kiln"
    target.write_bytes(b"previous good artifact")

    def dies_halfway(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(target), dies_halfway)
    assert target.read_bytes() == b"previous good artifact"
    assert os.listdir(tmp_path) == ["out.kiln"]
    # a directory for a path: said so, not os.replace's error naming the temp file (until 12-03)
    with pytest.raises(IsADirectoryError, match="is a directory; give the path of a file"):
        write_atomic(str(tmp_path), lambda f: f.write(b"x"))
    assert os.listdir(tmp_path) == ["out.kiln"]


def test_killed_writer_leaves_previous_artifact(mlp_artifact, tmp_path):
    """A process killed mid-save never exposes a half-written file under the real name."""
    path, model, x = mlp_artifact
    dst = tmp_path / "m.kiln"
    dst.write_bytes(path.read_bytes())
    code = f"""
import os, signal, kiln.artifact.container as a
def writer(f):
    f.write(b"x" * 1000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)
a.write_atomic({str(dst)!r}, writer)
"""
    r = run_py(code)
    assert r.returncode != 0
    assert_close(kiln.load(dst)(x), model(x).detach())


def test_wrong_input_shape_and_dtype(mlp_artifact):
    path, _, x = mlp_artifact
    m = kiln.load(path)
    with pytest.raises(kiln.InputError, match=r"input 'x': expected \(2, 16\) float32, got \(3, 16\) float32"):
        m(torch.randn(3, 16))
    with pytest.raises(kiln.InputError, match=r"input 'x': expected \(2, 16\) float32, got \(2, 16\) float64"):
        m(x.double())
    with pytest.raises(kiln.InputError, match="takes 1 input"):
        m(x, x)
    with pytest.raises(kiln.InputError, match="unexpected input 'y'"):
        m(x=x, y=x)
    with pytest.raises(kiln.InputError, match="missing input 'x'"):
        m()


def test_bare_tensors_skip_the_structure_walk_and_are_checked_the_same(mlp_artifact):
    """Bare tensors given in order are the flat inputs themselves (an LLM decode step's 63);
    arrays, tensor subclasses and keywords take the structure walk; every call is checked
    alike, a tensor on another device included."""
    path, model, x = mlp_artifact
    m = kiln.load(path)
    assert m._plain == 1
    flat = m.flatten((x,), {})
    assert len(flat) == 1 and flat[0] is x
    want = model(x).detach()
    for given in ((x,), (x.numpy(),), (torch.nn.Parameter(x.clone(), requires_grad=False),)):
        assert_close(m(*given), want)
    assert_close(m(x=x), want)
    with pytest.raises(kiln.InputError, match=r"input 'x': expected a CPU tensor, got one on meta"):
        m(torch.empty(2, 16, device="meta"))
    with pytest.raises(kiln.InputError, match=r"input 'x': expected \(2, 16\) float32, got \(2, 16\) float64"):
        m(x.double())


def test_refused_non_finite_values_are_found_and_huge_finite_ones_pass(mlp_artifact):
    """A model that refuses NaN and infinities (an engine found at compile time to answer
    them differently) first sums each input: finite values whose sum overflows still pass,
    and a NaN or an infinity anywhere is refused, naming it."""
    path, model, x = mlp_artifact
    m = kiln.load(path)
    object.__setattr__(m, "nonfinite", frozenset({"nan", "+inf", "-inf"}))
    huge = torch.full_like(x, 3e38)                  # every value finite, the sum +inf
    assert not torch.isfinite(huge.sum())
    assert m(huge).shape == model(x).shape          # answered: no InputError
    for value, named in ((float("nan"), "nan"), (float("inf"), r"\+inf"), (-float("inf"), "-inf")):
        bad = x.clone()
        bad[1, 7] = value
        with pytest.raises(kiln.InputError, match=f"input 'x' holds {named}"):
            m(bad)
    assert_close(m(x), model(x).detach())


def test_artifact_api_bytes_round_trip(mlp_artifact):
    path, _, _ = mlp_artifact
    art = Artifact.load(path)
    again = Artifact.from_bytes(art.to_bytes())
    assert again.manifest["blobs"] == art.manifest["blobs"]


def test_private_copy_falls_back_when_shared_memory_is_unusable(monkeypatch, tmp_path):
    """A fresh compile hands ORT a private copy of its weights, in /dev/shm when it can."""
    import tempfile
    import types
    from kiln.engines import onnxruntime as ort_engine
    asked = []

    def mkdtemp(prefix="", dir=None):
        asked.append(dir)
        if dir == "/dev/shm":
            raise PermissionError("read-only /dev/shm")
        return tempfile.mkdtemp(prefix=prefix, dir=str(tmp_path))

    monkeypatch.setattr(ort_engine, "tempfile", types.SimpleNamespace(
        mkdtemp=mkdtemp, TemporaryDirectory=tempfile.TemporaryDirectory))
    model, x = models.mlp()
    compiled = kiln.trace(model, x, cache=False)
    assert_close(compiled(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    if os.path.isdir("/dev/shm"):
        assert asked[:2] == ["/dev/shm", None]
    assert list(tmp_path.iterdir()) == []      # the copy is gone once ORT has it


def test_chunked_digest_catches_a_flip_in_any_chunk():
    from kiln.artifact.container import CHUNK, xxh3_chunked
    data = bytearray(range(256)) * ((2 * CHUNK + 1000) // 256)
    digest = xxh3_chunked(data)
    assert xxh3_chunked(bytes(data)) == digest
    for where in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 5):
        flipped = bytearray(data)
        flipped[where] ^= 1
        assert xxh3_chunked(flipped) != digest
    assert xxh3_chunked(data[:-1]) != digest


Pair = __import__("collections").namedtuple("Pair", "probs hidden")


class _PairModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return Pair(h.softmax(-1), h)


def test_a_namedtuple_output_comes_back_a_namedtuple(tmp_path):
    """Until 12-03 it came back a mapping (``kiln.Output``): ``probs, hidden = model(x)`` gave
    the field names, not the tensors."""
    from kiln.artifact import specs
    torch.manual_seed(0)
    model, x = _PairModel().eval(), torch.randn(2, 4)
    compiled = kiln.trace(model, x)
    want = model(x)
    got = compiled(x)
    assert type(got) is Pair                  # the class, where it is loaded
    probs, hidden = got
    assert_close(probs, want.probs.detach())
    assert_close(hidden, want.hidden.detach())
    compiled.save(tmp_path / "pair.kiln")
    torch.save(x, tmp_path / "x.pt")
    torch.save(want.hidden.detach(), tmp_path / "h.pt")
    code = f"""
import sys, torch, kiln
out = kiln.load({str(tmp_path / 'pair.kiln')!r})(torch.load({str(tmp_path / 'x.pt')!r}))
probs, hidden = out
torch.testing.assert_close(hidden, torch.load({str(tmp_path / 'h.pt')!r}), atol=1e-4, rtol=1e-4)
assert out.hidden is hidden and out[0] is probs and isinstance(out, tuple)
assert not any(k.startswith('tests') for k in sys.modules), 'model code was imported'
print('OK', type(out).__name__, out._fields)
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK Pair ('probs', 'hidden')" in r.stdout, r.stderr
    # an artifact of an older kiln names the class bare
    old = specs.decode({"namedtuple": [["a", {"t": 0}], ["b", {"none": True}]], "class": "Pair"}, [torch.ones(1)])
    assert isinstance(old, tuple) and old._fields == ("a", "b") and old.b is None
    with pytest.raises(kiln.errors.ArtifactError, match="namedtuple with fields"):
        specs.decode({"namedtuple": [["not a name", {"t": 0}]], "class": "Pair"}, [torch.ones(1)])
