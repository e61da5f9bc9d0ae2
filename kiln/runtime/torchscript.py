"""TorchScript compatibility: ``torch.jit.save`` / ``torch.jit.load`` of compiled models.

Neuron users save traced models with ``torch.jit.save`` and load them with
``torch.jit.load`` after importing the Neuron package. kiln does the same: the
saved TorchScript module holds the artifact bytes as a uint8 buffer and calls
the ``kiln::run`` operator, which ``import kiln`` registers. Each loaded module
loads its artifact on its first call (:mod:`kiln.runtime.script_op`).

The module's ``forward`` takes the model's inputs by their names when every input
is a bare tensor (``loaded(input_ids=..., attention_mask=...)``, or positionally in
the traced order), as a model traced with keyword inputs is called; models with
nested inputs take the flat input tensors positionally.

Trust: ``torch.jit.load`` runs the archive's TorchScript (torch's format, with
its own rules); the kiln artifact inside is loaded by ``kiln.load`` on the first
call, under the same policy as a ``.kiln`` file: its signature must verify, and
native-code partitions need a signer this host trusts (``KILN_TRUSTED_KEYS``) or
``KILN_TRUST_NATIVE_CODE=1``, since ``torch.jit.load`` has no way to pass
``trust_native_code``.
"""
from __future__ import annotations

import inspect
import keyword
import os
import threading

import torch

from kiln.artifact import specs

_describing = threading.local()     # the trace in progress on this thread: (artifact key, output specs)


class _Wrapper(torch.nn.Module):
    def __init__(self, compiled):
        super().__init__()
        data = compiled.to_bytes()
        self.register_buffer("artifact", torch.frombuffer(bytearray(data), dtype=torch.uint8))
        from kiln.artifact.container import sha256
        self.key = sha256(data)
        self.structure = compiled.output_structure

    def forward(self, *inputs):
        return self._run(list(inputs))

    def _run(self, inputs):
        outs = torch.ops.kiln.run(self.artifact, self.key, inputs)
        return _scriptable(specs.decode(self.structure, outs))


def input_names(compiled) -> list | None:
    """The names the TorchScript ``forward`` takes, in the flat inputs' order: the model's own
    argument names when every input is a bare tensor with a name Python allows, else None."""
    structure, names = getattr(compiled, "input_structure", None), getattr(compiled, "arg_names", None)
    if not structure or names is None or specs.positional_tensors(structure, names) is None:
        return None
    names = [n for n, _ in structure["dict"]]
    if len(names) != len(compiled.input_specs) or not all(
            n.isidentifier() and not keyword.iskeyword(n) and n != "self" and not n.startswith("__")
            for n in names):
        return None
    return names


def _wrapper_class(names):
    """``_Wrapper`` whose ``forward`` has the signature ``(self, <names>)``: ``torch.jit.trace``
    takes the traced function's parameter names (``inspect.signature``) into the saved
    schema, so the loaded module's callers can give the inputs by name."""
    if names is None:
        return _Wrapper

    def forward(self, *inputs):
        return self._run(list(inputs))
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ["self", *names]])
    return type("_Wrapper", (_Wrapper,), {"forward": forward, "__module__": __name__})


def _scriptable(value):
    """TorchScript has no ModelOutput and only homogeneous dicts: keep plain tensor-valued
    dicts as dicts, turn ModelOutputs and other mappings into tuples, as HF's own
    ``torchscript=True`` mode does."""
    if isinstance(value, dict):
        if type(value) is dict and all(isinstance(v, torch.Tensor) for v in value.values()):
            return dict(value)
        return tuple(_scriptable(v) for v in value.values())
    if isinstance(value, (tuple, list)):      # a namedtuple too: a plain tuple, as a ModelOutput
        return (tuple if isinstance(value, tuple) else list)(_scriptable(v) for v in value)
    return value


def _not_tensors(structure, path="output") -> list:
    """Where the output ``structure`` holds a None or a constant, which TorchScript cannot
    return from a traced module."""
    if "none" in structure or "const" in structure:
        return [f"{path} is {'None' if 'none' in structure else repr(structure['const'])}"]
    found = []
    for kind in ("tuple", "list"):
        for i, sub in enumerate(structure.get(kind, ())):
            found += _not_tensors(sub, f"{path}[{i}]")
    for kind in ("dict", "namedtuple", "model_output"):
        for key, sub in structure.get(kind, ()):
            found += _not_tensors(sub, f"{path}.{key}")
    return found


class _Describing:
    """While a kiln model is traced into TorchScript, ``kiln::run`` of its artifact answers
    with zero-strided placeholders of the output specs instead of running the model: the
    trace records the call, not its values, so saving neither loads and runs the model nor
    allocates its declared input and output sizes."""

    def __init__(self, key: str, output_specs):
        self.state = (key, list(output_specs))

    def __enter__(self):
        self.previous = getattr(_describing, "state", None)
        _describing.state = self.state
        return self

    def __exit__(self, *exc):
        _describing.state = self.previous


def described_outputs(key: str) -> list | None:
    """What ``kiln::run`` of the artifact ``key`` answers while this thread traces it
    (:class:`_Describing`); None otherwise, and then it runs the model."""
    state = getattr(_describing, "state", None)
    if state is None or state[0] != key:
        return None
    return [torch.zeros((), dtype=s.dtype).expand(tuple(s.shape)) for s in state[1]]


def to_torchscript(compiled) -> torch.jit.ScriptModule:
    """A TorchScript module taking the model's inputs by name (:func:`input_names`), or the
    flat input tensors positionally. The trace runs on zero-strided example inputs and the
    model is not run (:class:`_Describing`): nothing of the declared sizes is allocated,
    however large they are."""
    import warnings
    from kiln.errors import KilnError
    loose = _not_tensors(compiled.output_structure)
    if loose:
        raise KilnError(f"{compiled.name} cannot be saved as TorchScript (torch.jit.save): "
                        f"{', '.join(loose[:3])}, and a TorchScript module returns tensors only. Save it as "
                        "kiln's own artifact (model.save to a path ending in .kiln), which keeps every output, "
                        "or return only tensors from the model")
    example = [torch.zeros((), dtype=s.dtype).expand(tuple(s.shape)) for s in compiled.input_specs]
    wrapper = _wrapper_class(input_names(compiled))(compiled)
    with warnings.catch_warnings(), _Describing(wrapper.key, compiled.output_specs):
        warnings.simplefilter("ignore")
        return torch.jit.trace(wrapper, tuple(example), check_trace=False, strict=False)


def _save_torchscript(self, f, _extra_files=None):
    """``save`` of a model traced through a Neuron spelling (:func:`saving_torchscript`)."""
    from kiln.atomic import write_atomic
    path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else None
    if path is not None and path.endswith(".kiln") and _extra_files is None:
        return super(type(self), self).save(path)      # the name asks for kiln's own artifact
    data = to_torchscript(self).save_to_buffer(_extra_files=_extra_files or {})
    if path is None:
        f.write(data)
        return None
    write_atomic(path, lambda out: out.write(data))
    return path


_saving_classes: dict = {}      # a kiln model class -> its subclass whose save writes TorchScript
_saving_lock = threading.Lock()


def saving_torchscript(model):
    """``model``, whose ``model.save(path)`` now writes TorchScript, as Neuron's traced models
    (TorchScript modules) do: what ``torch.jit.load`` reads, the same file
    ``torch.jit.save(model, path)`` writes. A path ending in ``.kiln`` still gets kiln's own
    artifact (``kiln.load``). Other kiln models' ``save`` writes ``.kiln`` artifacts.

    The model becomes an instance of a subclass of its class (same name, everything else
    inherited) that overrides ``save``; ``isinstance`` checks against its class still hold."""
    cls = type(model)
    if cls in _saving_classes.values():
        return model
    with _saving_lock:
        sub = _saving_classes.get(cls)
        if sub is None:
            sub = type(cls.__name__, (cls,), {"save": _save_torchscript, "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
            _saving_classes[cls] = sub
    model.__class__ = sub
    return model
