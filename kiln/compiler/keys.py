"""Compile-cache keys: what a compiled graph depends on, hashed.

Two keys, both content hashes: the *graph key* (the captured graph, its weights and
constants, the compile options, and the environment: kiln's own source, torch and
engine versions) names a cache entry; the *fingerprint* (the model's class source,
settings and weights plus the example inputs, computed without capturing) is an alias
to a graph key, so a warm cache skips capture too.
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


def _settings(value, depth=0):
    """Non-tensor module state as canonical JSON; unknown objects by type (and to_dict)."""
    if isinstance(value, (int, float, bool, str)) or value is None:
        return value
    if depth > 4:
        return ["deep", type(value).__name__]
    if isinstance(value, (list, tuple)):
        return [_settings(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        # sorted: a set's order follows string hashing, which differs per process
        return ["set", sorted((_settings(v, depth + 1) for v in value), key=json.dumps)]
    if isinstance(value, dict):
        return {str(k): _settings(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        try:
            return [type(value).__qualname__, _settings(value.to_dict(), depth + 1)]
        except Exception:  # noqa: BLE001
            pass
    if callable(value):
        code = getattr(value, "__code__", None)
        return ["callable", getattr(value, "__qualname__", type(value).__qualname__),
                hashlib.sha256(code.co_code).hexdigest() if code else None]
    text = repr(value)
    return [type(value).__qualname__, None if " at 0x" in text else text]


_SKIP = {"_parameters", "_buffers", "_modules", "training",
         "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
         "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_non_persistent_buffers_set",
         "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
         "_is_full_backward_hook", "_compiled_call_impl"}


# Forward hooks change what the model computes; their dict keys are process-global
# counters, so only the hooks themselves (in order) go into the fingerprint.
_HOOKS = {"_forward_hooks", "_forward_pre_hooks"}


def fingerprint(model, named_inputs: dict, opts, extra=None) -> str | None:
    """The fast key: no capture. None when the model is not an ``nn.Module`` (functions
    have no reliable identity), which then always captures."""
    if not isinstance(model, torch.nn.Module):
        return None
    modules = []
    for name, mod in model.named_modules():
        state = {k: _settings(list(v.values()) if k in _HOOKS else v) for k, v in vars(mod).items()
                 if k not in _SKIP and not isinstance(v, torch.Tensor)}
        if isinstance(mod, torch.fx.GraphModule):
            # what it computes is its graph, not its class or state; a lazily compiled
            # one (AOTAutograd's) has no _code yet, and two such graphs over the same
            # inputs (a forward in fp32 and under bf16 autocast) once shared one key
            state["graph"] = mod.code
        modules.append([name, _class_digest(type(mod)), state])
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    leaves, in_specs = [], []
    structure = {n: specs.encode(v, n, leaves, in_specs) for n, v in named_inputs.items()}
    return _hash_json({
        "kind": "fingerprint", "modules": modules, "weights": tensors_digest(tensors),
        "inputs": [s.to_dict() for s in in_specs], "structure": structure,
        "options": _options_for_key(opts), "extra": extra, "env": _environment(),
        "target": target_mod.describe(opts.target, opts.device)})
