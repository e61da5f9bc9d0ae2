"""kiln.host.memory: once a compiled model is loaded, glibc's malloc keeps freed memory
mapped, so a step that allocates and frees the same buffers again takes no page faults
(counted with getrusage, never timed); ``KILN_MALLOC_KEEP=0`` and a user's own malloc
tuning leave glibc alone; a bad value is a clear error."""
import json
import platform

import pytest
import torch

from tests.conftest import run_py

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# 20 blocks of 5 MiB from malloc itself (no Python objects land between them), written and
# freed: a step's worth of medium buffers. Faults per round are counted before and after a
# compiled model is loaded in a fresh process.
PROBE = r"""
import ctypes, json, resource, torch, kiln
from kiln.host import memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 5 << 20

def churn():
    blocks = [libc.malloc(SIZE) for _ in range(20)]
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    for b in reversed(blocks):
        libc.free(b)

def faults(rounds=4):
    churn(); churn()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        churn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / rounds

before = faults()
model = kiln.load(PATH)          # loaded, as from the cache: a compile's own frees would move glibc's thresholds
assert torch.allclose(model(torch.ones(2, 4)), model(torch.ones(2, 4)))
print(json.dumps({"before": before, "after": faults(), "state": memory.state()}))
"""
PAGES = (20 * 5 << 20) // 4096            # 4 KiB pages a round writes (fewer faults with huge pages)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    import kiln
    path = tmp_path_factory.mktemp("memory") / "linear.kiln"
    kiln.trace(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),), optlevel=1, cache=False).save(path)
    return str(path)


def _probe(env, path):
    proc = run_py(f"PATH = {path!r}\n" + PROBE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loading_a_compiled_model_stops_the_page_faults_of_each_step(artifact):
    got = _probe({"KILN_MALLOC_KEEP": "1G", "GLIBC_TUNABLES": "", "LD_PRELOAD": ""}, artifact)
    assert got["state"]["applied"], got
    assert got["before"] > PAGES / 10, got         # glibc's defaults: the pages come back each round
    assert got["after"] < PAGES / 100, got         # kept: (almost) none do


@pytest.mark.parametrize("env, reason", [
    ({"KILN_MALLOC_KEEP": "0"}, "KILN_MALLOC_KEEP=0"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1000000"}, "GLIBC_TUNABLES"),
])
def test_off_switch_and_a_users_own_tuning_leave_glibc_alone(env, reason, artifact):
    got = _probe(dict({"GLIBC_TUNABLES": "", "LD_PRELOAD": ""}, **env), artifact)
    assert not got["state"]["applied"] and reason in got["state"]["reason"], got
    if "KILN_MALLOC_KEEP" in env:
        assert got["after"] > PAGES / 10, got      # and the faults stay: the probe can tell


def test_a_bad_value_is_a_clear_error(monkeypatch):
    from kiln.errors import KilnError
    from kiln.host import memory
    monkeypatch.setenv("KILN_MALLOC_KEEP", "lots")
    with pytest.raises(KilnError, match="KILN_MALLOC_KEEP='lots'.*1G or 512M"):
        memory.keep_bytes()
    for text, want in (("1G", 1 << 30), ("512M", 512 << 20), ("0", 0), ("4096", 4096)):
        monkeypatch.setenv("KILN_MALLOC_KEEP", text)
        assert memory.keep_bytes() == want
