"""Artifacts written by kiln before the layered restructure (issue 15) still load and
answer as eager does. The files in tests/data were written by commit efe2c47 (the
last flat-module layout) from the model whose weights are in pre15-model.pt."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import kiln
from tests import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return torch.softmax(self.b(torch.relu(self.a(x))), -1)


@pytest.fixture(scope="module")
def eager():
    saved = torch.load(os.path.join(DATA, "pre15-model.pt"), weights_only=True)
    m = MLP().eval()
    m.load_state_dict(saved["state"])
    return m, saved


@pytest.mark.parametrize("name", ["onnxruntime", "openvino", "dynamic-batch", "bucketed"])
def test_pre_restructure_artifacts_load_and_match_eager(name, eager):
    if name == "openvino":
        pytest.importorskip("openvino")
    m, saved = eager
    try:
        loaded = kiln.load(os.path.join(DATA, f"pre15-{name}.kiln"))
    except kiln.ArtifactError as e:
        # OpenVINO's compiled blobs are tied to the CPU that compiled them (these files to
        # the machine of commit efe2c47): elsewhere the answer is this clear error
        if name not in ("openvino", "bucketed") or "compiled for another CPU" not in str(e):
            raise
        pytest.skip(f"the stored OpenVINO blob is for another CPU; kiln said so clearly: {e}")
    x = saved["seq"] if name == "bucketed" else saved["x"]
    if name == "dynamic-batch":
        x = torch.cat([x, x[:1]])          # 3 rows through a batch-2 graph
    if name == "bucketed":
        x = x[:, :5]                       # padded up to the 8 bucket
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), m(x), atol=1e-5, rtol=1e-4)


def test_pre_restructure_artifact_loads_in_a_fresh_process():
    code = ("import kiln, torch; m = kiln.load(%r); print(tuple(m(torch.zeros(2, 8)).shape))"
            % os.path.join(DATA, "pre15-onnxruntime.kiln"))
    r = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("(2, 4)")
