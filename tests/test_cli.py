"""The kiln command line, end to end as subprocesses."""
import json
import re

import numpy as np

from tests import models
from tests.conftest import ROOT
from tests import forkserver


def kiln_run(cli, *args, cwd=ROOT, timeout=300):
    return forkserver.run([cli, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_analyze_compile_inspect_run(kiln_cli, tmp_path):
    r = kiln_run(kiln_cli, "analyze", "tests.models:custom_op", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["unsupported_ops"][0]["op"] == "kilntest::odd_scale"

    r = kiln_run(kiln_cli, "analyze", "tests.models:custom_op")
    assert r.returncode == 0 and "kilntest::odd_scale" in r.stdout and "host" in r.stdout
    # compile prints its notes as analyze does (at -O2 the speed measured against eager; they
    # were in the manifest only); the op left on the host is the same model's
    r = kiln_run(kiln_cli, "compile", "tests.models:custom_op", "-o", tmp_path / "custom.kiln", "--no-cache")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^note: speed vs eager: [0-9.]+x", r.stdout, re.M), r.stdout

    art = tmp_path / "mlp.kiln"
    r = kiln_run(kiln_cli, "compile", "tests.models:mlp", "-o", art, "-O1")
    assert r.returncode == 0, r.stderr
    assert art.exists() and "validation" in r.stdout

    r = kiln_run(kiln_cli, "inspect", art)
    assert r.returncode == 0, r.stderr
    for text in ("onnxruntime", "partitions", "(2, 16)", "float32", "optlevel=1", "engine choice"):
        assert text in r.stdout
    r = kiln_run(kiln_cli, "inspect", art, "--json")
    assert json.loads(r.stdout)["compile_options"]["optlevel"] == 1

    model, x = models.mlp()
    np.save(tmp_path / "x.npy", x.numpy())
    r = kiln_run(kiln_cli, "run", art, "--input", tmp_path / "x.npy", "--output", tmp_path / "y.npy",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    y = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(y, model(x).detach().numpy(), atol=1e-4, rtol=1e-4)


def test_cli_errors_are_clear(kiln_cli, tmp_path):
    art = tmp_path / "x.kiln"
    r = kiln_run(kiln_cli, "compile", "tests.models:custom_op", "-o", art, "--no-fallback")
    assert r.returncode == 2
    assert "kilntest::odd_scale" in r.stderr and "Traceback" not in r.stderr
    assert not art.exists()

    r = kiln_run(kiln_cli, "compile", "tests.models:mlp", "--auto-cast", "all", "--auto-cast-type",
                 "tf32", "-o", art)
    assert r.returncode == 2 and "not supported on CPUs" in r.stderr

    r = kiln_run(kiln_cli, "compile", "tests.models:mlp", "--frobnicate", "-o", art)
    assert r.returncode == 2 and "unknown compiler flag '--frobnicate'" in r.stderr

    r = kiln_run(kiln_cli, "compile", "tests.models:nope")
    assert r.returncode == 2 and "no attribute 'nope'" in r.stderr

    bad = tmp_path / "bad.kiln"
    bad.write_bytes(b"garbage")
    r = kiln_run(kiln_cli, "inspect", bad)
    assert r.returncode == 2 and "not a kiln artifact" in r.stderr

    model, x = models.mlp()
    good = tmp_path / "good.kiln"
    assert kiln_run(kiln_cli, "compile", "tests.models:mlp", "-o", good).returncode == 0
    np.save(tmp_path / "wrong.npy", np.zeros((3, 16), dtype=np.float32))
    r = kiln_run(kiln_cli, "run", good, "--input", tmp_path / "wrong.npy")
    assert r.returncode == 2 and "expected (2, 16) float32, got (3, 16) float32" in r.stderr
    # a pickled array, an output path that is a directory, a count below one: each a clear error
    # (they were numpy's ValueError, numpy appending ".npy" to the directory's name, silently one)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    r = kiln_run(kiln_cli, "run", good, "--input", tmp_path / "objects.npy")
    assert r.returncode == 2 and "not a readable .npy array" in r.stderr and "Traceback" not in r.stderr
    np.save(tmp_path / "x.npy", x.numpy())
    r = kiln_run(kiln_cli, "run", good, "--input", tmp_path / "x.npy", "--output", tmp_path)
    assert r.returncode == 2 and "is a directory" in r.stderr
    r = kiln_run(kiln_cli, "run", good, "--input", tmp_path / "x.npy", "--threads", "0")
    assert r.returncode == 2 and "--threads: must be at least 1, got 0" in r.stderr
    # kiln serve's counts, times and port, checked as the other commands' are (until 12-03 a
    # server with --instances 0 or --timeout 0 started and answered nothing; --port 70000 was
    # a traceback), and other commands' bad arguments: exit status 2, one line
    for args, said in ((["serve", good, "--port", "70000"], "--port: must be 0 (any free port) to 65535"),
                       (["serve", good, "--instances", "0"], "--instances: must be at least 1, got 0"),
                       (["serve", good, "--timeout", "0"], "--timeout: must be above 0 seconds"),
                       (["serve", good, "--max-queue-delay-ms", "nan"], "--max-queue-delay-ms: must be a finite"),
                       (["bench", good, "--batch-sizes", "a"], "--batch-sizes must be comma-separated integers"),
                       (["parallel-compile", "--", str(tmp_path / "no-such-command")], "cannot run")):
        r = kiln_run(kiln_cli, *args)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_a_directory_or_a_factory_that_is_not_one_is_a_clear_error(tmp_path):
    """kiln.load of a directory (an Optimum export's, say) raised IsADirectoryError, and `kiln
    compile os:path` a TypeError from calling a module."""
    import pytest
    import kiln
    from kiln.errors import ArtifactError, KilnError
    from kiln.factory import load_factory
    (tmp_path / "model.kiln").write_bytes(b"")
    with pytest.raises(ArtifactError, match="is a directory, not a kiln artifact file: it holds .*model.kiln"):
        kiln.load(tmp_path)
    with pytest.raises(KilnError, match="os:path is a module, not a function"):
        load_factory("os:path", None)
    with pytest.raises(KilnError, match=r"json:loads\(s, .*needs arguments"):
        load_factory("json:loads", None)


def test_a_gated_compile_reports_its_gate_and_inspects(kiln_cli, tmp_path):
    """An auto-cast (or quantized) compile passes an accuracy gate instead of the
    comparison at a tolerance, and its manifest's validation has other fields: both
    commands used to end in a KeyError traceback on it."""
    art = tmp_path / "bf16.kiln"
    r = kiln_run(kiln_cli, "compile", "tests.models:mlp", "-o", art, "--auto-cast", "all",
                 "--auto-cast-type", "bf16")
    assert r.returncode == 0, r.stderr
    assert "accuracy gate passed: cosine" in r.stdout and "Traceback" not in r.stderr
    r = kiln_run(kiln_cli, "inspect", art)
    assert r.returncode == 0, r.stderr
    assert "accuracy gate passed" in r.stdout


def test_periods_and_counts_below_their_range_are_usage_errors(capsys):
    """`kiln monitor --period 0` exited with status 1 from inside the command and `kiln top
    --period 0` was taken; both are argparse's usage error (status 2) before anything runs."""
    import pytest
    from kiln.cli.app import build_parser
    for argv in (["monitor", "--period", "0"], ["top", "--once", "--period", "-1"], ["monitor", "--count", "0"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
    assert "must be above 0 seconds" in capsys.readouterr().err
