"""kiln's device from ``import torch`` alone: PyTorch's device-backend autoload.

Near the end of ``import torch``, PyTorch loads and calls every entry point of the
``torch.backends`` group (``torch._import_device_backends``), unless
``TORCH_DEVICE_BACKEND_AUTOLOAD`` is set to anything but ``1``. kiln's entry point is
:func:`load`, so ``torch.device("kiln")``, ``.to("kiln")`` and ``torch.kiln`` work in a
script that never imports kiln, and the device exists before the process's first
backward pass, which is when PyTorch's autograd engine fixes the devices it serves.

``KILN_DEVICE_NAME`` picks the name: ``kiln`` (default), ``neuron`` for TorchNeuron
scripts (``torch.device("neuron")``, ``torch.neuron``), or ``off`` to leave PyTorch's
PrivateUse1 backend to another package. On a CUDA build of torch the device is left out
unless ``KILN_DEVICE_NAME`` names it (:func:`kiln.device.registration.spares_cuda`): a
registered PrivateUse1 device breaks CUDA backward passes. A failure never breaks ``import torch``: it is
a ``RuntimeWarning`` saying why, and the device is then missing (``kiln.trace`` and
``torch.compile(backend="kiln")`` do not need it).
"""
from __future__ import annotations

import warnings

ENTRY_POINT = "kiln = kiln_autoload:load"    # pyproject's [project.entry-points."torch.backends"]; it calls load()


def load() -> None:
    """The ``torch.backends`` entry point: register kiln's device under
    ``KILN_DEVICE_NAME``. Warns instead of raising: PyTorch turns an exception here into
    a failed ``import torch`` for every program in the environment."""
    name = "kiln"
    try:
        from kiln.device import modes, registration
        name = registration.configured_name()
        if name is None or registration.spares_cuda():
            return
        registration.register(name, probe=False)
        modes.device(name)          # registered: adds the eager-mode optimizer-step hook
    except Exception as e:  # noqa: BLE001 - import torch must survive whatever happens here
        warnings.warn(
            f"kiln could not register its device '{name}' while torch was imported "
            f"({type(e).__name__}: {e}); torch works without it, and so do kiln.trace and "
            f"torch.compile(backend='kiln'). KILN_DEVICE_NAME=off skips this registration; "
            f"TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips every device backend's", RuntimeWarning, stacklevel=2)
