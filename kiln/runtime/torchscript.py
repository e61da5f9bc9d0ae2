"""TorchScript compatibility: ``torch.jit.save`` / ``torch.jit.load`` of compiled models.

Neuron users save traced models with ``torch.jit.save`` and load them with
``torch.jit.load`` after importing the Neuron package. kiln does the same: the
saved TorchScript module holds the artifact bytes as a uint8 buffer and calls
the ``kiln::run`` operator, which ``import kiln`` registers. The artifact is
loaded once per process and cached by its checksum.

Trust: ``torch.jit.load`` runs the archive's TorchScript (torch's format, with
its own rules); the kiln artifact inside is loaded by ``kiln.load`` on the first
call, under the same policy as a ``.kiln`` file: its signature must verify, and
native-code partitions need a signer this host trusts (``KILN_TRUSTED_KEYS``) or
``KILN_TRUST_NATIVE_CODE=1``, since ``torch.jit.load`` has no way to pass
``trust_native_code``.
"""
from __future__ import annotations

import torch

from kiln.artifact import specs

class _Wrapper(torch.nn.Module):
    def __init__(self, compiled):
        super().__init__()
        data = compiled.to_bytes()
        self.register_buffer("artifact", torch.frombuffer(bytearray(data), dtype=torch.uint8))
        from kiln.artifact.container import sha256
        self.key = sha256(data)
        self.structure = compiled.output_structure

    def forward(self, *inputs):
        outs = torch.ops.kiln.run(self.artifact, self.key, list(inputs))
        return _scriptable(specs.decode(self.structure, outs))


def _scriptable(value):
    """TorchScript has no ModelOutput and only homogeneous dicts: keep plain tensor-valued
    dicts as dicts, turn ModelOutputs and other mappings into tuples, as HF's own
    ``torchscript=True`` mode does."""
    if isinstance(value, dict):
        if type(value) is dict and all(isinstance(v, torch.Tensor) for v in value.values()):
            return dict(value)
        return tuple(_scriptable(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return type(value)(_scriptable(v) for v in value)
    return value


def to_torchscript(compiled) -> torch.jit.ScriptModule:
    """A TorchScript module taking the flat input tensors positionally."""
    import warnings
    example = [torch.zeros(s.shape, dtype=s.dtype) for s in compiled.input_specs]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(_Wrapper(compiled), tuple(example), check_trace=False, strict=False)

