"""Every environment variable kiln reads, with its default and meaning, in one place.

Modules ask :func:`get` (or :func:`flag`) by name instead of reading ``os.environ``;
a name that is not declared here is a programming error, so a new variable cannot be
added without its documentation (``docs/configuration.md`` is generated from
:data:`VARIABLES` by :func:`table`, and a test checks that no other module reads
``KILN_*`` or ``NEURON_*`` directly). Values are read at call time, not at import:
tests and long-lived processes may change them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    default: str | None
    meaning: str
    group: str


_V = Variable
VARIABLES = {v.name: v for v in (
    # compiling
    _V("KILN_CACHE_URL", None, "compile cache location: a directory or fsspec URL (s3://...); "
       "'off' disables it. Default ~/.cache/kiln", "compile"),
    _V("KILN_CACHE_MAX_BYTES", None, "evict least-recently-used cache entries beyond this size "
       "(e.g. 20G)", "compile"),
    _V("KILN_COLLECT_DIR", None, "set by kiln parallel-compile: trace() records jobs here "
       "instead of compiling", "compile"),
    _V("KILN_QUIET", "", "1: no live progress line on a terminal", "compile"),
    _V("KILN_BUILD_LOG", None, "append one JSON line per compiled partition to this file, from every "
       "process: each engine tried (build seconds, refused by the check against eager or failed, and "
       "why), the one kept and why, the operators left on the host (kiln.observe.build_log)", "compile"),
    _V("NEURON_CC_FLAGS", "", "Neuron compiler flags, read by kiln.neuronx / kiln.neuron traces, "
       "torch_xla's device and NeuronTrainer (kiln.compiler.neuron_env)", "compile"),
    _V("NEURON_COMPILE_CACHE_URL", None, "Neuron's cache location; used when KILN_CACHE_URL is "
       "unset, by the compat layer", "compile"),
    # running
    _V("KILN_NUM_THREADS", None, "engine threads per model (default: the CPUs of its kiln core)",
       "run"),
    _V("KILN_VISIBLE_CORES", None, "kiln cores this process may use, e.g. '0-1' or '0,2'", "run"),
    _V("KILN_NUM_CORES", None, "number of kiln cores this process may use", "run"),
    _V("KILN_CPUS_PER_CORE", None, "group CPUs N at a time into kiln cores (default: one kiln core "
       "per physical core)", "run"),
    _V("KILN_MALLOC_KEEP", "1G", "freed memory glibc's malloc keeps for the next call once a compiled "
       "model is loaded (kiln.host.memory: no page faults on every step); 0 leaves glibc as it is", "run"),
    _V("KILN_CUDA_GRAPHS", "on", "off: a model compiled for an NVIDIA GPU launches its kernels one by one "
       "instead of replaying them as a captured CUDA graph (kiln.runtime.cuda_graphs)", "run"),
    _V("KILN_DRAW_AHEAD", "on", "off: dropout masks are drawn where the operation is recorded, not ahead "
       "on a second thread from a copy of the generator's state (kiln.graph.draw_ahead; the same masks "
       "either way)", "run"),
    _V("NEURON_RT_VISIBLE_CORES", None, "Neuron spelling of KILN_VISIBLE_CORES", "run"),
    _V("NEURON_RT_NUM_CORES", None, "Neuron spelling of KILN_NUM_CORES", "run"),
    _V("XLA_USE_BF16", None, "torch_xla: float32 tensors kept as bf16 on the device; not honoured (kiln's "
       "device keeps float32 float32): a warning at xm.xla_device() says what to use instead", "run"),
    _V("XLA_DOWNCAST_BF16", None, "torch_xla: as XLA_USE_BF16 (float64 to float32 too); not honoured, "
       "with the same warning", "run"),
    # distributed (torchrun sets the first four)
    _V("RANK", None, "torchrun: this process's rank among all ranks", "run"),
    _V("WORLD_SIZE", None, "torchrun: how many ranks there are", "run"),
    _V("LOCAL_RANK", None, "torchrun: this process's rank among the ranks on its host", "run"),
    _V("LOCAL_WORLD_SIZE", None, "torchrun: how many ranks run on this host (they split its "
       "kiln cores)", "run"),
    _V("KILN_DIST_SHM", "auto", "same-host all-reduce through shared memory: 'auto' (when a probe "
       "at the group's first all-reduce measures it faster than gloo), 'on', or 'off'", "run"),
    _V("KILN_DEVICE_NAME", "kiln", "the name import torch registers kiln's device under (PyTorch's "
       "device-backend autoload): 'kiln', 'neuron' for TorchNeuron scripts (torch.device('neuron'), "
       "torch.neuron), or 'off' to leave PrivateUse1 alone. A CUDA build of torch registers the device "
       "only when this is set (a registered device breaks CUDA backward passes)", "run"),
    _V("TORCH_DEVICE_BACKEND_AUTOLOAD", "1", "PyTorch's own switch, read by torch: 0 stops import "
       "torch from calling device backends' entry points, kiln's device included (kiln reads it "
       "only to explain a late registration)", "run"),
    _V("KILN_ORT_PREPACKED", "map", "ONNX Runtime weights: 'map' the artifact's pre-packed "
       "weights from the file, or 'copy'", "run"),
    _V("NXD_CPU_MODE", "", "NeuronX Distributed's CPU switch, read by kiln.neuronx_distributed.utils.cpu_mode() "
       "(1: NxD scripts take their CPU path: get_device() is the CPU, mark_step does nothing)", "run"),
    # trust
    _V("KILN_CONFIG_DIR", None, "where the signing key lives (default ~/.config/kiln)", "trust"),
    _V("KILN_TRUSTED_KEYS", "", "public keys (files, or base64 text) whose signatures this host "
       "trusts, separated by the path separator", "trust"),
    _V("KILN_TRUST_NATIVE_CODE", "", "1: load native-code partitions from any artifact "
       "(never from the shared cache)", "trust"),
    # observing
    _V("KILN_PROFILE", None, "write a Chrome-trace timeline of the whole process to this file "
       "at exit", "observe"),
    _V("KILN_REGISTRY", "on", "off: do not announce this process to kiln ls / monitor / top",
       "observe"),
    _V("KILN_RUN_DIR", None, "directory of the process registry's heartbeat files "
       "(default $XDG_RUNTIME_DIR/kiln or a temp dir)", "observe"),
    _V("KILN_HEARTBEAT_S", "1", "seconds between registry heartbeats", "observe"),
    _V("KILN_PROCESS_TAG", None, "a label shown for this process in kiln ls / monitor / top",
       "observe"),
)}
del _V

_TRUE = ("1", "true", "yes", "on")


def get(name: str) -> str | None:
    """The variable's value, or its default when unset."""
    try:
        default = VARIABLES[name].default
    except KeyError:
        raise KeyError(f"{name} is not a kiln setting; declare it in kiln/config.py") from None
    value = os.environ.get(name)
    return default if value is None else value


def is_set(name: str) -> bool:
    """Whether the variable is present in the environment (even if empty)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a kiln setting; declare it in kiln/config.py")
    return name in os.environ


def flag(name: str) -> bool:
    """A yes/no variable: 1, true, yes or on."""
    return (get(name) or "").strip().lower() in _TRUE


def parse_size(text, *, binary: bool = False) -> int:
    """A size in bytes: a number, or one with K, M, G or T (powers of 1000, or of 1024 with
    ``binary``); a trailing B or iB is allowed. ValueError when it is neither."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    base = 1024 if binary else 1000
    power = "KMGT".find(t[-1:]) + 1 if t else 0
    return int(float(t[:-1]) * base ** power) if power else int(t)


# KILN_* names that are not kiln's settings: the test suite's own (tests/reliability.py)
_NOT_SETTINGS = ("KILN_RELIABILITY",)


def unknown() -> list:
    """``(name, nearest)`` for each ``KILN_*`` variable in the environment that kiln does not
    read, with the declared name nearest to it (or None): a misspelt setting is otherwise
    silently ignored (``KILN_CACHE_DIR`` for ``KILN_CACHE_URL`` compiled into the default
    cache, unnoticed, in one of kiln's own benchmark runs)."""
    import difflib
    ours = {name.removeprefix("KILN_"): name for name in VARIABLES if name.startswith("KILN_")}

    def nearest(name):      # compared without the prefix every one shares
        close = difflib.get_close_matches(name.removeprefix("KILN_"), ours, n=1, cutoff=0.6)
        return ours[close[0]] if close else None
    return [(name, nearest(name)) for name in sorted(os.environ)
            if name.startswith("KILN_") and name not in VARIABLES and not name.startswith(_NOT_SETTINGS)]


def warn_unknown():
    """A ``RuntimeWarning`` for each variable :func:`unknown` finds (at ``import kiln``)."""
    import warnings
    for name, nearest in unknown():
        hint = f"; did you mean {nearest}?" if nearest else ""
        warnings.warn(f"{name} is set, but kiln reads no such variable{hint} (docs/configuration.md lists "
                      "every one)", RuntimeWarning, stacklevel=3)


def names(group: str | None = None) -> list:
    return [v.name for v in VARIABLES.values() if group is None or v.group == group]


def table() -> str:
    """The variables as a markdown table (docs/configuration.md)."""
    rows = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for group in ("compile", "run", "trust", "observe"):
        for v in VARIABLES.values():
            if v.group == group:
                rows.append(f"| `{v.name}` | {'`' + v.default + '`' if v.default else '—'} | {v.meaning} |")
    return "\n".join(rows)
