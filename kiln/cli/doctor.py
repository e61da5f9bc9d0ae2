"""``kiln doctor``: what this machine has against what kiln needs, and the one command that fixes
each thing that is missing or mismatched.

Version mismatches are what Optimum Neuron's users trip on first (a compiler that does not
match the runtime, an add-on built for another release), so each check compares what is
installed with what kiln's own package metadata asks for, never with a list kept here:
torch against its pin, each engine against its requirement and whether it imports, the
optional packages of kiln's LLM and Hugging Face paths, OpenVINO GenAI against the installed
OpenVINO (they must be the same release), the CPU's instruction sets, an NVIDIA GPU, and the
compile cache's location (writable, free space).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import sys

from kiln.errors import KilnError

OK, WARN, ERROR = "ok", "warning", "error"
# optional packages: (import name, distribution, what needs it)
OPTIONAL = (("transformers", "transformers", "kiln.llm, kiln.optimum (Hugging Face models)"),
            ("gguf", "gguf", "reading GGUF files"),
            ("accelerate", "accelerate", "transformers' GGUF loading"),
            ("sentence_transformers", "sentence-transformers", "comparing NeuronSentenceTransformers"))


def add_parser(sub):
    p = sub.add_parser("doctor", help="check torch, engines, CPU, GPU and the compile cache; say how to fix")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)


def run(args, console) -> int:
    checks = collect()
    if args.json:
        print(json.dumps(checks, indent=1))
    else:
        from rich.table import Table
        t = Table("check", "status", "found", "fix", title="kiln doctor")
        style = {OK: "green", WARN: "yellow", ERROR: "bold red"}
        for c in checks:
            t.add_row(c["check"], f"[{style[c['status']]}]{c['status']}[/]", c["found"], c.get("fix") or "")
        console.print(t)
        errors = sum(c["status"] == ERROR for c in checks)
        console.print(f"{errors} error(s), {sum(c['status'] == WARN for c in checks)} warning(s)")
    return 1 if any(c["status"] == ERROR for c in checks) else 0


def collect() -> list:
    out = [_python(), _torch()]
    out += _engines()
    out += [_optional(*o) for o in OPTIONAL]
    out += [_genai(), _cpu(), _malloc(), _gpu(), _cache()]
    return [c for c in out if c is not None]


def _check(name, status, found, fix=None) -> dict:
    return {"check": name, "status": status, "found": found, **({"fix": fix} if fix else {})}


def requirement(dist: str):
    """kiln's own requirement on ``dist`` (a ``packaging`` Requirement), or None."""
    from packaging.requirements import Requirement
    for line in importlib.metadata.requires("kiln") or []:
        req = Requirement(line)
        if req.name.lower().replace("_", "-") == dist.lower().replace("_", "-"):
            return req
    return None


def _installed(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _against(name: str, dist: str, version: str | None, what: str) -> dict:
    req = requirement(dist)
    spec = str(req.specifier) if req is not None else ""
    fix = f"pip install '{dist}{spec}'"
    if version is None:
        return _check(name, ERROR, f"not installed ({what})", fix)
    if req is not None and req.specifier and not req.specifier.contains(version.split("+")[0], prereleases=True):
        return _check(name, ERROR, f"{version}, kiln needs {dist}{spec}", fix)
    return _check(name, OK, version + (f" ({dist}{spec})" if spec else ""))


def _malloc() -> dict:
    from kiln.host import memory
    try:
        return _check("malloc", OK, memory.describe())
    except KilnError as e:
        return _check("malloc", ERROR, str(e), "set KILN_MALLOC_KEEP to a size such as 1G, or 0")


def _python() -> dict:
    v = sys.version.split()[0]
    if sys.version_info < (3, 10):
        return _check("python", ERROR, v, "use Python 3.10 or newer")
    return _check("python", OK, v)


def _torch() -> dict:
    version = _installed("torch")
    check = _against("torch", "torch", version, "kiln's capture, device and runtime")
    if check["status"] == OK and "+cu" not in (version or "") and _nvidia_present():
        check.update(status=WARN, found=f"{version}: a CPU build on a machine with an NVIDIA GPU",
                     fix="install a CUDA build of the same torch version to compile for the GPU")
    return check


def _engines() -> list:
    from kiln import engines
    out = []
    for name in engines.names():
        engine = engines.describe(name)
        if engine is None or not engine.package:
            continue
        check = _against(f"engine {name}", engine.package, _installed(engine.package), engine.title)
        why = engine.missing() if check["status"] == OK else None
        if why:
            check.update(status=ERROR, found=f"{check['found']}, but {why}",
                         fix=f"pip install --force-reinstall '{engine.package}'")
        out.append(check)
    return out


def _optional(module: str, dist: str, what: str) -> dict:
    version = _installed(dist)
    if version is None:
        return _check(dist, WARN, f"not installed: needed for {what}", f"pip install {dist}")
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - a broken install is what this check is for
        return _check(dist, ERROR, f"{version} does not import: {type(e).__name__}: {str(e)[:120]}",
                      f"pip install --force-reinstall {dist}")
    return _check(dist, OK, version)


def _genai():
    """OpenVINO GenAI (a benchmark peer) must be the release of the installed OpenVINO."""
    genai, ov = _installed("openvino-genai"), _installed("openvino")
    if genai is None:
        return None
    release = ".".join((ov or "").split(".")[:2])
    if ov is None or not genai.startswith(release):
        return _check("openvino-genai", ERROR, f"{genai} with openvino {ov}: they must be the same release",
                      f"pip install 'openvino-genai=={release}.*'")
    return _check("openvino-genai", OK, f"{genai} (openvino {ov})")


def _cpu() -> dict:
    from kiln.host import target
    isa = target.describe("native")["isa"]
    found = f"{target.arch()}: {' '.join(isa) or 'no SIMD extensions kiln knows'}"
    if target.arch() in ("x86_64", "amd64") and "avx2" not in isa:
        return _check("cpu", WARN, found + " (no AVX2: the engines fall back to slower kernels)")
    return _check("cpu", OK, found)


def _nvidia_present() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia/version")


def _gpu() -> dict:
    import torch
    if torch.cuda.is_available():
        return _check("gpu", OK, f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})")
    if _nvidia_present():
        return _check("gpu", WARN, "an NVIDIA driver, but torch sees no GPU (a CPU build of torch?)",
                      "install a CUDA build of torch to compile for the GPU")
    return _check("gpu", OK, "none (kiln runs on the CPU)")


def _cache() -> dict:
    from kiln.compiler import cache
    url = cache.resolve_url()
    if url is None:
        return _check("compile cache", WARN, "off (KILN_CACHE_URL)", "unset KILN_CACHE_URL to cache compiled graphs")
    if "://" in url and not url.startswith("file://"):
        return _check("compile cache", OK, f"{url} (remote)")
    path = url.removeprefix("file://")
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe and not os.path.isdir(probe):      # a file on the way ("ok" until 12-03)
        return _check("compile cache", ERROR, f"{path}: {probe} is a file, not a directory",
                      "export KILN_CACHE_URL=<a writable directory>")
    if not probe or not os.access(probe, os.W_OK):
        return _check("compile cache", ERROR, f"{path}: not writable",
                      "export KILN_CACHE_URL=<a writable directory>")
    free = shutil.disk_usage(probe).free
    status = WARN if free < 2 * 10**9 else OK
    return _check("compile cache", status, f"{path} ({free / 1e9:.1f} GB free)",
                  "free some space, or kiln cache prune" if status == WARN else None)
