"""Input/output structure of a compiled model, as plain JSON.

The artifact must describe nested inputs and outputs (tuples, lists, dicts,
Hugging Face ``ModelOutput``) without pickling Python objects, so a structure
is encoded as a small JSON tree whose leaves index a flat list of tensors.
Decoding never imports anything: a ``ModelOutput`` class is reused only when
its module is already loaded, otherwise the result is a :class:`Output`, which
behaves the same for attribute, key and index access. A namedtuple comes back as a
namedtuple: its own class where that is loaded, else one made with its name and fields
(a tuple, so unpacking gives the tensors, as eager's does).
"""
from __future__ import annotations

import collections
import keyword
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kiln.errors import ArtifactError, InputError, KilnError


class Output(OrderedDict):
    """Mapping output that also allows ``out.name`` and ``out[0]``, like ModelOutput."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        if isinstance(key, (int, slice)):
            return tuple(self.values())[key]
        return super().__getitem__(key)

    def to_tuple(self):
        return tuple(self.values())


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: torch.dtype

    def to_dict(self):
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], tuple(d["shape"]), dtype_from_name(d["dtype"]))

    def describe(self):
        return f"{tuple(self.shape)} {dtype_name(self.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ArtifactError(f"unknown dtype {name!r} in artifact")
    return dtype


def _is_model_output(value) -> bool:
    return any(c.__name__ == "ModelOutput" for c in type(value).__mro__)


def encode(value, name: str, leaves: list, specs: list):
    """Return the JSON structure of ``value``; append its tensors to ``leaves``."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        specs.append(TensorSpec(name, tuple(value.shape), value.dtype))
        return {"t": len(leaves) - 1}
    if value is None:
        return {"none": True}
    if _is_model_output(value) or isinstance(value, dict):
        kind = "dict"
        cls = None
        if _is_model_output(value):
            kind, cls = "model_output", f"{type(value).__module__}:{type(value).__qualname__}"
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise KilnError(f"dict keys must be strings: {name or 'a dict'} has the key {k!r} "
                                f"({type(k).__name__}), and a compiled model's dict keys name its inputs and "
                                "outputs; use str keys (e.g. str(key))")
            items.append([k, encode(v, f"{name}.{k}" if name else k, leaves, specs)])
        out = {kind: items}
        if cls:
            out["class"] = cls
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"namedtuple": [[f, encode(v, f"{name}.{f}", leaves, specs)] for f, v in zip(value._fields, value)],
                "class": f"{type(value).__module__}:{type(value).__qualname__}"}
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [encode(v, f"{name}[{i}]", leaves, specs) for i, v in enumerate(value)]}
    if isinstance(value, (bool, int, float, str)):
        return {"const": value}
    # a Hugging Face decoder returns its KV cache (DynamicCache...) unless told not to
    cache = (" A Hugging Face model returns its KV cache unless the example passes use_cache=False; "
             "to generate, compile the decoder with kiln.llm (compile_llm, `kiln llm compile`), which "
             "keeps the cache itself." if type(value).__name__.endswith("Cache") else "")
    raise KilnError(
        f"{name or 'value'}: values of type {type(value).__name__} are not supported as model "
        f"inputs or outputs; use tensors, tuples, lists, dicts or ModelOutput.{cache}")


def decode(structure, leaves):
    """Inverse of :func:`encode` for outputs."""
    if "t" in structure:
        return leaves[structure["t"]]
    if "none" in structure:
        return None
    if "const" in structure:
        return structure["const"]
    if "tuple" in structure:
        return tuple(decode(s, leaves) for s in structure["tuple"])
    if "list" in structure:
        return [decode(s, leaves) for s in structure["list"]]
    if "dict" in structure:
        return {k: decode(s, leaves) for k, s in structure["dict"]}
    if "namedtuple" in structure:
        fields = tuple(k for k, _ in structure["namedtuple"])
        return _namedtuple(structure.get("class", ""), fields)(*(decode(s, leaves) for _, s in structure["namedtuple"]))
    if "model_output" in structure:
        values = [(k, decode(s, leaves)) for k, s in structure["model_output"]]
        cls = _loaded_class(structure.get("class", ""))
        if cls is not None and _is_model_output_class(cls):
            try:
                return cls(**dict(values))
            except TypeError:   # fields this version of the class does not have
                pass
        return Output(values)
    raise KilnError(f"unknown structure node {sorted(structure)} in artifact")


_NAMEDTUPLES: dict = {}


def _namedtuple(path: str, fields: tuple) -> type:
    """The namedtuple class an output was made with (``module:qualname``; an artifact
    before 12-03 kept the bare name) where it is loaded and has these fields, else one made
    with its name and fields. Until 12-03 a namedtuple came back as a :class:`Output`, a
    mapping: ``logits, hidden = model(x)`` unpacked its field names, not its tensors."""
    cls = _loaded_class(path) if ":" in path else None
    if isinstance(cls, type) and issubclass(cls, tuple) and tuple(getattr(cls, "_fields", ())) == fields:
        return cls
    name = path.rpartition(":")[2].rpartition(".")[2]
    if not name.isidentifier() or keyword.iskeyword(name):
        name = "Output"
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        try:
            _NAMEDTUPLES[key] = collections.namedtuple(name, fields)
        except (TypeError, ValueError) as e:    # the schema checks fields are strings, not identifiers
            raise ArtifactError(f"the artifact's output names a namedtuple with fields {list(fields)} that "
                                f"Python cannot make ({e}); the file is damaged or was not written by kiln") from None
    return _NAMEDTUPLES[key]


def _is_model_output_class(cls) -> bool:
    """A Hugging Face ``ModelOutput`` subclass: the one kind of class an artifact may name
    to be built at decode (anything else, e.g. ``subprocess:Popen``, would run code)."""
    base = sys.modules.get("transformers.utils.generic") or sys.modules.get("transformers.utils")
    model_output = getattr(base, "ModelOutput", None)
    return isinstance(model_output, type) and issubclass(cls, model_output)


def _loaded_class(path: str):
    """The class named ``module:qualname`` if its module is already imported (never imports)."""
    module_name, _, qualname = path.partition(":")
    obj = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def describe(structure, specs=None) -> str:
    """What a structure expects, for messages: ``((2, 4) float32, {'w': (4,) float32})``."""
    if "t" in structure:
        i = structure["t"]
        return specs[i].describe() if specs is not None and 0 <= i < len(specs) else "a tensor"
    if "none" in structure:
        return "None"
    if "const" in structure:
        return repr(structure["const"])
    if "tuple" in structure or "list" in structure:
        items = [describe(s, specs) for s in structure.get("tuple", structure.get("list"))]
        if "list" in structure:
            return f"[{', '.join(items)}]"
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
    for kind in ("dict", "namedtuple", "model_output"):
        if kind in structure:
            return "{" + ", ".join(f"{k!r}: {describe(s, specs)}" for k, s in structure[kind]) + "}"
    return "?"


def _what(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, np.generic):
        return f"a NumPy {value.dtype} scalar"
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)} {dtype_name(value.dtype)}"
    return type(value).__name__


def numpy_tensor(array) -> torch.Tensor:
    """A NumPy array as a tensor: shared, unless it is read-only or has negative strides
    (copied then); a TypeError for a dtype torch has no equivalent of."""
    if not array.flags.writeable or any(s < 0 for s in array.strides):
        array = np.array(array)
    return torch.from_numpy(array)


def _from_numpy(array, path, expected):
    try:
        return numpy_tensor(array)
    except TypeError:
        raise InputError(f"input '{path}': expected a tensor of {expected}, got a NumPy array of "
                         f"dtype {array.dtype}, which has no torch equivalent") from None


def positional_tensors(structure, names) -> int | None:
    """The number of inputs when every one is a bare tensor that a call may give positionally,
    in order (flattening such a call is the identity: the runtime skips the walk), else None.
    With a ``*args`` in the model, names after its last entry are keyword-only."""
    entries, names = structure.get("dict", []), list(names)
    star = [i for i, n in enumerate(names) if n.endswith("]") and "[" in n]
    if [n for n, _ in entries] != names or (star and star[-1] != len(names) - 1):
        return None
    return len(names) if all(set(st) == {"t"} for _, st in entries) else None


def flatten_inputs(structure, values, path, out, specs=None):
    """Flatten call-time ``values`` following the traced ``structure``, checking it matches.

    NumPy arrays are taken where tensors are expected (shared, not copied); ``specs``
    (the flat input specs) let messages say what was expected."""
    if "t" in structure:
        if isinstance(values, np.ndarray):
            values = _from_numpy(values, path, describe(structure, specs))
        if not isinstance(values, torch.Tensor):
            raise InputError(f"input '{path}': expected a tensor of {describe(structure, specs)}, "
                             f"got {_what(values)}")
        out.append(values)
    elif "none" in structure:
        if values is not None:
            raise InputError(f"input '{path}': the model was compiled with None here, got {_what(values)}")
    elif "const" in structure:
        # (a tensor or array compared with ``!=`` gives no single truth value)
        if isinstance(values, (torch.Tensor, np.ndarray)) or values != structure["const"]:
            raise InputError(f"input '{path}': the model was compiled with the constant "
                             f"{structure['const']!r}, got "
                             f"{values if isinstance(values, (bool, int, float, str)) else _what(values)!r}; "
                             "recompile to change it")
    elif "tuple" in structure or "list" in structure:
        subs = structure.get("tuple", structure.get("list"))
        if not isinstance(values, (tuple, list)) or len(values) != len(subs):
            raise InputError(f"input '{path}': expected a sequence of {len(subs)} items "
                             f"{describe(structure, specs)}, got {_what(values)}")
        for i, (s, v) in enumerate(zip(subs, values)):
            flatten_inputs(s, v, f"{path}[{i}]", out, specs)
    elif "dict" in structure:
        keys = [k for k, _ in structure["dict"]]
        if not isinstance(values, dict):
            raise InputError(f"input '{path}': expected a dict {describe(structure, specs)}, "
                             f"got {_what(values)}")
        if set(values) != set(keys):
            raise InputError(f"input '{path}': expected keys {keys} ({describe(structure, specs)}), "
                             f"got {list(values)}")
        for k, s in structure["dict"]:
            flatten_inputs(s, values[k], f"{path}.{k}", out, specs)
    else:
        raise InputError(f"input '{path}': unsupported structure")
