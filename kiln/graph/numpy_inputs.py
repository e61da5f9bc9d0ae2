"""NumPy arrays given as example inputs to ``kiln.trace`` (or ``kiln.analyze``) are
tensors, as they are at call time: shared through ``torch.from_numpy``, not copied
(copied where the array is read-only or has negative strides, which a tensor cannot
share). An array given bare had its rows taken as separate positional inputs ("too many
positional arguments"), and one inside a tuple was refused as "values of type ndarray are
not supported as model inputs"."""
from __future__ import annotations

import numpy as np
import torch

from kiln.artifact.specs import numpy_tensor
from kiln.errors import CaptureError


def as_tensors(value):
    """``value`` with every NumPy array in it (in tuples, lists and dicts) a tensor."""
    if isinstance(value, np.ndarray):
        return _tensor(value)
    if isinstance(value, dict):
        return type(value)((k, as_tensors(v)) for k, v in value.items()) if _has_array(value) else value
    if isinstance(value, (tuple, list)) and _has_array(value):
        items = [as_tensors(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _has_array(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, dict):
        return any(_has_array(v) for v in value.values())
    return isinstance(value, (tuple, list)) and any(_has_array(v) for v in value)


def _tensor(array: np.ndarray) -> torch.Tensor:
    try:
        return numpy_tensor(array)
    except TypeError:
        raise CaptureError(f"an example input is a NumPy array of dtype {array.dtype}, which has no "
                           "torch equivalent: give a numeric array or a tensor") from None
