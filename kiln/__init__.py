"""kiln: trace a PyTorch model once, compile it ahead of time, load it anywhere, serve it fast.

The package reads as the pipeline::

    capture.py    torch.export → core-ATen graph, pytree I/O
    analyze.py    op support report
    partition.py  device partitions + host (CPU) fallback
    backends/     engines (ONNX Runtime first) behind one small contract
    artifact.py   the .kiln file: manifest + checksummed blobs, atomic writes
    trust.py      signing keys; native code loads only from trusted signers
    program.py    the host program wiring partitions and fallback ops
    runtime.py    CompiledModel: checks inputs, runs the program
    compiler.py   the driver tying them together: kiln.trace / kiln.analyze

and around it, shapes and cores::

    shapes.py     bucketing and dynamic batch over static-shape graphs
    placement.py  kiln cores: CPUs grouped into units a model is pinned to
    parallel.py   DataParallel: one worker process per core, shared-memory tensors
    pipeline.py   one graph split into stages over cores, requests streamed
    cache.py      the persistent compile cache; collect.py: parallel-compile
    telemetry.py  per-model counters (kiln.metrics); profiler.py: Chrome-trace timelines
    registry.py   running kiln processes (heartbeat files); monitor.py, top.py: kiln monitor / top
    benchmark.py  kiln bench: throughput/latency sweeps vs peers (peers.py)
    serve.py      kiln serve: Open Inference Protocol server (Starlette/uvicorn); batcher.py: dynamic batching
"""
__version__ = "0.1.0"

from kiln.errors import (ArtifactError, CaptureError, CompileError, CompilerArgsError,  # noqa: E402
                     EngineUnavailableError, InputError, KilnError, SignatureError,
                     TargetMismatchError, UnsupportedOpError, UntrustedArtifactError,
                     ValidationError)
from kiln.compiler.driver import analyze, trace  # noqa: E402
from kiln.runtime.model import CompiledModel, Model, load  # noqa: E402
from kiln.host.cores import cores, PlacementError  # noqa: E402
from kiln.runtime.buckets import Bucketed, DynamicBatch, dynamic_batch  # noqa: E402
from kiln.runtime.replicas import DataParallel  # noqa: E402
from kiln.observe.metrics import metrics, metrics_report  # noqa: E402
from kiln.observe.profiler import profile  # noqa: E402
from kiln.benchmark import bench  # noqa: E402
from kiln.artifact.specs import Output  # noqa: E402
from kiln.runtime import torchscript as _torchscript  # noqa: E402,F401  (registers the kiln::run op)

__all__ = ["trace", "analyze", "load", "CompiledModel", "Model", "Output", "cores", "metrics",
           "metrics_report", "profile", "bench",
           "dynamic_batch", "Bucketed", "DynamicBatch", "DataParallel", "PlacementError", "KilnError", "ArtifactError",
           "CaptureError", "CompileError", "CompilerArgsError", "EngineUnavailableError",
           "InputError", "TargetMismatchError", "UnsupportedOpError", "ValidationError",
           "SignatureError", "UntrustedArtifactError"]
