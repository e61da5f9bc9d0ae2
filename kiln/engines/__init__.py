"""Engines that turn a device partition into executable code.

The contract is deliberately small so an engine is one file:

* ``supports(node) -> str | None``: ``None`` if the engine can run this fx node,
  otherwise the reason it cannot (shown in analysis reports).
* ``compile(partition, example_inputs, options) -> bytes``: a self-contained,
  fully optimised blob for one partition (a GraphModule of core ATen ops).
* ``load(blob, runtime_options, origin=None) -> callable``: a function from a
  list of input tensors to a list of output tensors. It must be safe to call
  from several threads at once. ``blob`` may be a read-only view into a mapped
  artifact; ``origin`` (an ``artifact.Origin``), when given, says where those
  bytes lie in a file, for engines that can map weights instead of copying.
* ``native_code``: True when loading a blob runs machine code from it (a shared
  library, as TorchInductor's); such partitions load only from artifacts this
  host trusts (``kiln.artifact.trust``). Engines whose blobs are data they parse (ONNX,
  OpenVINO IR) leave it False.

``available()`` and ``version()`` let kiln skip missing engines with a clear
message and record versions in the artifact (which engines run on a GPU is
``select.CUDA_ORDER``). ``variants(options)`` names other builds of the same
partition that -O3 also times (passed back to ``compile`` as ``variant=``),
for settings that win on some models and lose on others.
"""
from __future__ import annotations

import importlib

from kiln.errors import EngineUnavailableError

_ENGINES = {
    "onnxruntime": "kiln.engines.onnxruntime:OnnxRuntimeBackend",
    "openvino": "kiln.engines.openvino:OpenVinoBackend",
    "inductor": "kiln.engines.inductor:InductorBackend",
}
_instances: dict = {}


class Backend:
    name: str = ""
    blob_suffix: str = ".bin"
    modules: tuple = ()        # Python packages the engine needs; the first names its version
    native_code: bool = False  # loading a blob runs machine code from it (see the module doc)

    def available(self) -> bool:
        try:
            for module in self.modules:
                importlib.import_module(module)
        except ImportError:
            return False
        return True

    def version(self) -> str:
        return importlib.import_module(self.modules[0]).__version__

    @staticmethod
    def not_an_op(node) -> str | None:
        """Reason a non-operator node cannot be compiled (tuple unpacking is fine)."""
        if getattr(node.target, "__name__", "") == "getitem":
            return None
        return f"{node.target} is not an ATen operator"

    def supports(self, node) -> str | None:
        raise NotImplementedError

    def variants(self, options) -> tuple:
        return ()

    def compile(self, partition, example_inputs, options) -> bytes:
        raise NotImplementedError

    def load(self, blob, runtime_options, origin=None):
        raise NotImplementedError


def names() -> list:
    return list(_ENGINES)


def native_code(name: str) -> bool:
    """Whether engine ``name``'s blobs are native code, without checking it is installed;
    an engine this kiln does not know counts as native."""
    if name not in _ENGINES:
        return True
    module, _, cls = _ENGINES[name].partition(":")
    try:
        return bool(getattr(importlib.import_module(module), cls).native_code)
    except ImportError:
        return True


def get(name: str, required: bool = True) -> Backend | None:
    """The engine ``name``; if it is missing, raise (or return None when not ``required``)."""
    if not required:
        try:
            return get(name)
        except EngineUnavailableError:
            return None
    return _get(name)


def _get(name: str) -> Backend:
    if name not in _ENGINES:
        raise EngineUnavailableError(f"unknown engine {name!r}; kiln has: {', '.join(_ENGINES)}")
    if name not in _instances:
        module, _, cls = _ENGINES[name].partition(":")
        try:
            _instances[name] = getattr(importlib.import_module(module), cls)()
        except ImportError as e:
            raise EngineUnavailableError(f"engine {name!r} cannot be imported: {e}") from None
    backend = _instances[name]
    if not backend.available():
        raise EngineUnavailableError(
            f"engine {name!r} is not installed in this environment; install it "
            f"(pip install {name}) or choose another engine")
    return backend
