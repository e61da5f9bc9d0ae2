"""kiln serve names models after their files, and merges requests only when that is proven exact.

Issue 14: ``kiln serve tiny.kiln`` published ``/v2/models/Sequential`` (the Python class), and a
model whose rows interact (``h - h.amax(0)``: each row against the batch) silently answered
merged requests with other clients' rows mixed in. The server now checks at load, on synthetic
inputs, that every row of a merged batch equals that row run alone, and turns batching off for
the model otherwise.
"""
import json
import re

import numpy as np
import pytest
import torch

import kiln
from kiln.serving.layout import Axis, Layout
from kiln.serving.merging import check_merging
from kiln.serving.repository import resolve_models
from kiln.artifact.specs import TensorSpec

from .test_serve import Server, _histogram

httpclient = pytest.importorskip("tritonclient.http")

ATOL = RTOL = 1e-5


class RowMix(torch.nn.Module):
    """Each row relative to the batch's column maxima: rows interact. Padding a batch with
    repeated rows (dynamic batch) does not change a max, so one request alone is exact;
    merged with other requests it is not."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.lin(x)
        return h - h.amax(0, keepdim=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_merge")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    kiln.trace(mlp, torch.randn(4, 16), dynamic_batch=True).save(d / "tiny.kiln")   # no name=
    rowmix = RowMix().eval()
    # validate=False: kiln.trace's own dynamic-batch check would refuse this model (a batch
    # larger than the compiled 8 is chunked); the server must not rely on that check having run
    kiln.trace(rowmix, torch.randn(8, 16), dynamic_batch=True, validate=False).save(d / "rowmix.kiln")
    return {"dir": d, "mlp": mlp, "rowmix": rowmix}


@pytest.fixture(scope="module")
def server(artifacts):
    d = artifacts["dir"]
    s = Server([d / "tiny.kiln", d / "rowmix.kiln", "--max-batch-size", "8",
                "--max-queue-delay-ms", "50"], d / "server.log")
    yield s
    s.stop()


def eager(module, x):
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


# -- names ---------------------------------------------------------------------------------------
def test_models_are_named_after_their_file(server, artifacts):
    d = artifacts["dir"]
    assert list(resolve_models([str(d / "tiny.kiln")])) == ["tiny"]
    assert list(resolve_models([f"mlp={d / 'tiny.kiln'}"])) == ["mlp"]      # name= still overrides
    c = httpclient.InferenceServerClient(server.url)
    assert c.is_model_ready("tiny") and c.is_model_ready("rowmix")
    meta = c.get_model_metadata("tiny")
    assert meta["name"] == "tiny" and meta["platform"] == "kiln"
    assert meta["parameters"]["model_name"] == "Sequential"     # the manifest's name stays visible
    config = c.get_model_config("tiny")
    assert config["parameters"]["model_name"] == {"string_value": "Sequential"}
    status, body = server.get("/v2/models/Sequential")
    assert status == 404 and "unknown model 'Sequential'" in json.loads(body)["error"]
    index = server.post_json("/v2/repository/index", {})[1]
    assert sorted(m["name"] for m in index) == ["rowmix", "tiny"]
    c.close()


# -- the merge check, in process ---------------------------------------------------------------------
class Fake:
    """A duck-typed model: specs and a torch function of the flat inputs."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.input_specs, self.output_specs = fn, inputs, outputs

    def run_flat(self, flat):
        return list(self.fn(*flat))


def _dynamic(n_in=1, n_out=1):
    return Layout([{0}] * n_in, [{0}] * n_out, [True] * n_in, [True] * n_out)


def test_check_merging_finds_rows_that_interact():
    x = [TensorSpec("x", (4, 3), torch.float32)]
    y = [TensorSpec("y", (4, 3), torch.float32)]
    ok = check_merging(Fake(lambda t: (t * 2 + 1,), x, y), _dynamic(), 8)
    assert ok.safe and ok.cases == ["2 rows", "8 rows"] and ok.max_diff == 0
    bad = check_merging(Fake(lambda t: (t - t.mean(0, keepdim=True),), x, y), _dynamic(), 8)
    assert not bad.safe and bad.output == "y" and bad.case == "2 rows" and bad.max_diff > 0.05
    assert "rows interact" in bad.describe() and "output 'y'" in bad.describe()
    # integer outputs must be exact; ints are fed as 0/1 (valid ids and masks)
    ids = [TensorSpec("ids", (2, 5), torch.int64)]
    out = [TensorSpec("n", (2,), torch.int64)]
    assert check_merging(Fake(lambda t: (t.sum(1),), ids, out), _dynamic(), 4).safe
    seen = []
    mixed = check_merging(Fake(lambda t: (seen.append(t.clone()) or t.sum(1) + t.sum(),), ids, out),
                          _dynamic(), 4)
    assert not mixed.safe and mixed.max_diff >= 1 and "exact" in mixed.tolerance
    assert all(set(t.unique().tolist()) <= {0, 1} for t in seen)
    # a model that fails on a merged batch cannot be merged
    def no_batches(t):
        if t.shape[0] > 1:
            raise RuntimeError("batch of one only")
        return (t,)
    failed = check_merging(Fake(no_batches, x, y), _dynamic(), 8)
    assert not failed.safe and "batch of one only" in failed.error
    # a large batch compares its first rows and its last one (what a chunked batch pads with)
    def last_row_sees_a_big_batch(t):
        out = t.clone()
        out[-1] += float(t.shape[0] > 9)
        return (out,)
    big = check_merging(Fake(last_row_sees_a_big_batch, x, y), _dynamic(), 16)
    assert not big.safe and big.case == "16 rows" and big.row == 15 and big.max_diff == pytest.approx(1)


class IntStat(torch.nn.Module):
    """Rows interact through an integer statistic of the batch: each row's pooled embedding
    over the batch's largest id (found by probing: ids of 0/1 all have the same max)."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(64, 4)

    def forward(self, ids):
        return self.e(ids).sum(1) / ids.max().clamp(min=1).float()


def test_check_merging_draws_ids_over_their_range():
    """A compiled model's index inputs get random ids over the range its artifact records, so
    a statistic of the ids across the batch shows; 0/1 ids alone proved this model mergeable
    and the server mixed two clients' answers (off by 1.9)."""
    torch.manual_seed(9)
    model = kiln.trace(IntStat().eval(), torch.randint(0, 64, (2, 5)), dynamic_batch=True, validate=False)
    assert [r[2:4] for r in model.index_ranges] == [(0, 64)]
    check = check_merging(model, _dynamic(), 4)
    assert not check.safe and check.max_diff > 1e-3 and "rows interact" in check.describe()


def test_check_merging_pads_a_bucketed_axis_as_the_batcher_does():
    # rows of one bucket (lengths 1..4 of bucket 4) are padded to the group's longest with the
    # pad value: a masked mean cannot see it, a plain mean over the axis can
    specs = [TensorSpec("x", (2, 8, 3), torch.float32), TensorSpec("mask", (2, 8), torch.float32)]
    out = [TensorSpec("pooled", (2, 3), torch.float32)]
    lay = Layout([{0, 1}, {0, 1}], [{0}], [True, True], [True],
                 axes=[Axis([(0, 1), (1, 1)], [], [4, 8], {1: 0.0})])
    masked = Fake(lambda x, m: ((x * m[..., None]).sum(1) / m.sum(1, keepdim=True),), specs, out)
    check = check_merging(masked, lay, 4)
    assert check.safe and check.cases == ["2 rows, lengths 4 3", "4 rows, lengths 4 3 2 1"]
    visible = check_merging(Fake(lambda x, m: (x.mean(1),), specs, out), lay, 4)
    assert not visible.safe and visible.output == "pooled"


# -- served: rows that interact run alone; independent rows keep merging -----------------------------
def _concurrent(server, model, module, rng, n=48, rows=(1, 2, 3)):
    c = httpclient.InferenceServerClient(server.url, concurrency=16)
    jobs = []
    for k in range(n):
        x = rng.standard_normal((rows[k % len(rows)], 16)).astype(np.float32)
        inp = httpclient.InferInput("input" if model == "tiny" else "x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        jobs.append((x, c.async_infer(model, [inp])))
    for x, job in jobs:
        np.testing.assert_allclose(job.get_result(timeout=60).as_numpy("output0"), eager(module, x),
                                   atol=ATOL, rtol=RTOL)
    c.close()


def test_rows_that_interact_are_answered_alone(server, artifacts):
    before = _histogram(server.get("/metrics")[1].decode(), "kiln_serve_batch_size", "rowmix")
    _concurrent(server, "rowmix", artifacts["rowmix"], np.random.default_rng(1))
    text = server.get("/metrics")[1].decode()
    after = _histogram(text, "kiln_serve_batch_size", "rowmix")
    # every batch is one request (1 to 3 rows), never a merge of several
    assert after["+Inf"] - before.get("+Inf", 0) == 48
    assert after["4.0"] - before.get("4.0", 0) == 48
    assert re.search(r'^kiln_serve_model_batching\{model="rowmix"\} 0\.0$', text, re.M)
    c = httpclient.InferenceServerClient(server.url)
    config = c.get_model_config("rowmix")
    assert config["max_batch_size"] == 0 and config["dynamic_batching"] is None
    note = config["parameters"]["batching"]["string_value"]
    assert note.startswith("off: rows interact") and "output 'output0'" in note
    assert c.get_model_metadata("rowmix")["parameters"]["batching"] == note
    c.close()
    warnings = [e for e in server.events() if e["event"] == "batching_unsafe"]
    assert [w["model"] for w in warnings] == ["rowmix"]
    assert warnings[0]["level"] == "warning" and warnings[0]["max_diff"] > 1e-3
    assert warnings[0]["output"] == "output0" and warnings[0]["case"] == "2 rows"


def test_independent_rows_keep_merging(server, artifacts):
    before = _histogram(server.get("/metrics")[1].decode(), "kiln_serve_batch_size", "tiny")
    _concurrent(server, "tiny", artifacts["mlp"], np.random.default_rng(2))
    text = server.get("/metrics")[1].decode()
    after = _histogram(text, "kiln_serve_batch_size", "tiny")
    batches = after["+Inf"] - before.get("+Inf", 0)
    assert batches < 48, "requests were not merged"
    assert re.search(r'^kiln_serve_model_batching\{model="tiny"\} 1\.0$', text, re.M)
    c = httpclient.InferenceServerClient(server.url)
    config = c.get_model_config("tiny")
    assert config["max_batch_size"] == 8 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 50000
    assert config["parameters"]["batching"]["string_value"].startswith("on: merging checked")
    c.close()
    checked = [e for e in server.events() if e["event"] == "merge_checked"]
    assert [e["model"] for e in checked] == ["tiny"] and checked[0]["max_diff"] <= 1e-5
