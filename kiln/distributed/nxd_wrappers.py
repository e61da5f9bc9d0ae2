"""The objects NxD's trainer hands back: ``NxDModel`` (``trainer.model``) and
``NxDOptimizer`` (``trainer.optimizer``).

``NxDModel`` is a thin ``nn.Module`` around the user's model (or its ``NxDPPModel``):
parameters, buffers and state dicts are the local ones (this pipeline stage's, with the
original names), attributes it does not have come from the wrapped model, and
``run_train`` is forward-then-backward without pipelining.

``NxDOptimizer.step`` does what NxD's does, in its order: sum the gradients of
sequence-parallel parameters (norms) over TP when ``sequence_parallel`` is on; without
ZeRO-1, average the gradients over DP (divided by DP, then summed, in buckets) and clip
them to ``max_grad_norm``; then the inner optimizer's step (which, under ZeRO-1, does
its own reduce-scatter, clipping and all-gather).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

BUCKET_CAP_MB = 512      # NxD's ALLREDUCE_BUCKET_CAP_MB default


def _state():
    from kiln.distributed import state
    return state


class NxDModel(torch.nn.Module):
    """What ``initialize_parallel_model`` returns: ``.module`` (the model, or its
    ``NxDPPModel`` when PP > 1), ``.nxd_config``, ``local_modules()``,
    ``original_module()``, ``run_train``, ``run_eval`` (PP only), and the wrapped HF model's
    ``config``/``dtype``/``name_or_path``."""

    def __init__(self, module, nxd_config):
        super().__init__()
        self.module = module
        self.nxd_config = nxd_config
        self.pp_enabled = nxd_config["pipeline_parallel_size"] > 1
        self.train()

    def __repr__(self):
        return f"NxDModel({self.module!r})"

    def local_modules(self):
        return self.module.local_stage_modules if self.pp_enabled else [self.module]

    def original_module(self):
        return self.module.original_torch_module if self.pp_enabled else self.module

    def run_train(self, *args, **kwargs):
        """PP: the pipeline's schedule (forward and backward over microbatches). Otherwise
        forward, then ``loss.backward()``: the model must return a scalar loss."""
        if self.pp_enabled:
            return self.module.run_train(*args, **kwargs)
        loss = self.forward(*args, **kwargs)
        if not torch.is_tensor(loss) or loss.dim() != 0:
            raise TypeError("NxDModel.run_train needs the model's forward to return a scalar loss tensor (it "
                            f"returned {type(loss).__name__}); call model(...) and backward yourself otherwise")
        loss.backward()
        return loss

    def run_eval(self, *args, **kwargs):
        if not self.pp_enabled:
            raise RuntimeError("`run_eval` should be used only when pipeline parallel is enabled.")
        return self.module.run_eval(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _local(self, name, *args, **kwargs):
        if self.pp_enabled:
            return getattr(self.module, "local_" + name)(*args, **kwargs)
        return getattr(self.module, name)(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        yield from self._local("named_parameters", *args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        yield from self._local("named_buffers", *args, **kwargs)

    def named_children(self):
        yield from self._local("named_children")

    def named_modules(self, *args, **kwargs):
        yield from self._local("named_modules", *args, **kwargs)

    def state_dict(self, *args, **kwargs):
        if self.pp_enabled:
            return self.module.local_state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    @property
    def dtype(self):
        return self.original_module().dtype

    @property
    def config(self):
        return self.original_module().config

    @property
    def name_or_path(self):
        return self.original_module().name_or_path


class NxDOptimizer(torch.optim.Optimizer):
    """What ``initialize_parallel_optimizer`` returns: ``.optimizer`` (the inner optimizer,
    a ``NeuronZero1Optimizer`` under ZeRO-1), ``.nxd_config``, ``.grad_norm`` (the last
    step's pre-clip norm, when clipping), and the optimizer interface forwarded to it."""

    def __init__(self, optimizer, nxd_config):       # no Optimizer.__init__: everything is the inner one's
        self.optimizer = optimizer
        self.nxd_config = nxd_config
        self._grad_norm = None
        self.params = [p for group in self.param_groups for p in group["params"]]

    def __repr__(self):
        return f"NxDOptimizer({self.optimizer!r})"

    @property
    def grad_norm(self):
        return self._grad_norm

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none=False):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self):
        return self.optimizer.__getstate__()

    def __setstate__(self, state):
        self.optimizer.__setstate__(state)

    def step(self, closure=None):
        if self.nxd_config["sequence_parallel"]:
            allreduce_sequence_parallel_gradients(self.params)
        config = self.nxd_config["optimizer_config"]
        if not config["zero_one_enabled"]:
            grads = [p.grad for p in self.params if p.grad is not None]
            bucket_allreduce_gradients(grads)
            if config["grad_clipping"]:
                from kiln.distributed.zero1 import clip_grad_norm
                self._grad_norm = clip_grad_norm(self.params, config["max_grad_norm"])
        result = self.optimizer.step(closure=closure)
        if config["zero_one_enabled"]:
            self._grad_norm = self.optimizer.grad_norm
        return result

    def save_state_dict(self, output_dir, num_workers_per_step=8):
        """Deprecated in NxD (use ``save_checkpoint``); ZeRO-1 only."""
        self._need_zero1("save_state_dict")
        self.optimizer.save_sharded_state_dict(output_dir, num_workers_per_step)

    def load_state_dict_from(self, output_dir, num_workers_per_step=8):
        """Deprecated in NxD (use ``load_checkpoint``); ZeRO-1 only."""
        self._need_zero1("load_state_dict_from")
        self.optimizer.load_sharded_state_dict(output_dir, num_workers_per_step)

    def _need_zero1(self, what):
        if not self.nxd_config["optimizer_config"]["zero_one_enabled"]:
            raise RuntimeError(f"NxDOptimizer.{what} is for ZeRO-1 optimizers (optimizer_config="
                               "{'zero_one_enabled': True}); use save_checkpoint/load_checkpoint")


def _coalesced_all_reduce(tensors, group, scale=None):
    """All-reduce (SUM) ``tensors`` as one flat buffer per dtype, in place."""
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        if scale is not None:
            flat = flat * scale
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].reshape(t.shape))
            offset += t.numel()


def allreduce_sequence_parallel_gradients(params):
    """Sum over TP the gradients of parameters tagged ``sequence_parallel_enabled`` (norm
    weights: each TP rank saw a different slice of the sequence)."""
    state = _state()
    if state.get_tensor_model_parallel_size() == 1:
        return
    grads = [p.grad for p in params if getattr(p, "sequence_parallel_enabled", False) and p.grad is not None]
    if grads:
        _coalesced_all_reduce(grads, state.get_tensor_model_parallel_group())


def bucket_allreduce_gradients(grads, bucket_cap_mb: int = BUCKET_CAP_MB):
    """The data-parallel mean of ``grads``: each divided by DP, then summed over DP, in
    buckets of at most ``bucket_cap_mb`` megabytes taken in reverse order (as NxD)."""
    state = _state()
    dp = state.get_data_parallel_size()
    if dp == 1 or not grads:
        return
    cap, bucket, size = bucket_cap_mb * 1024 * 1024, [], 0
    for g in reversed(grads):
        nbytes = g.numel() * g.element_size()
        if bucket and size + nbytes > cap:
            _coalesced_all_reduce(bucket, state.get_data_parallel_group(), 1.0 / dp)
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        _coalesced_all_reduce(bucket, state.get_data_parallel_group(), 1.0 / dp)
