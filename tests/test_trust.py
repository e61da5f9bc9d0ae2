"""Signed artifacts: native code (TorchInductor libraries) loads only from trusted signers.

"Another host" is another KILN_CONFIG_DIR: its own signing key, trusting the session's
key (conftest's KILN_CONFIG_DIR) only through KILN_TRUSTED_KEYS. kiln.artifact.trust reads the
environment at each load, so in-process tests switch hosts with monkeypatch; the
fresh-process tests show the same from a clean interpreter. One AOTInductor compile
(15-30 s of g++) serves the whole module.
"""
import json
import logging
import types
import zipfile

import pytest
import torch

import kiln
from kiln import cli
from kiln.compiler import cache as cache_mod
from kiln.artifact import trust
from kiln.artifact.container import Artifact
from kiln.engines import inductor
from tests import models
from tests.conftest import assert_close, run_py

needs_compiler = pytest.mark.skipif(
    inductor.compiler() is None,
    reason="the inductor engine needs a C++ compiler (g++) to compile; none found on PATH")


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """An inductor MLP compiled (and so signed) in this process, saved, with its input and output."""
    if inductor.compiler() is None:
        pytest.skip("the inductor engine needs a C++ compiler (g++) to compile")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, engine="inductor")
    d = tmp_path_factory.mktemp("native")
    path = d / "mlp.kiln"
    compiled.save(path)
    torch.save(x, d / "x.pt")
    torch.save(model(x).detach(), d / "y.pt")
    return types.SimpleNamespace(compiled=compiled, path=path, dir=d, x=x, y=model(x).detach())


@pytest.fixture(scope="module")
def data_only(tmp_path_factory):
    """An ONNX Runtime MLP, saved."""
    model, x = models.mlp()
    compiled = kiln.trace(model, x)
    path = tmp_path_factory.mktemp("ort") / "mlp.kiln"
    compiled.save(path)
    return types.SimpleNamespace(compiled=compiled, path=path, x=x)


@pytest.fixture
def other_host(tmp_path, monkeypatch):
    """Switch this process to another host: its own (not yet made) key, no trusted keys."""
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "other-host"))
    monkeypatch.delenv("KILN_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("KILN_TRUST_NATIVE_CODE", raising=False)


def _signature(path):
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("signature.json"))


def _resave(art, dst, monkeypatch, signature):
    """Write ``art`` (its manifest perhaps edited) with the given signature.json bytes (or none)."""
    with monkeypatch.context() as m:
        m.setattr(trust, "signature_for", lambda _art: signature)
        art.save(dst)


# -- signing ------------------------------------------------------------------------------------
@needs_compiler
def test_compiled_artifact_is_signed_by_this_host_and_loads(native):
    sig = _signature(native.path)
    assert sig["algorithm"] == "ed25519"
    assert trust.parse_key(sig["public_key"]) == trust.host_public_key()
    with open(trust.config_dir() + "/signing_key.pub") as f:
        assert f.read().strip() == sig["public_key"]
    art = Artifact.load(native.path)
    assert trust.verify(art.manifest, art.signature, "t") == trust.host_public_key()
    loaded = kiln.load(native.path)
    assert_close(loaded(native.x), native.y)


def test_key_files_and_trusted_keys_list(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "cfg"))
    pub = trust._public_bytes(trust.host_key())
    assert trust.host_key() is not None and trust._public_bytes(trust.host_key()) == pub   # made once
    private = tmp_path / "cfg" / "signing_key"
    assert private.stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "cfg").glob("*.tmp"))
    other = bytes(range(32))
    keyfile = tmp_path / "fleet.keys"
    keyfile.write_text(f"# the build hosts\n{trust.encode_key(other)}\n")
    monkeypatch.setenv("KILN_TRUSTED_KEYS", f"{keyfile}:{bytes(range(1, 33)).hex()}")
    keys = trust.trusted_keys()
    assert keys == {other: "KILN_TRUSTED_KEYS", bytes(range(1, 33)): "KILN_TRUSTED_KEYS",
                    pub: "this host's key"}
    monkeypatch.setenv("KILN_TRUSTED_KEYS", str(tmp_path / "missing.keys"))
    with pytest.raises(kiln.KilnError, match="KILN_TRUSTED_KEYS: .*missing.keys"):
        trust.trusted_keys()


# -- native code and trust ------------------------------------------------------------------------
@needs_compiler
def test_fresh_process_with_the_signers_key_loads(native):
    code = f"""
import torch, kiln
m = kiln.load({str(native.path)!r})
torch.testing.assert_close(m(torch.load({str(native.dir / 'x.pt')!r})), torch.load({str(native.dir / 'y.pt')!r}))
print('OK')
"""
    r = run_py(code)    # inherits KILN_CONFIG_DIR: the same host
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@needs_compiler
def test_fresh_process_on_another_host_refuses_unless_trusted(native, tmp_path):
    pt = tmp_path / "mlp.pt"
    torch.jit.save(native.compiled, str(pt))
    code = f"""
import os, torch, kiln
x, y = torch.load({str(native.dir / 'x.pt')!r}), torch.load({str(native.dir / 'y.pt')!r})
try:
    kiln.load({str(native.path)!r})
except kiln.UntrustedArtifactError as e:
    print('REFUSED', e)
else:
    raise SystemExit('an untrusted native-code artifact loaded')
torch.testing.assert_close(kiln.load({str(native.path)!r}, trust_native_code=True)(x), y)
# torch.jit.load of a wrapped artifact obeys the same policy (KILN_TRUST_NATIVE_CODE grants)
scripted = torch.jit.load({str(pt)!r})
try:
    scripted(x)
except Exception as e:
    assert 'native code' in str(e), e
    print('SCRIPT REFUSED')
os.environ['KILN_TRUST_NATIVE_CODE'] = '1'
torch.testing.assert_close(scripted(x), y)
print('OK')
"""
    r = run_py(code, env={"KILN_CONFIG_DIR": str(tmp_path / "other-host")})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr + r.stdout
    assert "SCRIPT REFUSED" in r.stdout
    message = r.stdout.split("REFUSED", 1)[1]
    signer = trust.fingerprint(trust.host_public_key())
    for needed in ("partition 0", "inductor", "native code", signer, "trust_native_code=True",
                   "KILN_TRUSTED_KEYS", trust.encode_key(trust.host_public_key())):
        assert needed in message, (needed, message)


@needs_compiler
def test_fresh_process_trusting_the_signer_loads(native, tmp_path):
    keyfile = tmp_path / "fleet.keys"
    keyfile.write_text(trust.encode_key(trust.host_public_key()) + "\n")
    code = f"""
import torch, kiln
m = kiln.load({str(native.path)!r})
torch.testing.assert_close(m(torch.load({str(native.dir / 'x.pt')!r})), torch.load({str(native.dir / 'y.pt')!r}))
print('OK')
"""
    r = run_py(code, env={"KILN_CONFIG_DIR": str(tmp_path / "other-host"), "KILN_TRUSTED_KEYS": str(keyfile)})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


@needs_compiler
def test_unsigned_native_artifact_is_refused(native, tmp_path, monkeypatch):
    unsigned = tmp_path / "unsigned.kiln"
    _resave(Artifact.load(native.path), unsigned, monkeypatch, None)
    with pytest.raises(kiln.UntrustedArtifactError, match=r"partition 0 \(engine inductor\).*unsigned"):
        kiln.load(unsigned)
    assert_close(kiln.load(unsigned, trust_native_code=True)(native.x), native.y)


@needs_compiler
def test_native_blob_is_checked_against_its_signed_sha256(native):
    """XXH3 tells corruption, not forgery: a signed native blob must match its SHA-256."""
    art = Artifact.load(native.path)
    name = art.manifest["partitions"][0]["blob"]
    forged = bytearray(art.blobs[name])
    forged[-1] ^= 1
    art.blobs[name] = bytes(forged)
    with pytest.raises(kiln.SignatureError, match="SHA-256"):
        kiln.runtime.loader.from_artifact(art, kiln.runtime.options.RuntimeOptions())


# -- nested artifacts ---------------------------------------------------------------------------------
@needs_compiler
def test_nested_artifacts_follow_their_signers(native, other_host, tmp_path, monkeypatch):
    data = native.path.read_bytes()           # signed by the session's key, foreign here
    with pytest.raises(kiln.UntrustedArtifactError):
        kiln.load(data)
    granted = kiln.load(data, trust_native_code=True)
    # Re-wrapping a model trusted only on the caller's word does not make this host vouch
    # for it: the outer artifact is written unsigned, the inner keeps its own signer.
    wrapped = kiln.dynamic_batch(granted).to_bytes()
    outer = Artifact.from_bytes(wrapped)
    assert outer.signature is None
    assert trust.parse_key(json.loads(outer.nested("inner.kiln", "inner").signature)["public_key"]) \
        != trust.host_public_key()
    with pytest.raises(kiln.UntrustedArtifactError, match=r"inner.*partition 0 \(engine inductor\)"):
        kiln.load(wrapped)
    assert_close(kiln.load(wrapped, trust_native_code=True)(native.x), native.y)   # the grant extends inward
    monkeypatch.undo()                          # back on the signing host: the inner is trusted by its own signature
    assert_close(kiln.load(wrapped)(native.x), native.y)


@needs_compiler
def test_trusted_outer_signature_vouches_for_nested_and_untrusted_does_not(native, tmp_path, monkeypatch):
    inner = Artifact.load(native.path)
    unsigned_inner = tmp_path / "inner.kiln"
    _resave(inner, unsigned_inner, monkeypatch, None)
    wrapper = kiln.dynamic_batch(kiln.load(native.path))
    outer = Artifact(wrapper.manifest, {"inner.kiln": unsigned_inner.read_bytes()})
    outer.seal()
    signed_outer, unsigned_outer = tmp_path / "signed.kiln", tmp_path / "unsigned.kiln"
    _resave(outer, signed_outer, monkeypatch, trust.sign(outer.manifest))
    _resave(outer, unsigned_outer, monkeypatch, None)
    assert_close(kiln.load(signed_outer)(native.x), native.y)        # vouched for by the outer
    with pytest.raises(kiln.UntrustedArtifactError, match="unsigned"):
        kiln.load(unsigned_outer)
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "other-host"))   # the outer's signer is foreign
    with pytest.raises(kiln.UntrustedArtifactError):
        kiln.load(signed_outer)


# -- data-only artifacts and tampering -----------------------------------------------------------------
def test_data_only_artifacts_load_signed_by_anyone_or_unsigned(data_only, other_host, tmp_path, monkeypatch):
    assert_close(kiln.load(data_only.path)(data_only.x), data_only.compiled(data_only.x))   # foreign signer
    unsigned = tmp_path / "unsigned.kiln"
    _resave(Artifact.load(data_only.path), unsigned, monkeypatch, None)
    assert "signature.json" not in zipfile.ZipFile(unsigned).namelist()
    assert_close(kiln.load(unsigned)(data_only.x), data_only.compiled(data_only.x))


def test_tampered_manifest_is_refused_whatever_the_engine(data_only, tmp_path, monkeypatch):
    art = Artifact.load(data_only.path)
    old = art.signature
    art.manifest["model_name"] = "Tampered"
    bad = tmp_path / "tampered.kiln"
    _resave(art, bad, monkeypatch, old)
    with pytest.raises(kiln.SignatureError, match="does not match the manifest"):
        kiln.load(bad)
    with pytest.raises(kiln.SignatureError):
        kiln.load(bad, trust_native_code=True)
    garbled = tmp_path / "garbled.kiln"
    _resave(Artifact.load(data_only.path), garbled, monkeypatch, b"{not json")
    with pytest.raises(kiln.SignatureError, match="malformed"):
        kiln.load(garbled)
    monkeypatch.setenv("COLUMNS", "250")
    assert cli.main(["inspect", str(bad)]) == 2


def test_resaving_keeps_the_signature_and_edits_are_resigned(data_only, other_host, monkeypatch):
    foreign = _signature(data_only.path)
    loaded = kiln.load(data_only.path)
    assert json.loads(Artifact.from_bytes(loaded.to_bytes()).signature) == foreign    # unchanged: kept
    loaded.manifest["note"] = "edited here"
    resigned = Artifact.from_bytes(loaded.to_bytes())
    assert trust.verify(resigned.manifest, resigned.signature, "t") == trust.host_public_key()


# -- the compile cache ------------------------------------------------------------------------------------
@needs_compiler
def test_cache_entries_are_signed_and_untrusted_ones_are_misses(native, tmp_path, monkeypatch, caplog):
    from kiln.compiler.caching import compile_into as compile_into_cache, reader as cache_reader
    store = cache_mod.Cache(str(tmp_path / "cache"))
    key = "ab" * 32
    captured = types.SimpleNamespace(model_name="MLP")
    compile_into_cache(store, key, None, captured, lambda c: native.compiled, None,
                       cache_reader(store, False, None))
    entry = tmp_path / "cache" / "entries" / key / "artifact.kiln"
    assert trust.parse_key(_signature(entry)["public_key"]) == trust.host_public_key()
    hit = cache_reader(store, False, None)(key)
    assert hit is not None and hit.manifest["cache"]["hit"]
    assert_close(hit(native.x), native.y)

    signer = trust.host_public_key()
    original = entry.read_bytes()
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "other-host"))
    monkeypatch.setenv("KILN_TRUST_NATIVE_CODE", "1")          # never applies to cache entries
    before = dict(cache_mod.stats)
    from_cache = cache_reader(store, False, None)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert from_cache(key) is None
    assert "native code" in caplog.text and cache_mod.stats["untrusted"] == before["untrusted"] + 1
    assert store.lookup(key) is not None                       # kept for the hosts that trust it
    compile_into_cache(store, key, None, captured, lambda c: native.compiled, None, from_cache)
    assert entry.read_bytes() == original                      # recompiled here, not stored over it
    monkeypatch.setenv("KILN_TRUSTED_KEYS", trust.encode_key(signer))
    assert_close(cache_reader(store, False, None)(key)(native.x), native.y)

    art = Artifact.load(entry)                                 # a replaced entry with a stale signature
    art.manifest["model_name"] = art.manifest["model_name"][::-1]   # same size: the meta still fits
    _resave(art, entry, monkeypatch, art.signature)
    assert len(entry.read_bytes()) == len(original)
    assert cache_reader(store, False, None)(key) is None
    assert store.lookup(key) is None                           # corrupt: discarded


def test_an_entry_without_native_code_signed_by_another_host_is_checked_against_eager(tmp_path, monkeypatch, caplog):
    """Anyone who can write to a shared store could plant an ONNX Runtime entry that answers
    wrongly under a model's key, and it was served (no native code, so no trust needed).
    Such a hit is now run on the trace's inputs against eager: one that disagrees is
    discarded and compiled here; one that agrees is served (and counted)."""
    from kiln.compiler.caching import compile_into as compile_into_cache, reader as cache_reader
    url = str(tmp_path / "cache")
    store = cache_mod.Cache(url)
    model, x = models.mlp()
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "writer"))       # another host writes the store
    honest = kiln.trace(model, x, cache=url, engine="onnxruntime")
    key = honest.manifest["cache"]["key"]
    monkeypatch.undo()
    before = dict(cache_mod.stats)
    served = kiln.trace(model, x, cache=url, engine="onnxruntime")        # signed elsewhere, answers right
    assert served.manifest["cache"]["hit"] and cache_mod.stats["checked_hits"] == before["checked_hits"] + 1
    assert_close(served(x), model(x))

    wrong_model, _ = models.mlp()
    with torch.no_grad():
        for p in wrong_model.parameters():
            p.add_(0.5)
    wrong = kiln.trace(wrong_model, x, engine="onnxruntime", cache=False)
    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "writer"))
    store.forget(key)
    compile_into_cache(store, key, None, types.SimpleNamespace(model_name="MLP"), lambda c: wrong, None,
                       cache_reader(store, False, None))                 # planted under the model's key
    monkeypatch.undo()
    assert store.lookup(key) is not None
    with caplog.at_level(logging.WARNING, logger="kiln"):
        got = kiln.trace(model, x, cache=url, engine="onnxruntime")
    assert not got.manifest["cache"]["hit"] and "does not answer as eager" in caplog.text
    assert cache_mod.stats["mismatched"] == before["mismatched"] + 1
    assert_close(got(x), model(x))
    assert trust.parse_key(_signature(tmp_path / "cache" / "entries" / key / "artifact.kiln")["public_key"]) == \
        trust.host_public_key()                                         # stored again, by this host


# -- the command line --------------------------------------------------------------------------------------
@needs_compiler
def test_inspect_shows_signer_and_trust_and_run_needs_the_flag(native, tmp_path, monkeypatch, capsys):
    import numpy as np
    monkeypatch.setenv("COLUMNS", "250")
    signer = trust.fingerprint(trust.host_public_key())
    assert cli.main(["inspect", str(native.path)]) == 0
    out = capsys.readouterr().out
    assert signer in out and "yes: signed by this host's key" in out
    assert "partition 0 (inductor): loads here" in out

    monkeypatch.setenv("KILN_CONFIG_DIR", str(tmp_path / "other-host"))
    assert cli.main(["inspect", str(native.path)]) == 0
    out = capsys.readouterr().out
    assert signer in out and "trusted here" in out and "only with --trust-native-code" in out
    np.save(tmp_path / "x.npy", native.x.numpy())
    assert cli.main(["run", str(native.path), "--input", str(tmp_path / "x.npy")]) == 2
    assert "native code" in capsys.readouterr().err
    assert cli.main(["run", str(native.path), "--input", str(tmp_path / "x.npy"), "--trust-native-code"]) == 0


# -- an unsigned data-only artifact computes on tensors, nothing else ------------------------------
def _tampered(data_only, tmp_path, monkeypatch, edit):
    """``data_only`` resaved unsigned after ``edit(art)``, beside nothing but tmp_path's files."""
    art = Artifact.load(data_only.path)
    edit(art)
    path = tmp_path / "model.kiln"
    _resave(art, path, monkeypatch, None)
    return path


@pytest.mark.parametrize("shared", [False, True])
def test_host_program_may_not_read_or_write_files(data_only, tmp_path, monkeypatch, shared):
    """A program step aten::from_file read any file into the output (shared=True plus fill_
    overwrote it, at kiln serve's warm-up): refused at load, naming the op, the file untouched."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"A" * 32)

    def edit(art):
        p = art.manifest["program"]
        (first,) = p["steps"]
        p["num_slots"] = p["num_inputs"] + len(first["out"]) + 3
        s = p["num_inputs"] + len(first["out"])
        p["steps"] += [
            {"op": "aten::from_file.default", "args": [{"v": str(victim)}, {"v": shared}, {"v": 8}],
             "kwargs": {"dtype": {"dtype": "float32"}}, "out": [s]},
            {"op": "aten::fill_.Scalar" if shared else "aten::clone.default",
             "args": [{"slot": s}] + ([{"v": 1.0}] if shared else []), "kwargs": {}, "out": [s + 1]},
            {"op": "aten::reshape.default", "args": [{"slot": s + 1}, {"list": [{"v": 2}, {"v": 4}]}],
             "kwargs": {}, "out": [s + 2]}]
        p["outputs"] = [{"slot": s + 2}]
    path = _tampered(data_only, tmp_path, monkeypatch, edit)
    with pytest.raises(kiln.ArtifactError, match=r"aten::from_file\.default.*may not run"):
        kiln.load(path)(data_only.x)
    assert victim.read_bytes() == b"A" * 32


def _with_external(blob, location, where):
    """The ONNX Runtime blob with its first bias read from ``location``: as a Constant node's
    tensor (packed blob) or as a plain ONNX blob's initializer."""
    import onnx
    from onnx import helper
    from kiln.engines import ort_blob
    header, graph, offset = ort_blob.unpack(blob)
    data = bytes(blob)[offset:offset + header["data"]]
    model = onnx.load_from_string(graph)
    bias = next(i for i in model.graph.initializer if len(i.dims) == 1 and not i.external_data)
    if where == "plain":        # an older kiln's blob: every weight inline, one now external
        for init in model.graph.initializer:
            if init.external_data:
                e = {x.key: x.value for x in init.external_data}
                init.raw_data = data[int(e["offset"]):int(e["offset"]) + int(e["length"])]
                del init.external_data[:]
                init.data_location = onnx.TensorProto.DEFAULT
        bias.ClearField("raw_data")
        del bias.float_data[:]
        bias.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(4 * bias.dims[0]))):
            bias.external_data.add(key=k, value=v)
        return model.SerializeToString()
    t = onnx.TensorProto(name=bias.name + "_ext", data_type=bias.data_type, dims=bias.dims)
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(4 * bias.dims[0]))):
        t.external_data.add(key=k, value=v)
    model.graph.initializer.remove(bias)
    model.graph.node.insert(0, helper.make_node("Constant", [], [bias.name], value=t))
    g = model.SerializeToString()
    return ort_blob.pack(dict(header, graph=len(g)), g, data)


@pytest.mark.parametrize("where", ["constant", "plain"])
def test_onnx_external_data_outside_the_blob_is_refused(data_only, tmp_path, monkeypatch, where):
    """A Constant's tensor (relocate() rewrote initializers only) read a file beside the
    artifact; a plain ONNX blob's initializer one in the working directory."""
    (tmp_path / "secret.txt").write_bytes(b"SECRET-BESIDE-ARTIFACT!!" * 8)
    monkeypatch.chdir(tmp_path)

    def edit(art):
        art.blobs["partitions/0.onnx"] = _with_external(art.blobs["partitions/0.onnx"], "secret.txt", where)
    path = _tampered(data_only, tmp_path, monkeypatch, edit)
    with pytest.raises(kiln.ArtifactError, match="external data from 'secret.txt'"):
        out = kiln.load(path)(torch.zeros_like(data_only.x))
        assert b"SECRET" not in out.numpy().tobytes()
