"""``torch.autocast(device_type="kiln")``: the CPU's auto-cast rules on kiln's device.

PyTorch's auto-cast for a PrivateUse1 device dispatches through its
``AutocastPrivateUse1`` key, with no rules of its own. kiln registers CPU's: matrix
products and convolutions run in the auto-cast dtype (bfloat16 by default; emulated
where the CPU lacks it, as CPU auto-cast is), losses and reductions that need the range
in float32, everything else falls through untouched. Scripts written for
``torch.autocast("neuron")`` or ``("cpu")`` get the same numbers on the device as on the
CPU.
"""
from __future__ import annotations

import torch

# CPU auto-cast's lists (aten/src/ATen/autocast_mode.cpp), the operations training
# scripts meet; the rest fall through in the dtype they come in
LOWER_PRECISION = ("conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
                   "addbmm", "linear", "matmul", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
                   "conv_transpose3d", "prelu", "scaled_dot_product_attention")
FLOAT32 = ("avg_pool3d", "binary_cross_entropy", "grid_sampler", "prod", "cdist", "mse_loss",
           "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss",
           "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss",
           "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "kl_div",
           "binary_cross_entropy_with_logits", "multilabel_margin_loss")

_KEY = torch._C.DispatchKey.AutocastPrivateUse1


def _kernel(op, to_float32: bool, device_type: str):
    def kernel(*args, **kwargs):
        dtype = torch.float32 if to_float32 else torch.get_autocast_dtype(device_type)

        def cast(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype \
                    and t.device.type == device_type and (to_float32 or t.dtype == torch.float32):
                return t.to(dtype)
            if isinstance(t, (list, tuple)):
                return type(t)(cast(x) for x in t)
            return t
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            return op(*cast(args), **{k: cast(v) for k, v in kwargs.items()})
    return kernel


def register(device_type: str):
    """Install the rules for ``device_type``; returns the libraries (keep them alive)."""
    lib = torch.library.Library("_", "IMPL")
    lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    for names, to_float32 in ((LOWER_PRECISION, False), (FLOAT32, True)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                aten.impl(op._schema.name + ("." + overload if overload != "default" else ""),
                          _kernel(op, to_float32, device_type), "AutocastPrivateUse1")
    return (lib, aten)
