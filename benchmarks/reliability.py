#!/usr/bin/env python
"""Reliability benchmark: the suite's fuzz, fault, soak and concurrency tests, run long.

The tests marked ``reliability`` (and the architecture zoo) run in CI at small
counts. This script runs the *same* tests with ``KILN_RELIABILITY=long``, which
scales them up (10,000 mutated artifacts, 500 kill -9s per writer, a 60-second
server soak, ...; see ``tests/reliability.py``), collects the figures each test
records, and prints them as one table. A failing test is a failed benchmark:
the table still prints, with the failures named.

Usage::

    python benchmarks/reliability.py              # long run (tens of minutes on 2 cores)
    python benchmarks/reliability.py --ci         # the CI sizes, for a quick look
    python benchmarks/reliability.py -k fuzz      # only some tests (pytest -k)

Results: a table on stdout and JSON (default ``benchmarks/results/reliability.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_fuzz_artifact.py", "tests/test_fuzz_inputs.py", "tests/test_faults.py",
         "tests/test_concurrency.py", "tests/test_serve_abuse.py", "tests/test_zoo.py"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ci", action="store_true", help="run at the CI sizes")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "reliability.json"))
    a = p.parse_args(argv)

    out = tempfile.mkdtemp(prefix="kiln-reliability-")
    env = dict(os.environ, KILN_RELIABILITY_OUT=out, PYTHONPATH=str(ROOT))
    if not a.ci:
        env["KILN_RELIABILITY"] = "long"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=3600",
           *[t for t in TESTS if (ROOT / t).exists()]]
    if a.k:
        cmd += ["-k", a.k]
    print("running:", " ".join(cmd[3:]), "(long)" if not a.ci else "(CI sizes)", flush=True)
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]

    figures = {}
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            figures[name.removesuffix(".json")] = json.load(f)
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]

    width = max([len(k) for k in figures] + [10])
    print(f"\n{'test':<{width}}  figures")
    for name, fig in figures.items():
        shown = ", ".join(f"{k}={v}" for k, v in fig.items() if not isinstance(v, (list, dict)))
        print(f"{name:<{width}}  {shown}")
    print(f"\npytest: {summary}  ({seconds:.0f} s)")
    for line in failed:
        print(line)

    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "size": "ci" if a.ci else "long", "host": platform.node(), "cpus": os.cpu_count(),
              "python": platform.python_version(), "seconds": round(seconds, 1),
              "pytest_summary": summary, "failures": failed, "returncode": proc.returncode,
              "figures": figures}
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.json}")
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-2000:])
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
