"""kiln: trace a PyTorch model once, compile it ahead of time, load it anywhere, serve it fast.

The package reads as the pipeline::

    capture.py    torch.export → core-ATen graph, pytree I/O
    analyze.py    op support report
    partition.py  device partitions + host (CPU) fallback
    backends/     engines (ONNX Runtime first) behind one small contract
    artifact.py   the .kiln file: manifest + checksummed blobs, atomic writes
    program.py    the host program wiring partitions and fallback ops
    runtime.py    CompiledModel: checks inputs, runs the program
    compiler.py   the driver tying them together: kiln.trace / kiln.analyze
"""
__version__ = "0.1.0"

from .errors import (ArtifactError, CaptureError, CompileError, CompilerArgsError,  # noqa: E402
                     EngineUnavailableError, InputError, KilnError, TargetMismatchError,
                     UnsupportedOpError, ValidationError)
from .compiler import analyze, trace  # noqa: E402
from .runtime import CompiledModel, load  # noqa: E402
from .specs import Output  # noqa: E402
from . import torchscript as _torchscript  # noqa: E402,F401  (registers the kiln::run op)

__all__ = ["trace", "analyze", "load", "CompiledModel", "Output", "KilnError", "ArtifactError",
           "CaptureError", "CompileError", "CompilerArgsError", "EngineUnavailableError",
           "InputError", "TargetMismatchError", "UnsupportedOpError", "ValidationError"]
