"""Runtime: a loaded artifact as a callable ``torch.nn.Module``.

Calls are checked against the compiled input specs, flattened, run through the
host program (device partitions on their engine, fallback ops in PyTorch) and
rebuilt into the traced output structure. Tensors cross into engines as shared
NumPy views, not copies. Several threads may call one model at once.
"""
from __future__ import annotations

import threading

import torch

from . import backends, specs
from .artifact import Artifact
from .errors import ArtifactError, InputError, KilnError
from .options import RuntimeOptions
from .program import Program

HOST_CONSTANTS = "host_constants.safetensors"


class CompiledModel(torch.nn.Module):
    """A compiled kiln model. Call it like the original model."""

    def __init__(self, artifact: Artifact, runtime_options: RuntimeOptions | None = None,
                 source: str = "artifact"):
        super().__init__()
        artifact.check_host(source)
        self._artifact = artifact
        self.runtime_options = runtime_options or RuntimeOptions()
        m = artifact.manifest
        self.manifest = m
        self.arg_names = m["inputs"]["args"]
        self.input_structure = m["inputs"]["structure"]
        self.input_specs = [specs.TensorSpec.from_dict(d) for d in m["inputs"]["tensors"]]
        self.output_structure = m["outputs"]["structure"]
        self.output_specs = [specs.TensorSpec.from_dict(d) for d in m["outputs"]["tensors"]]
        self._checks = [(s.name, tuple(s.shape), s.dtype) for s in self.input_specs]
        runners = []
        for part in m["partitions"]:
            backend = backends.get(part["engine"])
            try:
                runners.append(backend.load(artifact.blobs[part["blob"]], self.runtime_options))
            except KilnError:
                raise
            except Exception as e:
                raise ArtifactError(f"{source}: engine {part['engine']} could not load partition "
                                    f"{part['id']}: {e}") from e
        constants = {}
        if HOST_CONSTANTS in artifact.blobs:
            from safetensors.torch import load as st_load
            constants = st_load(artifact.blobs[HOST_CONSTANTS])
        self.program = Program(m["program"], constants, runners)
        self._host_ops = bool(self.program.host_ops() or not runners)
        self._stats = [0]
        self._lock = threading.Lock()

    # -- calling ----------------------------------------------------------------
    def flatten(self, args, kwargs) -> list:
        names = self.arg_names
        if len(args) > len(names):
            raise InputError(f"{self.name} takes {len(names)} input(s) ({', '.join(names)}), "
                             f"got {len(args)} positional")
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in bound:
                raise InputError(f"input '{k}' given twice")
            if k not in names:
                raise InputError(f"unexpected input '{k}'; the model was compiled with inputs "
                                 f"{', '.join(names)}")
            bound[k] = v
        flat: list = []
        for name, structure in self.input_structure["dict"]:
            if name not in bound:
                if "none" in structure:
                    continue
                raise InputError(f"missing input '{name}'")
            specs.flatten_inputs(structure, bound[name], name, flat)
        return flat

    def check(self, flat):
        if len(flat) != len(self._checks):
            raise InputError(f"expected {len(self._checks)} input tensors, got {len(flat)}")
        for t, (name, shape, dtype) in zip(flat, self._checks):
            if t.shape != shape or t.dtype != dtype:
                raise InputError(
                    f"input '{name}': expected {shape} {specs.dtype_name(dtype)}, got "
                    f"{tuple(t.shape)} {specs.dtype_name(t.dtype)}")
            if t.device.type != "cpu":
                raise InputError(f"input '{name}': expected a CPU tensor, got one on {t.device}")

    def run_flat(self, flat: list) -> list:
        """Run on flat, already checked input tensors; returns flat outputs."""
        if self._host_ops:
            with torch.no_grad():
                outs = self.program(flat)
        else:  # engines never record autograd; skip the grad-mode switch
            outs = self.program([t.detach() if t.requires_grad else t for t in flat])
        with self._lock:  # a plain list: nn.Module.__setattr__ costs microseconds per call
            self._stats[0] += 1
        return outs

    @property
    def calls(self) -> int:
        """Completed calls so far."""
        return self._stats[0]

    def forward(self, *args, **kwargs):
        flat = self.flatten(args, kwargs)
        self.check(flat)
        return specs.decode(self.output_structure, self.run_flat(flat))

    # -- persistence -------------------------------------------------------------
    def save(self, f, _extra_files=None):
        """Write the ``.kiln`` artifact (atomically).

        ``torch.jit.save(compiled, path)`` calls this with ``_extra_files``;
        then a TorchScript archive is written instead, whose module runs the
        embedded artifact through the ``kiln::run`` op.
        """
        if _extra_files is not None:
            from .torchscript import to_torchscript
            return to_torchscript(self).save(f, _extra_files=_extra_files)
        if hasattr(f, "write"):
            f.write(self._artifact.to_bytes())
            return None
        return self._artifact.save(f)

    def save_to_buffer(self, _extra_files=None) -> bytes:
        """TorchScript bytes (``torch.jit.save`` to a file object calls this)."""
        from .torchscript import to_torchscript
        return to_torchscript(self).save_to_buffer(_extra_files=_extra_files or {})

    def to_bytes(self) -> bytes:
        return self._artifact.to_bytes()

    # -- description ----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.get("model_name", "model")

    @property
    def report(self):
        return self.manifest.get("report")

    def __repr__(self):
        parts = self.manifest["partitions"]
        host = len(self.program.host_ops())
        ins = ", ".join(f"{s.name}: {s.describe()}" for s in self.input_specs)
        return (f"kiln.CompiledModel({self.name}; inputs {ins}; {len(parts)} device partition(s) "
                f"on {', '.join(sorted({p['engine'] for p in parts})) or 'none'}, {host} host op(s))")


def load(path_or_bytes, threads: int | None = None) -> CompiledModel:
    """Load a ``.kiln`` artifact (path or bytes). No model source is needed."""
    opts = RuntimeOptions(threads=threads)
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        return CompiledModel(Artifact.from_bytes(bytes(path_or_bytes)), opts)
    art = Artifact.load(path_or_bytes)
    return CompiledModel(art, opts, source=str(path_or_bytes))
