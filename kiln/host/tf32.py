"""TF32 on NVIDIA GPUs: whether PyTorch lets fp32 matmuls and convolutions use it, and a
way to let them for one compile.

TF32 keeps fp32's exponent and 10 bits of mantissa (unit roundoff 2^-11): tensor cores
since Ampere (compute capability 8.0) multiply fp32 inputs rounded to it and accumulate
in fp32. PyTorch decides per kind of op, process-wide:

* convolutions (cuDNN): allowed by default (``torch.backends.cudnn.allow_tf32``, or from
  torch 2.9 ``torch.backends.cudnn.conv.fp32_precision == "tf32"``);
* matmuls (cuBLAS): not by default (``torch.backends.cuda.matmul.allow_tf32``,
  ``torch.set_float32_matmul_precision("high")``, or from torch 2.9
  ``torch.backends.cuda.matmul.fp32_precision == "tf32"``).

From torch 2.9 both APIs exist; once a process has set one through the new API, torch's
legacy getters raise ("mix of the legacy and new APIs"), so the new one is read where it
exists. A value ``"none"`` there inherits from ``torch.backends.cudnn.fp32_precision``
(all CUDA ops), then ``torch.backends.fp32_precision``; TF32 is on only where the first
value set is ``"tf32"``, as ATen's ``Context::float32Precision`` resolves it. Here, not in
the graph layer, because engines sit below it and the compiler sets these flags too.
"""
from __future__ import annotations

import contextlib

import torch

KINDS = ("conv", "matmul")


def _new_api() -> bool:
    conv = getattr(torch.backends.cudnn, "conv", None)
    try:
        return conv is not None and isinstance(conv.fp32_precision, str)
    except (AttributeError, RuntimeError):
        return False


def _resolved(value: str) -> bool:
    for v in (value, torch.backends.cudnn.fp32_precision, torch.backends.fp32_precision):
        if v != "none":
            return v == "tf32"
    return False


def flags() -> dict:
    """``{"conv": bool, "matmul": bool}``: whether torch's settings let fp32 convolutions
    and matmuls on CUDA compute in TF32 (whatever the GPU)."""
    if _new_api():
        return {"conv": _resolved(torch.backends.cudnn.conv.fp32_precision),
                "matmul": _resolved(torch.backends.cuda.matmul.fp32_precision)}
    return {"conv": bool(torch.backends.cudnn.allow_tf32),
            "matmul": bool(torch.backends.cuda.matmul.allow_tf32)}


def computed_here() -> bool:
    """Whether this host's GPU has TF32 tensor cores (Ampere, compute capability 8.0, on)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def in_effect() -> dict:
    """:func:`flags`, and False for both where the GPU cannot compute TF32 (before Ampere the
    flags change nothing: fp32 is computed in fp32)."""
    here = computed_here()
    return {kind: here and allowed for kind, allowed in flags().items()}


@contextlib.contextmanager
def allowed():
    """TF32 allowed for fp32 matmuls and convolutions on CUDA inside, torch's flags as they
    were afterwards. Process-wide, as torch's flags are: other threads computing on the GPU
    meanwhile see TF32 too. Set through torch's legacy setters, which keep the legacy and
    the new representation in step (torch's own tests do the same)."""
    try:
        saved = ("legacy", torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    except RuntimeError:   # the process mixed the two APIs: restore the new one's values
        saved = ("new", torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        yield
    finally:
        api, matmul, conv = saved
        if api == "legacy":
            torch.set_float32_matmul_precision(matmul)
            torch.backends.cudnn.allow_tf32 = conv
        else:
            torch.backends.cuda.matmul.fp32_precision = matmul
            torch.backends.cudnn.conv.fp32_precision = conv
