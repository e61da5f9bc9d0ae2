"""A child Python that runs kiln code with this process's kiln.

kiln starts children of its own (the device's compile process, parallel compile workers,
serving replicas, ranks, benchmark copies), each importing kiln. Two things make them import
the kiln their parent runs:

* the directory holding this kiln goes first on their ``PYTHONPATH``: a parent that found
  kiln through its own ``sys.path`` (a checkout, a script's path) would otherwise have
  children find another, or none. Two sites had put the ``kiln`` package directory itself
  there, one level too deep, which made ``config``, ``errors`` and kiln's other module
  names importable as top-level names in those children (fixed here, 11-29);
* the working directory comes off their path. ``python -c`` and ``python -m`` put it first,
  ahead of ``PYTHONPATH``, so a training script run from a directory holding another
  ``kiln`` (a checkout of another version) had its compiles made by that one, and a
  ``torch.py`` there would have been imported by the child even where the parent's own path
  (which starts at its script's directory) does not hold it. Found when a comparison of two
  kiln worktrees ran one worktree's code in both (11-29).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # holds kiln/

# '' is how -c and -m put the working directory on the path (PYTHONSAFEPATH leaves it out)
_PREAMBLE = "import sys; sys.path[:] = [p for p in sys.path if p != '']; "


def python(code: str, *args) -> list:
    """The command line that runs ``code`` (Python statements) in a child, with ``args``
    as its ``sys.argv[1:]``."""
    return [sys.executable, "-c", _PREAMBLE + code, *[str(a) for a in args]]


def module(name: str, *args) -> list:
    """The command line that runs module ``name`` as ``__main__`` in a child."""
    return python(f"import runpy; runpy.run_module({name!r}, run_name='__main__', alter_sys=True)", *args)


def environment(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with this kiln's directory first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env
