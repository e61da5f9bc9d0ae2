"""The host's CPU instruction-set features, recorded in artifacts and checked at load.

Engines specialise code for the CPU they compile on (ONNX Runtime's full graph
optimisations pick AVX2 or AVX-512 blocked layouts, for example), so an
artifact records which of these features it was built with and refuses, with
a message naming them, to run where they are missing.
"""
from __future__ import annotations

import functools
import platform

# Features that change which kernels an engine picks. Order is for display.
X86_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                "amx_tile", "amx_bf16", "amx_int8")
ARM_FEATURES = ("asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm")


def arch() -> str:
    return platform.machine().lower()


@functools.lru_cache(maxsize=1)
def host_features() -> frozenset:
    flags: set = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        pass
    known = X86_FEATURES + ARM_FEATURES
    return frozenset(f for f in flags if f in known)


# Features with which the CPU computes in a narrow float type rather than converting to fp32.
NATIVE_FEATURES = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"), "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}


def native(cast_type: str) -> bool:
    """Whether this CPU computes ``cast_type`` (``"bf16"``/``"fp16"``) natively: then auto-cast
    asks the engine to run in it; elsewhere kiln emulates the rounding in fp32. Here, not in
    the graph layer, because engines ask it too and engines sit below the graph layer."""
    return any(f in host_features() for f in NATIVE_FEATURES.get(cast_type, ()))


def describe(target: str = "native", device: str = "cpu") -> dict:
    """Manifest entry: the features compiled code may use.

    ``generic`` artifacts avoid ISA-specific layouts, so they only need the
    baseline of the architecture. CUDA artifacts also record the GPU they
    were built on: their kernels are machine code for its compute capability.
    """
    feats = host_features()
    if target == "generic":
        baseline = {"x86_64": {"sse4_2"}, "amd64": {"sse4_2"}}.get(arch(), set())
        feats = frozenset(feats & baseline)
    order = X86_FEATURES + ARM_FEATURES
    out = {"target": target, "arch": arch(), "isa": [f for f in order if f in feats]}
    if device == "cuda":
        out["device"] = "cuda"
        out["cuda"] = cuda_device()
    return out


def cuda_device() -> dict:
    import torch
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "capability": f"{major}.{minor}",
            "cuda": torch.version.cuda}


def missing_device(manifest_target: dict) -> str | None:
    """Why this host cannot run a CUDA artifact's kernels, or None (also for CPU artifacts)."""
    if manifest_target.get("device", "cpu") != "cuda":
        return None
    import torch
    built = manifest_target.get("cuda", {})
    what = f"{built.get('name', 'an NVIDIA GPU')} (compute capability {built.get('capability', '?')})"
    if not torch.cuda.is_available():
        return (f"it was compiled for CUDA on {what} and torch {torch.__version__} here sees no CUDA "
                "device. Load it on a host with that GPU, or recompile with device='cpu'")
    have = cuda_device()
    if not _binary_compatible(built.get("capability", ""), have["capability"]):
        return (f"it was compiled for {what} and this GPU, {have['name']}, has compute capability "
                f"{have['capability']}: its kernels cannot run here. Recompile on this GPU")
    return None


def _binary_compatible(built: str, have: str) -> bool:
    """GPU machine code runs on the same major architecture at an equal or later minor."""
    try:
        (b_major, b_minor), (h_major, h_minor) = (tuple(int(p) for p in c.split(".")) for c in (built, have))
    except ValueError:
        return False
    return b_major == h_major and h_minor >= b_minor


def missing_features(manifest_target: dict) -> tuple[str | None, list]:
    """What this host lacks to run code built for ``manifest_target``: (arch mismatch, features)."""
    wrong_arch = None
    if manifest_target.get("arch") and manifest_target["arch"] != arch():
        wrong_arch = manifest_target["arch"]
    have = host_features()
    return wrong_arch, [f for f in manifest_target.get("isa", []) if f not in have]
