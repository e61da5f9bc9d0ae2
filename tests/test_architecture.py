"""The package's shape (docs/architecture.md), checked: layers, cycles, sizes, names, state.

These fail on the first change that breaks a rule, not in a later review: a runtime
module importing the compiler, an import cycle, a 600-line module, an environment
variable read outside kiln/config.py, a thread started by ``import kiln``.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import grimp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILN = os.path.join(ROOT, "kiln")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources():
    for dirpath, _, filenames in os.walk(KILN):
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def test_layers_contract_holds():
    """pyproject.toml's import-linter contract: each layer imports only those below it."""
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([lint, "--config", os.path.join(ROOT, "pyproject.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout


def _cycles(adj: dict) -> list:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in adj:
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    """No module imports one that (directly or not) imports it back, counting imports made
    inside functions: a lazy import hides a cycle from Python, not from the design."""
    graph = grimp.build_graph("kiln")
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(adj) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_modules_and_functions_stay_small():
    too_long = []
    for path, text in _sources():
        n = text.count("\n")
        if n > MAX_MODULE_LINES:
            too_long.append(f"{path}: {n} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path}:{node.lineno} {node.name}(): {length} lines")
    assert too_long == []


def test_no_private_names_imported_across_modules():
    found = []
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kiln"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path}:{node.lineno} imports {alias.name} from {node.module}")
    assert found == []


_ENV_READ = re.compile(r"""(environ\.get\(|getenv\()\s*f?["'](KILN|NEURON)_|environ\[\s*f?["'](KILN|NEURON)_\w*["']\](?!\s*=)""")


def test_environment_is_read_only_in_config():
    """Every KILN_*/NEURON_* variable is declared, with its meaning, in kiln/config.py."""
    offenders = [f"{path}: {line.strip()}" for path, text in _sources() if path != os.path.join("kiln", "config.py")
                 for line in text.splitlines() if _ENV_READ.search(line)]
    assert offenders == []


def test_every_variable_kiln_asks_for_is_declared():
    """config.get of an undeclared name raises at run time; catch it here instead, for literal
    names and the core settings built from a suffix."""
    from kiln import config
    asked = set()
    for _, text in _sources():
        asked |= set(re.findall(r"""config\.(?:get|flag|is_set)\(\s*["']([A-Z_]+)["']""", text))
    asked |= {f"{p}_{s}" for p in ("KILN",) for s in ("VISIBLE_CORES", "NUM_CORES", "CPUS_PER_CORE")}
    asked |= {f"NEURON_RT_{s}" for s in ("VISIBLE_CORES", "NUM_CORES")}
    assert sorted(asked - set(config.VARIABLES)) == []


def test_configuration_doc_lists_every_variable():
    from kiln import config
    doc = open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8").read()
    missing = [name for name in config.VARIABLES if f"`{name}`" not in doc]
    assert missing == []
    with pytest.raises(KeyError, match="not a kiln setting"):
        config.get("KILN_NO_SUCH_THING")


def test_a_misspelt_setting_is_named_at_import(monkeypatch):
    """``KILN_CACHE_DIR`` (for ``KILN_CACHE_URL``) was ignored without a word: a benchmark
    run compiled into the default cache. Now ``import kiln`` warns, with the nearest name."""
    env = {**os.environ, "KILN_CACHE_DIR": "/tmp/x", "KILN_ZQXJ": "1", "KILN_RELIABILITY": "long"}
    out = subprocess.run([sys.executable, "-W", "always", "-c", "import kiln"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "KILN_CACHE_DIR is set, but kiln reads no such variable; did you mean KILN_CACHE_URL?" in out.stderr
    assert "KILN_ZQXJ is set, but kiln reads no such variable (" in out.stderr
    assert "KILN_RELIABILITY" not in out.stderr                      # the test suite's own
    from kiln import config
    monkeypatch.setenv("KILN_CACHE_DIR", "/tmp/x")
    assert ("KILN_CACHE_DIR", "KILN_CACHE_URL") in config.unknown()
    monkeypatch.delenv("KILN_CACHE_DIR")
    assert all(name != "KILN_CACHE_DIR" for name, _ in config.unknown())


def test_importing_kiln_starts_nothing_and_writes_nothing(tmp_path):
    """No thread, no registry file, no placement change from imports alone."""
    code = textwrap.dedent("""
        import os, threading, json
        import kiln, kiln.neuron, kiln.neuronx, kiln.serving, kiln.cli
        from kiln.host import cores
        print(json.dumps({"threads": threading.active_count(),
                          "run_dir": os.listdir(os.environ["KILN_RUN_DIR"]),
                          "placement": cores.default_placement() is None}))
    """)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = dict(os.environ, KILN_RUN_DIR=str(run_dir), PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert state == {"threads": 1, "run_dir": [], "placement": True}
