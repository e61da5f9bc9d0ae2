"""kiln: trace a PyTorch model once, compile it ahead of time, load it anywhere, serve it fast.

The package reads as its layers (docs/architecture.md; each imports only those below)::

    cli/        the `kiln` command, one module per command group
    serving/    kiln serve (Open Inference Protocol) · compat/: torch_neuronx / torch_neuron
                spellings (also importable as kiln.neuronx, kiln.neuron) · benchmark/: kiln bench
    compiler/   kiln.trace / kiln.analyze: api → driver → phases (capture → plan → build →
                package), engine selection, buckets and pipeline stages, padding proofs,
                the compile cache (a hook of the driver), parallel-compile
    runtime/    a loaded artifact as a torch.nn.Module: program, buckets, dynamic batch,
                pipeline stages, DataParallel replicas, TorchScript bridge
    graph/      capture (torch.export → core ATen), partition, precision, analysis, validation
    observe/    metrics, profiler timelines, the process registry, kiln monitor / top
    artifact/   the .kiln file: container, manifest schema, I/O specs, signing and trust
    engines/    ONNX Runtime, OpenVINO, TorchInductor, eager behind one Engine contract
    host/       this machine: CPU features and kiln cores
    config.py   every environment variable kiln reads; errors.py: every exception
"""
import importlib

from kiln._version import __version__  # noqa: F401
from kiln.runtime import script_op as _script_op  # noqa: F401  (declares kiln::run: torch.jit.load needs it)
from kiln.errors import (ArtifactError, CaptureError, CompileError, CompilerArgsError,  # noqa: F401
                         EngineUnavailableError, IndexRangeError, InputError, KilnError, PlacementError,
                         SignatureError,
                         TargetMismatchError, UnsupportedOpError, UntrustedArtifactError, ValidationError)

# The API's names, imported on first use (PEP 562). Why: PyTorch imports kiln's device during
# every ``import torch`` in an environment where kiln is installed (device-backend autoload),
# and that reaches this module; importing the compiler, the runtime and their engines here
# made every Python process that imports torch, kiln or not, slower to start (the package's
# import under `import torch` was ~198 ms by -X importtime, ~10 ms now).
_LAZY = {"trace": "kiln.compiler.api", "analyze": "kiln.compiler.api", "load": "kiln.runtime",
         "CompiledModel": "kiln.runtime", "Model": "kiln.runtime", "cores": "kiln.host.cores",
         "Bucketed": "kiln.runtime.buckets", "DynamicBatch": "kiln.runtime.buckets",
         "dynamic_batch": "kiln.runtime.buckets", "DataParallel": "kiln.runtime.replicas",
         "metrics": "kiln.observe.metrics", "metrics_report": "kiln.observe.metrics",
         "profile": "kiln.observe.profiler", "bench": "kiln.benchmark", "Output": "kiln.artifact.specs"}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value           # once: later lookups are ordinary attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["trace", "analyze", "load", "CompiledModel", "Model", "Output", "cores", "metrics",
           "metrics_report", "profile", "bench",
           "dynamic_batch", "Bucketed", "DynamicBatch", "DataParallel", "PlacementError", "KilnError", "ArtifactError",
           "CaptureError", "CompileError", "CompilerArgsError", "EngineUnavailableError",
           "InputError", "IndexRangeError", "TargetMismatchError", "UnsupportedOpError", "ValidationError",
           "SignatureError", "UntrustedArtifactError"]

from kiln import config as _config  # noqa: E402

_config.warn_unknown()      # a misspelt KILN_* setting would otherwise be ignored without a word
