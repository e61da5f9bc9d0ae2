"""Counts and figures shared by the reliability tests and ``benchmarks/reliability.py``.

The suite runs each fuzz, fault and soak test at a CI size. The benchmark runs
the *same* tests with ``KILN_RELIABILITY=long`` (the long-run sizes) and
``KILN_RELIABILITY_OUT=<dir>``, where each test writes its figures (cases tried,
crashes, data lost, RSS growth ...) as ``<name>.json``; the benchmark gathers
them into one table. One implementation, two sizes: what CI proves at small
scale is what the long run proves at large scale.
"""
import json
import os


def long_run() -> bool:
    return os.environ.get("KILN_RELIABILITY") == "long"


def count(ci: int, long: int) -> int:
    """How many cases to run: ``ci`` in the suite, ``long`` in the benchmark."""
    return long if long_run() else ci


def seconds(ci: float, long: float) -> float:
    """How long a soak runs: ``ci`` in the suite, ``long`` in the benchmark."""
    return long if long_run() else ci


def record(name: str, **figures):
    """Write this test's figures for the benchmark (a no-op in the plain suite)."""
    out = os.environ.get("KILN_RELIABILITY_OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
