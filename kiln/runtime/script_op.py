"""The ``kiln::run`` operator: what a TorchScript-saved kiln model calls to run.

``torch.jit.load`` of such a file needs the operator registered before the file is
read, as Neuron's does after ``import torch_neuronx``; so ``import kiln`` (and with it
every ``import torch`` where kiln is installed: its device's autoload imports kiln)
registers it. It is the one registration kiln makes at import, and it only declares
the operator: the runtime is imported, and the artifact embedded in the TorchScript
module loaded and its trust checked, on the first call.

Each loaded TorchScript module is its own kiln model, as each ``torch.jit.load`` of a
Neuron model is its own model on its own core: the model is keyed by the module's
``artifact`` buffer (its storage), not by the bytes in it. Two loads of one file are
two models, which ``move_trace_to_device`` places apart; a module's calls, and
``kiln.neuronx``'s functions given that module, all find its one model.
"""
from __future__ import annotations

import threading
from typing import List

import torch

# storage identity (its StorageImpl's address) -> (a weak reference to that storage, the model).
# The weak reference keeps the address from being reused while the entry exists, and says when
# the module that held the buffer is gone: its model is dropped at the next load.
_models: dict = {}
_lock = threading.Lock()


def model_for(artifact: torch.Tensor):
    """The kiln model of one TorchScript module's ``artifact`` buffer, loaded on first use and
    the same for every later call with that buffer (the module's own calls, and kiln.neuronx's
    functions given the module); another module's buffer, even of the same file, gets its own."""
    storage = artifact.untyped_storage()
    ident = storage._cdata
    entry = _models.get(ident)
    if entry is None:
        with _lock:
            entry = _models.get(ident)
            if entry is None:
                from torch.multiprocessing.reductions import StorageWeakRef
                from kiln.runtime.loader import load
                for k in [k for k, (ref, _) in _models.items() if ref.expired()]:
                    del _models[k]      # their modules are gone
                entry = (StorageWeakRef(storage), load(artifact.numpy().tobytes()))
                _models[ident] = entry
    return entry[1]


@torch.library.custom_op("kiln::run", mutates_args=())
def run(artifact: torch.Tensor, key: str, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    # ``key`` is the artifact's sha256, traced into every saved file (so the schema keeps it);
    # models are found by the buffer itself (model_for); it marks the call a trace describes.
    from kiln.runtime.torchscript import described_outputs
    placeholders = described_outputs(key)
    if placeholders is not None:
        return placeholders
    model = model_for(artifact)
    model.check(inputs)
    return [t.clone() if _aliases(t, inputs) else t for t in model.run_flat(list(inputs))]


def _aliases(t, inputs):
    # custom ops may not return their inputs; host-only programs can pass one through.
    return any(t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr() for i in inputs)


@run.register_fake
def _(artifact, key, inputs):
    raise RuntimeError("kiln::run has no symbolic form; it runs compiled artifacts eagerly")
