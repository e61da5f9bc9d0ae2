"""The tests' fork server (tests/forkserver.py) gives a child what a new interpreter gives it:
the same sys.argv, sys.path, environment, working directory, modules (torch, and kiln's device
only through torch's autoload), exit statuses, streams and tracebacks; what it cannot honour
runs as a plain subprocess."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests import forkserver
from tests.conftest import ROOT

PROBE = """
import json, os, sys
import torch  # noqa: F401  (what every command run this way does)
print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "foo": os.environ.get("FOO"),
                  "name": __name__, "kiln": sorted(m for m in sys.modules if m.split(".")[0] == "kiln"),
                  "torch": "torch" in sys.modules, "main": sorted(k for k in vars(sys.modules["__main__"])
                                                                 if not k.startswith("__"))}))
data = sys.stdin.read()
print(data.upper(), end="")
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("CODE", "0")))
"""


def both(argv, **kw):
    return forkserver.run(argv, **kw), subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def test_a_forked_child_sees_what_a_new_interpreter_sees(tmp_path):
    env = dict(os.environ, FOO="bar", CODE="3", PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    forked, fresh = both([sys.executable, "-c", PROBE, "a", "b"], cwd=tmp_path, env=env, input="hello")
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 3 and fresh.stdout.endswith("HELLO")
    seen = json.loads(fresh.stdout.splitlines()[0])
    assert seen["argv"] == ["-c", "a", "b"] and seen["cwd"] == str(tmp_path) and seen["foo"] == "bar"
    # the console script, `python -m` and an uncaught exception's traceback and status
    kiln = os.path.join(os.path.dirname(sys.executable), "kiln")
    for argv in ([kiln, "inspect", str(tmp_path / "missing.kiln")], [sys.executable, "-m", "kiln"],
                 [sys.executable, "-c", "import torch\nraise ValueError('boom')"]):
        forked, fresh = both(argv, cwd=ROOT)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert "ValueError: boom" in fresh.stderr and fresh.returncode == 1
    # code that names neither torch nor kiln runs in a new interpreter, without them
    r = forkserver.run([sys.executable, "-c", "import sys; print(sorted(m for m in sys.modules if 'orch' in m))"])
    assert r.stdout.strip() == "[]"


def test_a_child_is_a_process_of_its_own():
    # the child's pid, its own signal death and a timeout that kills it
    code = "import os, signal, torch; print(os.getpid(), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    r = forkserver.run([sys.executable, "-c", code])
    assert r.returncode == -signal.SIGKILL and int(r.stdout) != os.getpid()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run([sys.executable, "-c", "import time, torch; print('started', flush=True); time.sleep(60)"],
                       timeout=1)
    assert "started" in e.value.output
    # an environment torch reads while it imports cannot be honoured by the zygote: a new
    # interpreter runs it, and sees it
    threads = "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1"
    r = forkserver.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                       env=dict(os.environ, OMP_NUM_THREADS=threads))
    assert r.stdout.strip() == threads
