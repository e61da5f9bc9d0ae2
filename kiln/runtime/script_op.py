"""The ``kiln::run`` operator: what a TorchScript-saved kiln model calls to run.

``torch.jit.load`` of such a file needs the operator registered before the file is
read, as Neuron's does after ``import torch_neuronx``; so ``import kiln`` (and with it
every ``import torch`` where kiln is installed: its device's autoload imports kiln)
registers it. It is the one registration kiln makes at import, and it only declares
the operator: the runtime is imported, and the artifact embedded in the TorchScript
module loaded and its trust checked, on the first call.
"""
from __future__ import annotations

import threading
from typing import List

import torch

_cache: dict = {}
_cache_lock = threading.Lock()


def model_for(artifact: torch.Tensor, key: str | None = None):
    """The kiln model a TorchScript module's ``artifact`` buffer holds, loaded once per
    process (``key``: the artifact's sha256, computed when not given) and shared with
    :func:`run`, e.g. to check a call's inputs before it is run elsewhere too."""
    if key is None:
        from kiln.artifact.container import sha256
        key = sha256(artifact.numpy().tobytes())
    model = _cache.get(key)
    if model is None:
        with _cache_lock:
            model = _cache.get(key)
            if model is None:
                from kiln.runtime.loader import load
                model = load(artifact.numpy().tobytes())
                _cache[key] = model
    return model


@torch.library.custom_op("kiln::run", mutates_args=())
def run(artifact: torch.Tensor, key: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    model = model_for(artifact, key)
    model.check(inputs)
    return [t.clone() if _aliases(t, inputs) else t for t in model.run_flat(list(inputs))]


def _aliases(t, inputs):
    # custom ops may not return their inputs; host-only programs can pass one through.
    return any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs)


@run.register_fake
def _(artifact, key, inputs):
    raise RuntimeError("kiln::run has no symbolic form; it runs compiled artifacts eagerly")
