"""The persistent compile cache: hits, misses, keys, integrity, races, failures, eviction, S3."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
from kiln.compiler import cache as cache_mod
from kiln.errors import CachedFailure, UnsupportedOpError

from . import models
from .conftest import ROOT, assert_close
from tests import forkserver


def delta(before):
    return {k: cache_mod.stats[k] - before[k] for k in before}


def snap():
    return dict(cache_mod.stats)


def test_second_trace_hits_the_cache(tmp_path):
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    s = snap()
    first = kiln.trace(model, x, cache=url)
    assert delta(s)["misses"] == 1 and delta(s)["compiles"] == 1
    s = snap()
    second = kiln.trace(model, x, cache=url)
    assert delta(s) == dict(delta(s), hits=1, alias_hits=1, misses=0, compiles=0)
    assert second.manifest["cache"]["hit"] and not first.manifest["cache"]["hit"]
    assert second.cache_key == first.cache_key and len(first.cache_key) == 64
    assert_close(second(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    # a different model object with the same weights: same key through the graph
    clone, _ = models.mlp()
    s = snap()
    kiln.trace(clone, x, cache=url)
    assert delta(s)["hits"] == 1 and delta(s)["compiles"] == 0


class _Alpha(torch.nn.Module):
    def forward(self, x):
        return x * 3 + 1


class _Beta(_Alpha):
    """The same graph as _Alpha's under another class name."""


def test_a_hit_is_named_for_the_model_that_asked(tmp_path):
    """Until 12-03 a hit kept the name of the model that filled the entry: _Beta's model was
    called _Alpha, in its saved manifest too."""
    from kiln.artifact.container import manifest_of
    url, x = str(tmp_path / "cache"), torch.randn(4)
    assert kiln.trace(_Alpha(), x, cache=url).name == "_Alpha"
    s = snap()
    beta = kiln.trace(_Beta(), x, cache=url)
    assert delta(s)["hits"] == 1 and delta(s)["compiles"] == 0
    assert beta.name == "_Beta"
    beta.save(tmp_path / "beta.kiln")
    assert manifest_of(str(tmp_path / "beta.kiln"))["model_name"] == "_Beta"
    assert kiln.load(tmp_path / "beta.kiln").name == "_Beta"      # signed again: it loads
    assert_close(kiln.load(tmp_path / "beta.kiln")(x), x * 3 + 1)
    assert kiln.trace(_Alpha(), x, cache=url).name == "_Alpha"
    assert kiln.trace(_Beta(), x, cache=url, name="mine").name == "mine"


def test_changed_weights_shapes_or_options_miss(tmp_path):
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    base = kiln.trace(model, x, cache=url).cache_key
    changed, _ = models.mlp()
    with torch.no_grad():
        changed.net[0].bias[3] += 1e-3
    s = snap()
    keys = {base,
            kiln.trace(changed, x, cache=url).cache_key,
            kiln.trace(model, torch.randn(3, 16), cache=url).cache_key,
            kiln.trace(model, x, cache=url, compiler_args="-O1").cache_key,
            kiln.trace(model, x, cache=url, atol=1e-2).cache_key}
    assert len(keys) == 5 and delta(s)["compiles"] == 4 and delta(s)["hits"] == 0


def test_lazily_compiled_graph_modules_with_the_same_inputs_do_not_share_an_entry(tmp_path):
    """AOTAutograd hands over _LazyGraphModules, which keep no code until first run:
    two of them over the same inputs (a CNN's forward in fp32 and under bf16 autocast)
    once had one fingerprint, and the second got the first's artifact."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    from torch.fx.experimental.proxy_tensor import make_fx
    url = str(tmp_path / "cache")
    x = torch.randn(4, 8)
    graphs = [_LazyGraphModule(torch.nn.Module(), make_fx(f)(x).graph)
              for f in (lambda t: t * 2, lambda t: t + 2)]
    compiled = [kiln.trace(g, (x,), cache=url, engine="onnxruntime") for g in graphs]
    assert compiled[0].cache_key != compiled[1].cache_key
    assert_close(compiled[0](x), x * 2)
    assert_close(compiled[1](x), x + 2)


def test_module_settings_are_part_of_the_fingerprint(tmp_path):
    """Same class, same weights, different non-tensor setting: must not share an entry."""
    url = str(tmp_path / "cache")

    class Scaled(torch.nn.Module):
        def __init__(self, act):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)
            self.act = act

        def forward(self, x):
            y = self.lin(x)
            return torch.relu(y) if self.act == "relu" else torch.tanh(y)

    x = torch.randn(2, 4)
    a, b = Scaled("relu"), Scaled("tanh")
    ca, cb = kiln.trace(a, x, cache=url), kiln.trace(b, x, cache=url)
    assert ca.cache_key != cb.cache_key
    assert_close(cb(x), b(x).detach(), atol=1e-5, rtol=1e-5)


MODEL_SOURCE = textwrap.dedent('''
    import torch
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = torch.nn.Linear(8, 8)
            # HF models keep sets like this (_no_split_modules); their order varies per process
            self.tags = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}
        def forward(self, x):
            return torch.sigmoid(self.a(x))
''')

TRACE_SCRIPT = textwrap.dedent('''
    import json, sys, torch, kiln
    from kiln.compiler import cache
    sys.path.insert(0, ".")
    from netdef import Net
    m = kiln.trace(Net().eval(), torch.ones(2, 8), cache=sys.argv[1])
    print(json.dumps({"key": m.cache_key, "stats": cache.stats,
                      "out": m(torch.ones(2, 8)).sum().item()}))
''')


def _trace_in(directory, url, env=None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "netdef.py").write_text(MODEL_SOURCE)
    return subprocess.Popen([sys.executable, "-c", TRACE_SCRIPT, url], cwd=directory, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_same_model_in_two_directories_and_processes_shares_the_key(tmp_path):
    url = str(tmp_path / "cache")
    one = _result(_trace_in(tmp_path / "checkout-a", url, {"PYTHONHASHSEED": "1"}))
    two = _result(_trace_in(tmp_path / "elsewhere" / "checkout-b", url, {"PYTHONHASHSEED": "2"}))
    assert one["key"] == two["key"]
    assert one["stats"]["compiles"] == 1 and two["stats"]["compiles"] == 0
    assert two["stats"]["alias_hits"] == 1            # found without even capturing


def test_truncated_entry_is_discarded_and_recompiled(tmp_path):
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    key = kiln.trace(model, x, cache=url).cache_key
    path = tmp_path / "cache" / "entries" / key / "artifact.kiln"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    s = snap()
    again = kiln.trace(model, x, cache=url)
    assert delta(s)["discarded"] == 1 and delta(s)["compiles"] == 1
    assert_close(again(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert path.stat().st_size > 0 and cache_mod.Cache(url).lookup(key)[0] == "ok"


def test_an_alias_naming_a_path_outside_the_cache_is_not_followed(tmp_path, caplog):
    """An alias file's key is a path component: ``../../outside`` was served as a hit, and a
    wrong size there deleted that outside directory. Such an alias is ignored and overwritten."""
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    key = kiln.trace(model, x, cache=url).cache_key
    (alias,) = (tmp_path / "cache" / "aliases").iterdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keepme.txt").write_text("victim")
    (outside / "artifact.kiln").write_bytes(b"x" * 10)
    (outside / "meta.json").write_text(json.dumps({"status": "ok", "size": 5}))
    alias.write_text(json.dumps({"key": "../../outside"}))
    s = snap()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = kiln.trace(model, x, cache=url)
    assert sorted(p.name for p in outside.iterdir()) == ["artifact.kiln", "keepme.txt", "meta.json"]
    assert json.loads((outside / "meta.json").read_text()) == {"status": "ok", "size": 5}   # not touched
    assert again.cache_key == key and delta(s)["hits"] == 1 and delta(s)["discarded"] == 0
    assert "not a cache key" in caplog.text
    assert json.loads(alias.read_text()) == {"key": key}          # overwritten with the real key
    store = cache_mod.Cache(url)
    for bad in ("../outside", "/etc", "a/b", "..", "", None):
        with pytest.raises(kiln.errors.CacheError):
            store.lookup(bad)
        with pytest.raises(kiln.errors.CacheError):
            store.forget(bad)
    assert [e["key"] for e in store.entries()] == [key]


def test_entry_without_meta_is_not_used(tmp_path):
    """A process killed between writing the artifact and its meta leaves no valid entry."""
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    key = kiln.trace(model, x, cache=url).cache_key
    (tmp_path / "cache" / "entries" / key / "meta.json").unlink()
    s = snap()
    kiln.trace(model, x, cache=url)
    assert delta(s)["compiles"] == 1


def test_two_processes_racing_on_one_key_compile_once(tmp_path):
    url = str(tmp_path / "cache")
    procs = [_trace_in(tmp_path / f"p{i}", url) for i in range(2)]
    results = [_result(p) for p in procs]
    assert sum(r["stats"]["compiles"] for r in results) == 1
    assert results[0]["key"] == results[1]["key"]

    assert results[0]["out"] == pytest.approx(results[1]["out"], abs=1e-5)


def test_failed_compile_is_cached_and_retried_on_request(tmp_path):
    url = str(tmp_path / "cache")
    model, x = models.custom_op()          # an op no engine runs; without fallback: an error
    with pytest.raises(UnsupportedOpError):
        kiln.trace(model, x, fallback=False, cache=url)
    s = snap()
    with pytest.raises(CachedFailure, match=r"(?s)UnsupportedOpError.*odd_scale.*retry_failed=True"):
        kiln.trace(model, x, fallback=False, cache=url)
    with pytest.raises(UnsupportedOpError):   # remembered failures keep their class
        kiln.trace(model, x, fallback=False, cache=url)
    assert delta(s)["compiles"] == 0 and delta(s)["failed_hits"] == 2
    s = snap()
    with pytest.raises(UnsupportedOpError):
        kiln.trace(model, x, fallback=False, cache=url, retry_failed=True)
    assert delta(s)["compiles"] == 1
    kiln.trace(model, x, cache=url)        # other options, other key: compiles fine


def test_lru_eviction_under_a_small_cap(tmp_path):
    url = str(tmp_path / "cache")
    store = cache_mod.Cache(url)
    model, _ = models.mlp()
    keys = [kiln.trace(model, torch.randn(n, 16), cache=store).cache_key for n in (1, 2)]
    size = max(e["size"] for e in store.entries())
    kiln.trace(model, torch.randn(1, 16), cache=store)          # use the first again
    store.max_bytes = int(size * 2.5)                           # room for two entries
    third = kiln.trace(model, torch.randn(3, 16), cache=store).cache_key
    left = {e["key"] for e in store.entries()}
    assert left == {keys[0], third}                             # the least recently used went


def test_memory_url_and_off_switch(tmp_path, monkeypatch):
    model, x = models.mlp()
    s = snap()
    kiln.trace(model, x, cache="memory://kiln-test")
    kiln.trace(model, x, cache="memory://kiln-test")
    assert delta(s)["hits"] == 1
    s = snap()
    monkeypatch.setenv("KILN_CACHE_URL", str(tmp_path / "env-cache"))
    kiln.trace(model, x)
    kiln.trace(model, x, cache=False)
    assert delta(s)["compiles"] == 1 and (tmp_path / "env-cache" / "entries").is_dir()


def test_cli_cache_commands(tmp_path, kiln_cli):
    url = str(tmp_path / "cache")
    env = {**os.environ, "KILN_CACHE_URL": url, "COLUMNS": "200"}
    out = tmp_path / "m.kiln"
    r = forkserver.run([kiln_cli, "compile", "tests.models:mlp", "-o", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cache: miss, stored" in r.stdout
    r = forkserver.run([kiln_cli, "compile", "tests.models:mlp", "-o", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "cache: hit" in r.stdout
    r = forkserver.run([kiln_cli, "cache", "ls", "--json"], env=env, capture_output=True, text=True,
                       timeout=60)
    (entry,) = json.loads(r.stdout)
    assert entry["model_name"] == "MLP" and entry["engine"] == "onnxruntime" and entry["uses"] == 1
    r = forkserver.run([kiln_cli, "inspect", str(out)], env=env, capture_output=True, text=True, timeout=60)
    assert entry["key"] in r.stdout
    r = forkserver.run([kiln_cli, "cache", "info", entry["key"][:10]], env=env, capture_output=True,
                       text=True, timeout=60)
    assert json.loads(r.stdout)["key"] == entry["key"]
    r = forkserver.run([kiln_cli, "cache", "prune", "--max-bytes", "1"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert "removed 1 entry" in r.stdout
    r = forkserver.run([kiln_cli, "cache", "ls"], env=env, capture_output=True, text=True, timeout=60)
    assert "0 entries" in r.stdout


def test_an_unusable_cache_location_warns_and_compiles_without_it(tmp_path, kiln_cli, caplog):
    """A cache only saves time: a location that fails (here a file where the directory should
    be; a full disk or an unreachable store alike) gets one warning saying what to do, and the
    trace compiles and answers as without a cache. It used to end the trace with the OS's
    NotADirectoryError, and a store that failed a write after the compile lost the model."""
    where = tmp_path / "not-a-directory"
    where.write_text("a file")
    model, x = models.mlp()
    s = snap()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        compiled = kiln.trace(model, x, cache=str(where))
    assert_close(compiled(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert delta(s)["compiles"] == 1 and delta(s)["errors"] >= 1
    assert compiled.manifest["cache"]["stored"] is False
    assert str(where) in caplog.text and "KILN_CACHE_URL=off" in caplog.text
    r = forkserver.run([kiln_cli, "cache", "ls", "--url", str(where)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr and "Traceback" not in r.stderr


# -- an S3-compatible store on loopback ------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config
    import s3fs
    # fsspec reads FSSPEC_* at import: this process needs the setting directly
    conf_before = dict(fsspec.config.conf.get("s3", {}))
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = env["FSSPEC_S3_ENDPOINT_URL"]
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"])
    fs.mkdir("kiln-fleet")
    yield env
    fsspec.config.conf["s3"] = conf_before
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_s3_cache_hits_and_races(s3, tmp_path):
    url = "s3://kiln-fleet/cache"
    model, x = models.mlp()
    s = snap()
    first = kiln.trace(model, x, cache=url)
    second = kiln.trace(model, x, cache=url)
    assert delta(s)["compiles"] == 1 and delta(s)["hits"] == 1
    assert second.cache_key == first.cache_key
    assert_close(second(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    procs = [_trace_in(tmp_path / f"s3p{i}", "s3://kiln-fleet/race", env=s3) for i in range(2)]
    results = [_result(p) for p in procs]
    assert sum(r["stats"]["compiles"] for r in results) == 1
    assert results[0]["key"] == results[1]["key"]

def test_a_store_that_is_down_costs_one_warning_not_the_trace(s3, caplog):
    """An S3 endpoint that refuses connections (botocore's errors are no OSError): the trace
    warns once, stops using the store for the rest of the trace (each request would cost the
    client's retries), and compiles."""
    import fsspec.config
    import s3fs
    server = pytest.importorskip("moto.server").ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server.stop()
    before = dict(fsspec.config.conf["s3"])
    # the endpoint refuses connections; one attempt of botocore's is enough to see it
    fsspec.config.conf["s3"].update(endpoint_url=f"http://{host}:{port}",
                                    config_kwargs={"retries": {"max_attempts": 1}})
    s3fs.S3FileSystem.clear_instance_cache()
    model, x = models.mlp()
    s = snap()
    try:
        with caplog.at_level(logging.WARNING, logger="kiln"):
            compiled = kiln.trace(model, x, cache="s3://kiln-fleet/down")
    finally:
        fsspec.config.conf["s3"] = before
        s3fs.S3FileSystem.clear_instance_cache()
    assert_close(compiled(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    assert delta(s)["compiles"] == 1 and delta(s)["errors"] == 1
    assert "EndpointConnectionError" in caplog.text and "kiln goes on without it" in caplog.text



PARALLEL_SCRIPT = textwrap.dedent('''
    import json, torch, kiln
    from kiln.compiler import cache
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
              torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh()),
              torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3), torch.nn.ReLU())]
    inputs = [torch.randn(2, 8), torch.randn(3, 8), torch.randn(1, 2, 10)]
    for m, x in zip(models, inputs):
        c = kiln.trace(m.eval(), x)
        torch.testing.assert_close(c(x), m(x).detach(), atol=1e-4, rtol=1e-4)
    print("STATS " + json.dumps(cache.stats))
''')


def _stats(out):
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("STATS "))[6:])


def test_parallel_compile_fills_the_cache_for_a_script_with_three_models(tmp_path, kiln_cli):
    script = tmp_path / "serve.py"
    script.write_text(PARALLEL_SCRIPT)
    env = {**os.environ, "KILN_CACHE_URL": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    r = forkserver.run([kiln_cli, "parallel-compile", "--workers", "2", "--json", str(tmp_path / "pc.json"),
                        "--", sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert _stats(r.stdout)["compiles"] == 0              # collect mode: eager stand-ins, nothing compiled
    assert "3 graph(s): 3 compiled" in r.stderr
    summary = json.loads((tmp_path / "pc.json").read_text())
    assert len(summary["jobs"]) == 3 and all(j["ok"] for j in summary["jobs"])
    assert len({j["key"] for j in summary["jobs"]}) == 3
    normal = forkserver.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert normal.returncode == 0, normal.stderr
    stats = _stats(normal.stdout)
    assert stats["hits"] == 3 and stats["compiles"] == 0


def test_neuron_cache_settings_are_honoured(tmp_path, monkeypatch):
    import kiln.neuronx
    monkeypatch.delenv("KILN_CACHE_URL")
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir={tmp_path / 'neuron-cache'}")
    model, x = models.mlp()
    s = snap()
    kiln.neuronx.trace(model, x)
    kiln.neuronx.trace(model, x)
    assert delta(s)["compiles"] == 1 and delta(s)["hits"] == 1
    assert (tmp_path / "neuron-cache" / "entries").is_dir()
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "memory://neuron-url")
    assert kiln.neuronx.neuron_cache_options() == {"cache": "memory://neuron-url"}
    monkeypatch.setenv("KILN_CACHE_URL", "off")                 # kiln's own setting wins
    assert kiln.neuronx.neuron_cache_options() == {}


def test_collect_mode_records_every_bucket_and_returns_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_COLLECT_DIR", str(tmp_path / "jobs"))
    (tmp_path / "jobs").mkdir()
    model, x = models.mlp()
    s = snap()
    stand_in = kiln.trace(model, x, buckets=[torch.randn(1, 16), torch.randn(4, 16)],
                          cache=str(tmp_path / "cache"))
    assert delta(s)["compiles"] == 0
    assert sorted(p.suffix for p in (tmp_path / "jobs").iterdir()) == [".job", ".job", ".pt2", ".pt2"]
    assert_close(stand_in(x), model(x).detach(), atol=0, rtol=0)     # eager, so the script proceeds


def test_a_bad_setting_at_load_does_not_discard_the_entry(tmp_path, monkeypatch):
    """Only a corrupt entry is dropped: an engine setting that fails the load is the
    caller's to fix, and the entry must still be there afterwards."""
    url = str(tmp_path / "cache")
    model, x = models.mlp()
    kiln.trace(model, x, cache=url)
    monkeypatch.setenv("KILN_ORT_PREPACKED", "sometimes")
    s = snap()
    with pytest.raises(kiln.KilnError, match="KILN_ORT_PREPACKED"):
        kiln.trace(model, x, cache=url)
    monkeypatch.delenv("KILN_ORT_PREPACKED")
    kiln.trace(model, x, cache=url)
    assert delta(s)["discarded"] == 0 and delta(s)["compiles"] == 0 and delta(s)["hits"] == 1


def test_an_alias_edited_to_name_another_models_entry_is_not_served(tmp_path, caplog):
    """Aliases are unsigned: pointing model A's alias at model B's (valid, signed) entry made
    the next trace of A return B's artifact, a silently wrong answer. An entry's signed
    manifest records the fingerprint it was compiled for; an alias naming an entry compiled
    for another fingerprint is warned about, removed and not served."""
    url = str(tmp_path / "cache")
    a, x = models.mlp()
    b, _ = models.mlp()
    with torch.no_grad():
        b.net[0].weight.mul_(-3.0)
    key_a = kiln.trace(a, x, cache=url).cache_key
    key_b = kiln.trace(b, x, cache=url).cache_key
    assert key_a != key_b
    (alias_a,) = [p for p in (tmp_path / "cache" / "aliases").iterdir()
                  if json.loads(p.read_text())["key"] == key_a]
    alias_a.write_text(json.dumps({"key": key_b}))
    s = snap()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = kiln.trace(a, x, cache=url)
    assert again.cache_key == key_a
    assert_close(again(x), a(x).detach(), atol=1e-5, rtol=1e-5)
    assert delta(s) == dict(delta(s), alias_hits=0, hits=1, compiles=0, discarded=0)
    assert "names entry" in caplog.text and "not serving it" in caplog.text
    assert json.loads(alias_a.read_text()) == {"key": key_a}      # the capture wrote the real alias
    assert cache_mod.Cache(url).lookup(key_b)[0] == "ok"          # B's entry is kept for B
    assert_close(kiln.trace(b, x, cache=url)(x), b(x).detach(), atol=1e-5, rtol=1e-5)
    # nor another model's remembered failure: A compiles, it does not raise B's error
    other = "c" * 64
    cache_mod.Cache(url).store_failure(other, kiln.errors.CompileError("another model's failure"),
                                       {"fingerprint": "f" * 64})
    alias_a.write_text(json.dumps({"key": other}))
    assert kiln.trace(a, x, cache=url).cache_key == key_a
