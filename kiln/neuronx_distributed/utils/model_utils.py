"""``neuronx_distributed.utils.model_utils``: moving a model to the device without losing
what NxD hangs on parameters (tensor-parallel attributes, tied weights)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

_KEEP = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions", "rank_ordering",
         "sequence_parallel_enabled", "shared", "expert_model_parallel", "row_replicas")


def move_model_to_device(model: nn.Module, device) -> None:
    """``model.to(device)`` in place, keeping each parameter's NxD attributes and keeping
    parameters that several modules share (tied embeddings) one parameter. ``Module.to``
    can replace a parameter by a new object for a device tensor subclass, dropping both."""
    attrs = {id(p): {k: getattr(p, k) for k in _KEEP if hasattr(p, k)} for p in model.parameters()}
    owners = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    moved = {}
    for pid, places in owners.items():
        mod, name = places[0]
        old = mod._parameters[name]
        new = nn.Parameter(old.detach().to(device), requires_grad=old.requires_grad)
        for k, v in attrs.get(pid, {}).items():
            setattr(new, k, v)
        for m, n in places:
            m._parameters[n] = new
        moved[pid] = new
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.to(device)


@contextlib.contextmanager
def init_on_device(device, include_buffers: bool = False, force_custom_init_on_device: bool = False):
    """Create the parameters (and buffers, with ``include_buffers``) of modules built in
    the block directly on ``device`` (``"meta"`` to allocate nothing). kiln's parallel
    layers always draw their initial values on the CPU (deterministic across TP degrees)
    and move them, so ``force_custom_init_on_device`` changes nothing for them."""
    device = torch.device(device)
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def on_device_parameter(module, name, param):
        register_parameter(module, name, param)
        if param is not None:
            kwargs = dict(module._parameters[name].__dict__)
            module._parameters[name] = type(param)(param.to(device), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(kwargs)

    def on_device_buffer(module, name, buffer, persistent=True):
        register_buffer(module, name, buffer, persistent=persistent)
        if buffer is not None:
            module._buffers[name] = module._buffers[name].to(device)

    nn.Module.register_parameter = on_device_parameter
    if include_buffers:
        nn.Module.register_buffer = on_device_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter
        nn.Module.register_buffer = register_buffer
