"""kiln's child processes (compile process, compile workers, replicas, ranks, benchmark
copies) import the kiln their parent runs: kiln.host.child puts its directory first on their
PYTHONPATH and keeps the working directory off their path."""
import os
import subprocess
import sys

import kiln
from kiln.host import child

HERE = os.path.dirname(os.path.abspath(kiln.__file__))


def _decoy(tmp_path):
    (tmp_path / "kiln").mkdir(parents=True)
    (tmp_path / "kiln" / "__init__.py").write_text("raise ImportError('the kiln in the working directory')\n")
    return tmp_path


def test_a_child_started_beside_another_kiln_imports_this_one(tmp_path):
    cwd = _decoy(tmp_path)
    code = "import kiln, sys; print(kiln.__file__); print(sys.argv[1:])"
    out = subprocess.run(child.python(code, "a", 2), cwd=cwd, env=child.environment(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    path, argv = out.stdout.splitlines()
    assert os.path.dirname(path) == HERE and argv == "['a', '2']"
    # what the compile process and ranks used before: the working directory's kiln
    bare = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=child.environment(),
                          capture_output=True, text=True, timeout=120)
    assert "the kiln in the working directory" in bare.stderr


def test_a_module_runs_as_main_with_its_arguments(tmp_path):
    cwd = _decoy(tmp_path / "work")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "echo_main.py").write_text("import sys, kiln\nprint(__name__, sys.argv[1:], kiln.__file__)\n")
    out = subprocess.run(child.module("echo_main", "x", 3), cwd=cwd,
                         env=child.environment({**os.environ, "PYTHONPATH": str(mods)}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    name, rest = out.stdout.split(" ", 1)
    assert name == "__main__" and rest.startswith("['x', '3'] ") and os.path.dirname(rest.split()[-1]) == HERE


def test_the_directory_put_first_holds_the_kiln_package():
    """Not the package directory itself, which made kiln's module names top-level names."""
    assert os.path.join(child.ROOT, "kiln") == HERE
    env = child.environment({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [child.ROOT, "/elsewhere"]
    assert child.environment({})["PYTHONPATH"] == child.ROOT
