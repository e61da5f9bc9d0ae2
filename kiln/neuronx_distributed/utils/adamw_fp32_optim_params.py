"""``neuronx_distributed.utils.adamw_fp32_optim_params``: the AdamW NxD's training scripts
use for bf16 models, with its states and update in float32."""
from __future__ import annotations

import math

import torch


class AdamW_FP32OptimParams(torch.optim.Optimizer):  # noqa: N801 - NxD's name
    """transformers' (pre-4.x) AdamW, as NxD has it: the moments are float32 whatever the
    parameters' dtype, and each step is computed on a float32 copy of the parameter and its
    gradient and written back in the parameter's dtype (a bf16 model's moments in bf16 lose
    the small updates). ``correct_bias`` as there; weight decay is applied after the Adam
    update, to the parameter, scaled by ``lr`` (decoupled, transformers' order)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr} - should be >= 0.0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas} - should be in [0.0, 1.0)")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps} - should be >= 0.0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW_FP32OptimParams does not support sparse gradients")
                grad, param = p.grad.float(), p.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size *= math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
                param.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    param.add_(param, alpha=-group["lr"] * group["weight_decay"])
                p.copy_(param)
        return loss
