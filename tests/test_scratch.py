"""Engine scratch files go to shared memory when it has room, else the temp directory, and
are removed afterwards (kiln.scratch)."""
import os
import tempfile

import torch

from kiln import scratch


def test_scratch_goes_to_shared_memory_with_room_and_to_the_temp_dir_without(monkeypatch, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(scratch, "SHARED_MEMORY", str(shm))
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    with scratch.directory("kiln-test-", 1) as where:
        assert os.path.dirname(where) == str(shm)
        open(os.path.join(where, "model.onnx"), "wb").write(b"x")
    assert not os.path.exists(where)                               # removed with its files
    with scratch.directory("kiln-test-", free) as where:             # no room for it plus the margin
        assert os.path.dirname(where) == tempfile.gettempdir()
    assert not os.path.exists(where)
    monkeypatch.setattr(scratch, "SHARED_MEMORY", str(tmp_path / "missing"))
    assert scratch.root_for(1) is None


def test_tensor_bytes_counts_a_graphs_weights_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.register_buffer("b", torch.zeros(8, dtype=torch.float64))

        def forward(self, x):
            return (x @ self.w @ self.w) + self.b           # w read twice, counted once

    assert scratch.tensor_bytes(torch.fx.symbolic_trace(Tied())) == 8 * 8 * 4 + 8 * 8
