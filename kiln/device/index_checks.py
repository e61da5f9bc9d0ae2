"""Operators whose PyTorch form checks no index on kiln's tensors, given one that does.

``F.one_hot`` (PyTorch 2.13, ``aten/src/ATen/native/Onehot.cpp``) builds its result as
``arange(num_classes) == self.unsqueeze(-1)`` for any tensor with the Python dispatch key
(meant for fake tensors), which every kiln tensor has, and that form checks nothing: a
class of 7 among 4, or a negative one, gave a row of zeros, where the CPU raises "Class
values must be smaller than num_classes". Registered for kiln's device, ``one_hot`` is
computed as the CPU and CUDA compute it, ``zeros(..., num_classes).scatter_(-1, self, 1)``,
so an out-of-range class is the error ``scatter_``'s own bounds check raises ("index 7 is
out of bounds for dimension 1 with size 4"), in eager mode at the call and in lazy mode
where the step runs, compiled or not. The check stays inside the program: no flush in the
middle of a lazy step to read the classes.
"""
from __future__ import annotations

import torch


def _one_hot(self, num_classes: int = -1):
    if self.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    with torch._C._AutoDispatchBelowAutograd():
        if num_classes == -1:
            if self.numel() == 0:
                raise RuntimeError("Can not infer total number of classes from empty tensor.")
            num_classes = int(self.max()) + 1           # the CPU reads it too
        out = torch.zeros(*self.shape, num_classes, dtype=torch.long, device=self.device)
        return out.scatter_(-1, self.unsqueeze(-1), 1)


def register():
    """The kernels registered for kiln's tensors; returns the library (keep it alive)."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("one_hot", _one_hot, "AutogradPrivateUse1")
    return library
