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
from kiln._version import __version__  # noqa: E402,F401

from kiln.errors import (ArtifactError, CaptureError, CompileError, CompilerArgsError,  # noqa: E402
                     EngineUnavailableError, InputError, KilnError, PlacementError, SignatureError,
                     TargetMismatchError, UnsupportedOpError, UntrustedArtifactError,
                     ValidationError)
from kiln.compiler.api import analyze, trace  # noqa: E402
from kiln.runtime import CompiledModel, Model, load  # noqa: E402
from kiln.host.cores import cores  # noqa: E402
from kiln.runtime.buckets import Bucketed, DynamicBatch, dynamic_batch  # noqa: E402
from kiln.runtime.replicas import DataParallel  # noqa: E402
from kiln.observe.metrics import metrics, metrics_report  # noqa: E402
from kiln.observe.profiler import profile  # noqa: E402
from kiln.benchmark import bench  # noqa: E402
from kiln.artifact.specs import Output  # noqa: E402

__all__ = ["trace", "analyze", "load", "CompiledModel", "Model", "Output", "cores", "metrics",
           "metrics_report", "profile", "bench",
           "dynamic_batch", "Bucketed", "DynamicBatch", "DataParallel", "PlacementError", "KilnError", "ArtifactError",
           "CaptureError", "CompileError", "CompilerArgsError", "EngineUnavailableError",
           "InputError", "TargetMismatchError", "UnsupportedOpError", "ValidationError",
           "SignatureError", "UntrustedArtifactError"]

from kiln import config as _config  # noqa: E402

_config.warn_unknown()      # a misspelt KILN_* setting would otherwise be ignored without a word
