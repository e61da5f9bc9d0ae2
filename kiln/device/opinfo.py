"""What the device's dispatcher needs to know about an ATen operation, worked out once.

Reading a schema's arguments and returns makes Python objects at every access: the
dispatcher asking them at every call cost a weight's ``t()`` 17 of its 45 µs in
:func:`kiln.device.dispatch.run_now`. So each operation's facts are read from its schema
the first time it is seen and kept, keyed by the operation's ``id`` (an ``OpOverload``'s
``__hash__`` is Python code, and this runs for every operation).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

# uninitialised memory: no program computes it, and a compiled one would "disagree"
_ALLOCATIONS = {"empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty"}
# operations whose meta kernels give other shapes than their CPU kernels (EmbeddingBag's
# offset2bag and max_indices: [4] and [0] on meta, [0] and [2] on the CPU), so a recorded
# call's outputs would not be what the compiled graph returns: they run now, on host data
_META_DIFFERS = {"_embedding_bag", "_embedding_bag_forward_only"}
# outputs PyTorch puts on the CPU whatever the device (a PackedSequence's batch sizes, which
# pack_padded_sequence checks and the LSTM reads there): such operations run now, and those
# outputs stay host tensors. Wrapped, every packed sequence on the device raised
_HOST_OUTPUTS = {"_pack_padded_sequence": (1,)}


class Info:
    """One operation's facts (see the module docstring)."""
    __slots__ = ("func", "name", "foreach", "recordable", "mutation", "view", "schema", "written",
                 "returns", "returns_written", "c10d", "host_outputs")

    def __init__(self, func):
        self.func = func        # kept alive: the table below is keyed by id(func)
        schema = self.schema = func._schema
        self.name = schema.name.split("::")[-1]
        self.foreach = self.name.startswith("_foreach_")
        self.recordable = recordable(func, schema)
        self.mutation = schema.is_mutable or func is aten.native_batch_norm.default
        self.view = is_view(schema)
        # the arguments the operation writes: (position, name)
        self.written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        ret = schema.returns
        self.returns = bool(ret)
        self.returns_written = bool(ret) and ret[0].alias_info is not None and ret[0].alias_info.is_write
        # collectives, in-place and functional (kiln.device.collectives)
        self.c10d = schema.name.startswith(("c10d::", "_c10d_functional::"))
        self.host_outputs = _HOST_OUTPUTS.get(self.name, ())


_INFO: dict = {}


def info(func) -> Info:
    found = _INFO.get(id(func))
    if found is None:
        found = _INFO[id(func)] = Info(func)
    return found


def recordable(func, schema) -> bool:
    """ATen's functional operations only: collectives (``c10d``, ``_c10d_functional``) and
    other libraries' operations may have effects beyond their outputs, so they run now."""
    if func.namespace != "aten":
        return False
    name = schema.name.split("::")[-1]
    if torch.Tag.nondeterministic_seeded in func.tags or name in _ALLOCATIONS or name in _META_DIFFERS \
            or name in _HOST_OUTPUTS:
        return False
    for ret in schema.returns:
        text = str(ret.type)
        if text not in ("Tensor", "List[Tensor]", "Optional[Tensor]"):
            return False
    return bool(schema.returns) or schema.is_mutable


def is_view(schema) -> bool:
    ret = schema.returns[0] if schema.returns else None
    return ret is not None and ret.alias_info is not None and not ret.alias_info.is_write
