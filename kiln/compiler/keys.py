"""Compile-cache keys: what a compiled graph depends on, hashed.

Two keys, both content hashes: the *graph key* (the captured graph, its weights and
constants, the compile options, and the environment: kiln's own source, torch and
engine versions) names a cache entry; the *fingerprint* (:mod:`kiln.compiler.fingerprint`:
the model's code, state and weights plus the example inputs, computed without capturing)
is an alias to a graph key, so a warm cache skips capture too.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from kiln._version import __version__
from kiln.artifact import specs
from kiln.artifact.container import FORMAT_VERSION
from kiln.host import target as target_mod

KEY_VERSION = 3            # bump when what goes into a key changes (3: GraphModules' code)


# -- keys ------------------------------------------------------------------------------------------
def _engine_versions() -> dict:
    """Installed engine versions, from package metadata (importing OpenVINO takes a second)."""
    from kiln import engines
    return engines.versions(metadata=True)    # each engine names its package (Engine.package)


def _environment() -> dict:
    """What a key holds of the process: kiln, torch, and the engines registered *now*. An
    engine registered or removed after the first key (a plugin, a test's engine) changes
    the keys made after it: an entry compiled when another set of engines could be chosen
    is not served (it was, when this was computed once per process)."""
    from kiln import engines
    return _environment_for(tuple(engines.names()))


@functools.lru_cache(maxsize=8)
def _environment_for(engine_names: tuple) -> dict:
    return {"key_version": KEY_VERSION, "format_version": FORMAT_VERSION, "kiln": __version__,
            "kiln_source": _kiln_source_digest(), "torch": torch.__version__,
            "engines": _engine_versions()}


def _options_for_key(opts) -> dict:
    # validate/atol/rtol stay in: a stricter tolerance must re-check, not reuse a pass.
    return opts.to_dict()


def _kiln_source_digest() -> str:
    """kiln's own code, by content: a fix in kiln must not be served stale artifacts
    compiled by the code it fixed, even before the version number moves."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the kiln package
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(here)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                h.update(name.encode())
                h.update(_file_digest(os.path.join(dirpath, name)).encode())
    return h.hexdigest()


def _hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _compute_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # XXH3-128 hashes at memory speed (BLAKE2b took 1.5 s for BERT-base's 440 MB); a
    # fingerprint only has to tell models apart, not resist forgery: whoever can
    # write to the cache can replace entries anyway.
    h = xxhash.xxh3_128()
    h.update(f"{specs.dtype_name(t.dtype)}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().data if t.dtype != torch.bool
                 else t.to(torch.uint8).numpy().data)
    return h.hexdigest()


def tensors_digest(named_tensors) -> str:
    """One digest over (name, tensor) pairs; tensors hash in parallel (xxhash drops the GIL
    for large inputs), every time: a digest remembered per tensor while its ``data_ptr`` and
    ``_version`` stayed put missed writes through ``param.data`` (``p.data.copy_(...)`` moves
    neither), and the next trace was served the entry compiled with the old weights.
    XXH3 reads SmolLM2-135M's 530 MB of weights in 0.03 s on 2 cores."""
    items = list(named_tensors)
    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda kv: _compute_digest(kv[1]), items))
    return _hash_json([[name, d] for (name, _), d in zip(items, digests)])


def _literal(a, index):
    """A node argument as canonical JSON: nodes by position, values by repr."""
    if isinstance(a, torch.fx.Node):
        return ["node", index[a]]
    if isinstance(a, (list, tuple)):
        return [type(a).__name__, [_literal(x, index) for x in a]]
    if isinstance(a, dict):
        return ["dict", sorted((str(k), _literal(v, index)) for k, v in a.items())]
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ["torch", str(a)]
    if isinstance(a, (int, float, bool, str)) or a is None:
        return a
    return ["repr", type(a).__name__, repr(a)]


def graph_key(captured, opts, extra=None) -> str:
    """The entry key: canonical graph + weights + options + engines + ISA (see module doc)."""
    gm = captured.graph_module
    index, nodes, attrs = {}, [], []
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        meta = None
        if isinstance(val, torch.Tensor):
            meta = [list(val.shape), specs.dtype_name(val.dtype)]
        target = node.target
        if node.op == "get_attr":
            attrs.append(target)
            target = ["attr", len(attrs) - 1]
        elif not isinstance(target, str):
            target = getattr(target, "name", None) and target.name() or repr(target)
        elif node.op == "placeholder":
            target = "input"
        nodes.append([node.op, target, _literal(node.args, index), _literal(node.kwargs, index), meta])
    weights = [(f"attr{i}", _fetch_attr(gm, a)) for i, a in enumerate(attrs)]
    weights = [(n, t) for n, t in weights if isinstance(t, torch.Tensor)]
    return _hash_json({
        "kind": "graph", "graph": nodes, "weights": tensors_digest(weights),
        "inputs": [s.to_dict() for s in captured.input_specs],
        "input_structure": captured.input_structure, "output_structure": captured.output_structure,
        "options": _options_for_key(opts), "extra": extra, "env": _environment(),
        "target": target_mod.describe(opts.target, opts.device)})


def _fetch_attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=256)
def _file_digest(path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


def _class_digest(cls) -> list:
    """A class's identity without its location: qualname + the content of its source file
    (helpers in the same file are covered) + its package's version (imports are not)."""
    try:
        path = inspect.getsourcefile(cls) or inspect.getfile(cls)
        content = _file_digest(path)
    except (TypeError, OSError):
        content = "builtin"
    return [cls.__qualname__, content, _package_version((cls.__module__ or "").split(".")[0])]


@functools.lru_cache(maxsize=None)
def _package_version(top):
    try:
        return importlib.metadata.version(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
