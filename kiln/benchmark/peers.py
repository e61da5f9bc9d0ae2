"""The alternatives ``kiln bench --compare`` runs next to kiln, each set up the way its users would.

Each peer turns ``(model, args, kwargs, threads)`` into a zero-argument
callable running one inference. Peers whose library is missing are reported
by ``unavailable`` with the reason, so a comparison skips them with a note.
Setup (tracing, compiling) happens in ``build`` and is timed apart from the
measured calls.

- ``eager``: the model under ``torch.inference_mode``.
- ``torchscript``: ``torch.jit.trace`` then ``torch.jit.freeze``.
- ``torch.compile``: the default Inductor backend, first call (the compile) in setup.
- ``onnxruntime``: the dynamo ONNX export, a session with all graph optimizations.
- ``openvino``: ``openvino.convert_model`` of the ExportedProgram, compiled for CPU in f32.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io

import numpy as np
import torch

NAMES = ("eager", "torchscript", "torch.compile", "onnxruntime", "openvino")
_MODULE = {"onnxruntime": "onnxruntime", "openvino": "openvino"}


def unavailable(name: str) -> str | None:
    """Why peer ``name`` cannot run here, or None."""
    if name not in NAMES:
        return f"unknown peer {name!r}; peers are {', '.join(NAMES)}"
    mod = _MODULE.get(name)
    if mod and importlib.util.find_spec(mod) is None:
        return f"{mod} is not installed (pip install {mod})"
    return None


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _by_names(names, args, kwargs) -> list:
    """Inputs in an exported graph's order: keyword inputs by name, the rest positionally."""
    rest = iter(args)
    return [np.ascontiguousarray((kwargs[n] if n in kwargs else next(rest)).numpy()) for n in names]


def build(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, threads: int):
    """A callable running one inference of ``model`` through peer ``name``."""
    torch.set_num_threads(threads)
    model = model.eval()
    if name == "eager":
        def run():
            with torch.inference_mode():
                return model(*args, **kwargs)
        return run
    if name == "torchscript":
        with torch.no_grad(), _quiet():
            if kwargs:
                traced = torch.jit.trace(model, example_kwarg_inputs=dict(kwargs), strict=False)
            else:
                traced = torch.jit.trace(model, tuple(args), strict=False)
            frozen = torch.jit.freeze(traced.eval())

        def run():
            with torch.inference_mode():
                return frozen(*args, **kwargs)
        return run
    if name == "torch.compile":
        compiled = torch.compile(model)

        def run():
            with torch.no_grad():   # inference tensors entering a dynamo graph can force recompiles
                return compiled(*args, **kwargs)
        with _quiet():
            run()
        return run
    if name == "onnxruntime":
        import onnxruntime as ort
        with torch.no_grad(), _quiet():
            program = torch.onnx.export(model, tuple(args), kwargs=dict(kwargs) or None, dynamo=True,
                                        optimize=True, verbose=False, report=False)
            proto = program.model_proto.SerializeToString()
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
        session = ort.InferenceSession(proto, so, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feed = dict(zip(names, _by_names(names, args, kwargs)))

        def run():
            return session.run(None, feed)
        return run
    if name == "openvino":
        import openvino as ov
        with torch.no_grad(), _quiet():
            ov_model = ov.convert_model(torch.export.export(model, tuple(args), dict(kwargs)))
        config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                  "INFERENCE_NUM_THREADS": str(threads)}
        compiled = ov.Core().compile_model(ov_model, "CPU", config)
        request = compiled.create_infer_request()
        names = [next(iter(i.get_names()), f"input{n}") for n, i in enumerate(compiled.inputs)]
        feed = _by_names(names, args, kwargs)

        def run():
            return request.infer(feed, share_inputs=True)
        return run
    raise ValueError(unavailable(name) or name)
