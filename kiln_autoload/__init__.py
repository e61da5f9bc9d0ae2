"""The ``torch.backends`` entry point of the kiln distribution, kept outside the ``kiln``
package on purpose: PyTorch imports an entry point's module during ``import torch`` and
turns any exception into a failed ``import torch`` for every program in the
environment. Importing ``kiln`` runs ``kiln/__init__.py`` and its imports; here a
failure of those is a warning, so ``import torch`` survives a broken kiln install.
The registration itself is :func:`kiln.device.autoload.load` (which warns too).
"""
import warnings


def load() -> None:
    try:
        from kiln.device import autoload
    except Exception as e:  # noqa: BLE001 - import torch must survive a broken kiln
        warnings.warn(f"kiln could not be imported while torch was imported ({type(e).__name__}: {e}), "
                      f"so its device is not registered; torch works without it. "
                      f"TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips device backends' entry points",
                      RuntimeWarning, stacklevel=2)
        return
    autoload.load()
