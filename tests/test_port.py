"""``kiln port`` (issue 34): the tier by kiln's own facts on three models — clean (tier 1), a
host-only op and a data-dependent branch (tier 2, each blocker at its line with a fix), a custom
op (tier 3) — the Markdown/HTML report with its pictures, a Hugging Face decoder directory and
the LLM path's verdict, and clear errors for what cannot be ported."""
import json
import os
import sys
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

from kiln.errors import KilnError
from kiln.port import port
from tests import forkserver

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _line(path, text) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if text in line)


def test_clean_model_is_tier_1_with_its_cost():
    report = port("tests.models:cnn", quiet=True, timing_budget=0.1)
    assert report.tier == 1 and report.blockers == []
    assert report.captured_whole and report.graph_breaks == 0
    cost = report.cost
    assert cost.route == "kiln.trace" and cost.compile_seconds > 0 and cost.artifact_bytes > 1000
    assert cost.max_abs_difference is not None and cost.max_abs_difference <= 1e-4
    assert cost.eager_ms > 0 and cost.kiln_ms > 0
    assert cost.spans and all(s["kind"] == "device" for s in cost.spans)
    d = report.to_dict()
    assert d["ops"]["host"] == 0 and d["ops"]["total"] == d["ops"]["on_engines"] > 5
    assert [p["engine"] for p in d["graphs"][0]["partitions"]] == [cost.engines[0]]
    assert "shapes [(1, 3, 16, 16)]" in report.hazards[0]["what"]


def test_custom_op_is_tier_3_at_its_line():
    report = port("tests.models:custom_op", quiet=True, timing_budget=0.1)
    assert report.tier == 3
    (b,) = report.blockers
    assert b.kind == "custom-op" and "kilntest::odd_scale" in b.what
    models = os.path.join(HERE, "models.py")
    assert b.where.startswith(f"{models}:{_line(models, 'h = odd_scale(h)')} ")
    assert "torch operations" in b.fix
    # it still runs: the custom op on the host between two engine partitions
    assert report.cost.route == "kiln.trace" and report.cost.max_abs_difference <= 1e-4
    kinds = {s["kind"] for s in report.cost.spans}
    assert kinds == {"device", "host"}


def test_value_dependent_shapes_are_named_with_a_substitute():
    report = port("tests.port_models:value_shaped", quiet=True, timing_budget=0.1)
    assert report.tier == 2
    (b,) = report.blockers
    path = os.path.join(HERE, "port_models.py")
    assert b.kind == "dynamic-shape" and "nonzero" in b.what
    assert b.where.startswith(f"{path}:{_line(path, 'torch.nonzero(x > 0)')} ")
    assert "torch.where" in b.fix


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.rows, self.text = [], 0, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "tr" and attrs.get("class") == "blocker":
            self.rows += 1

    def handle_data(self, data):
        self.text.append(data)


def _pixels_near(png, hex_colour, tol=0.08) -> int:
    import matplotlib.image
    img = matplotlib.image.imread(png)[..., :3]
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb).max(axis=-1) < tol).sum())


def test_tier_2_file_through_the_cli_with_report_and_pictures(kiln_cli, tmp_path):
    out = tmp_path / "report"
    model = os.path.join(HERE, "port_models.py")
    r = forkserver.run([kiln_cli, "port", f"{model}:tier2", "--out", str(out), "--timing", "0.1"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Tier 2" in r.stdout and "wrote" in r.stdout
    data = json.loads((out / "report.json").read_text())
    assert data["tier"] == 2 and not data["captured_whole"] and data["graph_breaks"] == 1
    by_kind = {b["kind"]: b for b in data["blockers"]}
    assert set(by_kind) == {"data-dependent", "host-op"}
    branch, median = by_kind["data-dependent"], by_kind["host-op"]
    assert branch["where"].startswith(f"{model}:{_line(model, 'if m.sum() > 0:')} ")
    assert "torch.where" in branch["fix"] and "torch.cond" in branch["fix"]
    assert "median" in median["what"] and median["where"].startswith(f"{model}:{_line(model, 'torch.median(h')} ")
    assert "sort" in median["fix"]
    # it still ran, piece by piece, with the same answers as eager
    assert data["cost"]["route"] == "torch.compile(backend='kiln')" and data["cost"]["max_abs_difference"] <= 1e-5
    assert any(s["kind"] == "host" and "median" in s["name"] for s in data["cost"]["spans"])

    page = _Page()
    page.feed((out / "report.html").read_text())
    assert page.rows == 2 and "Tier 2" in "".join(page.text)
    assert sorted(page.images) == ["graph.png", "latency.png"]
    from kiln.port.draw import ENGINE_COLOURS, HOST
    graph, latency = out / "graph.png", out / "latency.png"
    assert _pixels_near(graph, HOST) > 30                          # the host op's red X
    assert _pixels_near(graph, ENGINE_COLOURS[data["graphs"][0]["engine"]]) > 100   # engine-coloured ops
    assert _pixels_near(latency, HOST) > 100 and _pixels_near(latency, ENGINE_COLOURS["onnxruntime"]) > 100
    md = (out / "report.md").read_text()
    assert "![" in md and "graph.png" in md and "if m.sum() > 0:" in md


def test_hugging_face_decoder_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    report = port(str(tmp_path), sequence_length=16, quiet=True, timing_budget=0.1)
    assert report.tier == 1 and report.model == "LlamaForCausalLM"
    assert report.llm["supported"] and report.llm["family"] == "llama"
    assert report.cost.max_abs_difference <= 1e-4
    (hazard,) = report.hazards
    assert "sequence_length 16" in hazard["what"] and "'input_ids': {1: [16]}" in hazard["fix"]


def test_clear_errors(tmp_path, kiln_cli):
    bare = tmp_path / "nothing.py"
    bare.write_text("x = 1\n")
    with pytest.raises(KilnError, match="defines none of"):
        port(str(bare), quiet=True)
    with pytest.raises(KilnError, match="give a factory"):
        port("no_such_thing", quiet=True)
    with pytest.raises(KilnError, match="no function 'nope'"):
        port(f"{bare}:nope", quiet=True)
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nmodel = torch.nn.Linear(4, 2)\nexample_inputs = torch.randn(3, 5)\n")
    with pytest.raises(KilnError, match="Linear fails on its example inputs in eager PyTorch.*RuntimeError"):
        port(str(broken), quiet=True)
    r = forkserver.run([kiln_cli, "port", str(tmp_path / "missing.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "missing.py: no such file" in r.stderr
    # until 12-03: a TypeError, silence and status 0, advice naming a flag kiln port lacks, tracebacks
    needs = tmp_path / "needs.py"
    needs.write_text("def make_model(x):\n    pass\n")
    with pytest.raises(KilnError, match=r"needs.py:make_model\(x\) needs arguments"):
        port(str(needs), quiet=True)
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(KilnError, match=r"exited while being imported \(SystemExit\(0\)\).*__main__"):
        port(str(exits), quiet=True)
    hf = tmp_path / "hf"
    hf.mkdir()
    for text, said in (('{"model_type": "bert"}', "kiln port takes the task from config.json's architectures"),
                       ("{bad", "is not valid JSON"), ("[]", "holds a JSON list, not an object")):
        (hf / "config.json").write_text(text)
        with pytest.raises(KilnError, match=said):
            port(str(hf), quiet=True)


def test_json_on_stdout_is_the_report_alone(kiln_cli, tmp_path):
    """What a model or its factory prints went to stdout before the JSON report, so a script's
    json.load of `kiln port --json` failed: it goes to stderr now."""
    (tmp_path / "chatty.py").write_text(
        "import torch\n"
        "def make():\n"
        "    print('loading the model')\n"
        "    return torch.nn.Linear(4, 2), torch.randn(1, 4)\n")
    r = forkserver.run([kiln_cli, "port", str(tmp_path / "chatty.py") + ":make", "--json", "--timing", "0.05"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tier"] == 1 and "loading the model" in r.stderr
