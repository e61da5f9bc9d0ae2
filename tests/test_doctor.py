"""kiln doctor: each check compares what is installed with kiln's own requirements and names the
one command that fixes a mismatch; run as the command, and with versions swapped in."""
import json
import os
import platform
import sys

from kiln.cli import doctor
from tests import forkserver


def test_kiln_doctor_reports_this_machine():
    r = forkserver.run([sys.executable, "-m", "kiln.cli", "doctor", "--json"], capture_output=True, text=True,
                       timeout=300)
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert r.returncode == (1 if any(c["status"] == "error" for c in checks.values()) else 0)
    import torch
    assert checks["torch"]["status"] == "ok" and checks["torch"]["found"].startswith(torch.__version__)
    for engine in ("engine onnxruntime", "engine openvino"):
        assert checks[engine]["status"] == "ok", checks[engine]
    assert {"python", "cpu", "malloc", "gpu", "compile cache"} <= set(checks)
    untouched = not any(k.startswith(("MALLOC_", "KILN_MALLOC")) for k in os.environ) and \
        "glibc.malloc." not in os.environ.get("GLIBC_TUNABLES", "") and "alloc" not in os.environ.get("LD_PRELOAD", "")
    if platform.libc_ver()[0] == "glibc" and untouched:       # what loading a compiled model will do
        assert "keeps up to 1024 MiB of freed memory" in checks["malloc"]["found"], checks["malloc"]
    table = forkserver.run([sys.executable, "-m", "kiln.cli", "doctor"], capture_output=True, text=True, timeout=300)
    assert "kiln doctor" in table.stdout and "error(s)" in table.stdout


def test_mismatches_are_errors_with_the_command_that_fixes_them(monkeypatch, tmp_path):
    versions = {"torch": "2.12.1", "onnxruntime": None, "openvino": "2026.4.1", "openvino-genai": "2025.3.0.0"}
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda dist: versions[dist] if dist in versions else real(dist))
    checks = {c["check"]: c for c in doctor.collect()}
    pin = str(doctor.requirement("torch").specifier)
    assert checks["torch"] == {"check": "torch", "status": "error", "found": f"2.12.1, kiln needs torch{pin}",
                               "fix": f"pip install 'torch{pin}'"}
    assert checks["engine onnxruntime"]["status"] == "error"
    assert checks["engine onnxruntime"]["fix"].startswith("pip install 'onnxruntime")
    assert checks["openvino-genai"]["status"] == "error"
    assert checks["openvino-genai"]["fix"] == "pip install 'openvino-genai==2026.4.*'"
    versions["openvino-genai"] = "2026.4.0.0"
    assert {c["check"]: c for c in doctor.collect()}["openvino-genai"]["status"] == "ok"
    monkeypatch.setenv("KILN_CACHE_URL", str(tmp_path / "cache"))
    assert doctor._cache()["status"] in ("ok", "warning")
    (tmp_path / "a-file").write_text("x")             # a file where the cache's directory would be ("ok", 12-03)
    for inside in ("", "sub"):
        monkeypatch.setenv("KILN_CACHE_URL", str(tmp_path / "a-file" / inside))
        cache = doctor._cache()
        assert cache["status"] == "error" and "is a file, not a directory" in cache["found"], cache
    monkeypatch.setenv("KILN_CACHE_URL", str(tmp_path / "cache"))
    # root can write anywhere, so an unwritable directory is simulated, not made
    monkeypatch.setattr(doctor.os, "access", lambda path, mode: False)
    cache = doctor._cache()
    assert cache["status"] == "error" and "not writable" in cache["found"] and "KILN_CACHE_URL" in cache["fix"]
    monkeypatch.undo()
    with monkeypatch.context() as m:
        m.setenv("KILN_CACHE_URL", "off")
        assert doctor._cache()["status"] == "warning"
