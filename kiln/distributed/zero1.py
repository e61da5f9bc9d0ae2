"""ZeRO-1: each data-parallel rank keeps the optimizer state of 1/DP of every parameter.

This is NxD's ``NeuronZero1Optimizer`` (``neuronx_distributed.optimizer``), which is
torch_xla's ``ZeroRedundancyOptimizer`` with NxD's gradient norm, on
``torch.distributed`` process groups:

* at :meth:`init_zero` every parameter is padded on dim 0 to a multiple of DP and
  ``chunk(dp)[dp_rank]`` becomes this rank's shard (in ``optimizer_dtype``, float32 by
  default: a bf16 model gets float32 master shards); the inner optimizer is built on
  the shards only, so its state (Adam's two moments) is 1/DP of the model's;
* :meth:`step` reduce-scatters the gradients over the sharding group (SUM, then scaled
  by 1/DP: the data-parallel mean), computes the global gradient norm (TP, then PP,
  then a SUM over the DP shards, as NxD's ``get_grad_norm(zero1_optimizer=True)``
  does), clips with ``max_norm/(norm+1e-6)`` when that is below 1, steps the inner
  optimizer on the shards and all-gathers the updated shards back into the parameters.

Gradients go in one coalesced reduce-scatter and parameters come back in one all-gather
per step (torch_xla's ``coalesce_cc=True``, which NxD sets), not one collective per
parameter: on gloo each collective is a round trip, and a decoder has dozens of
parameters. The numbers are those of per-parameter collectives: every element is still
the sum of the same DP values.
"""
from __future__ import annotations

import copy
import math
import os

import torch
import torch.distributed as dist

from kiln.distributed.ckpt_files import load_file, save_file, to_cpu
from kiln.errors import KilnError

_MESH_GROUPS: dict = {}


class Zero1Error(KilnError, RuntimeError):
    """ZeRO-1 used outside an initialized parallel state, or with state that does not fit."""


def _state():
    from kiln.distributed import state
    return state


def process_group_for(mesh):
    """The process group of this rank in ``mesh`` (torch_xla's groups: a list of rank lists)
    and this rank's index in it. A mesh equal to one of the parallel state's (DP, TP, PP)
    reuses its group; any other mesh makes new groups once, collectively (every rank must
    pass the same mesh, as torch_xla requires)."""
    state = _state()
    rank = state.global_rank()
    mesh = [list(g) for g in mesh]
    for kind in ("data", "tensor_model", "pipeline_model"):
        getter = getattr(state, f"get_{kind}_parallel_group")
        if [list(g) for g in getter(as_list=True)] == mesh:
            return getter(), _index(mesh, rank)
    key = tuple(tuple(g) for g in mesh)
    if key not in _MESH_GROUPS:
        mine = None
        for ranks in mesh:
            pg = dist.new_group(ranks)
            if rank in ranks:
                mine = pg
        _MESH_GROUPS[key] = mine
    return _MESH_GROUPS[key], _index(mesh, rank)


def _index(mesh, rank):
    for ranks in mesh:
        if rank in ranks:
            return ranks.index(rank)
    raise Zero1Error(f"rank {rank} is in none of the sharding groups {mesh}: each rank must be in one")


class NeuronZero1Optimizer(torch.optim.Optimizer):
    """``NeuronZero1Optimizer(params, optimizer_class, optimizer_dtype=None,
    grad_clipping=True, max_norm=None, pin_layout=True, sharding_groups=None,
    grad_norm_groups=None, lazy_init=False, **defaults)``.

    ``sharding_groups`` defaults to the data-parallel mesh. ``max_norm`` defaults to 1.0
    (torch_xla's default; NxD's ``initialize_parallel_optimizer`` does not pass its
    ``max_grad_norm`` here, and neither does kiln's). ``grad_norm_groups`` is kept for the
    signature: as in NxD, the norm is reduced over the parallel state's TP and PP groups.
    ``pin_layout`` is an XLA layout hint with no meaning on gloo. Of the newer torch_xla
    arguments: ``coalesce_cc`` (always on here), ``bucket_cap_mb_all_gather`` /
    ``bucket_cap_mb_reduce_scatter`` (one bucket per step here), ``higher_cc_precision``
    (reduce-scatter in float32), ``use_grad_acc_hook`` (a no-op for float32 parameters,
    refused for others) and ``save_master_weights`` (the shards go into the state dict).
    """

    def __init__(self, params, optimizer_class, optimizer_dtype=None, grad_clipping=True, max_norm=None,
                 pin_layout=True, sharding_groups=None, grad_norm_groups=None, lazy_init=False,
                 coalesce_cc=True, bucket_cap_mb_all_gather=None, bucket_cap_mb_reduce_scatter=None,
                 use_grad_acc_hook=False, higher_cc_precision=False, save_master_weights=False, **defaults):
        state = _state()
        if not state.model_parallel_is_initialized():
            raise Zero1Error("initialize_model_parallel need to be called before creating NeuronZero1Optimizer "
                             "(kiln.neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel, "
                             "or neuronx_distributed_config with torch.distributed initialized)")
        super().__init__(params, defaults)
        self._sharding_groups = (state.get_data_parallel_group(as_list=True) if sharding_groups is None
                                 else sharding_groups)
        self._grad_norm_groups = grad_norm_groups
        self.optimizer_class = optimizer_class
        self.defaults = defaults
        self.optimizer_dtype = optimizer_dtype if optimizer_dtype is not None else torch.float32
        self.grad_clipping = grad_clipping
        self.max_norm = max_norm if max_norm is not None else 1.0
        self.pin_layout = pin_layout
        self.higher_cc_precision = higher_cc_precision
        self.save_master_weights = save_master_weights
        if use_grad_acc_hook:
            odd = sorted({str(p.dtype) for g in self.param_groups for p in g["params"] if p.dtype != torch.float32})
            if odd:
                raise Zero1Error(f"use_grad_acc_hook=True (float32 gradient accumulation for {', '.join(odd)} "
                                 "parameters) is not supported by kiln's ZeRO-1: train in float32, or set "
                                 "mixed_precision_config={'use_fp32_grad_acc': False}")
        self._grad_norm = None
        self.inited = False
        if not lazy_init:
            self.init_zero()

    # -- sharding -----------------------------------------------------------------------------
    @property
    def sharding_groups(self):
        return self._sharding_groups

    @sharding_groups.setter
    def sharding_groups(self, groups):
        if self.inited:
            raise Zero1Error("already inited, cannot change sharding_groups")
        self._sharding_groups = groups

    @property
    def grad_norm(self):
        """The total gradient norm (before clipping) of the last :meth:`step`, or None."""
        return self._grad_norm

    def init_zero(self):
        """Shard the parameters' current values and build the inner optimizer on the shards.
        Call it again after loading model weights without optimizer state (NxD's examples
        do), so the shards hold the loaded values."""
        self._group, self.local_rank = process_group_for(self._sharding_groups)
        self.local_world_size = len(self._sharding_groups[0])
        sharded = []
        for group in self.param_groups:
            shards = [torch.nn.Parameter(self._shard_tensor(p.detach()).to(self.optimizer_dtype),
                                         requires_grad=p.requires_grad) for p in group["params"]]
            sharded.append({**{k: v for k, v in group.items() if k != "params"}, "params": shards})
        self.base_optimizer = self.optimizer_class(sharded, **self.defaults)
        _sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
        self.inited = True

    def _shard_tensor(self, tensor):
        return _pad_dim0(tensor, self.local_world_size).chunk(self.local_world_size)[self.local_rank].clone()

    def _pairs(self, with_grad=True):
        for group, sgroup in zip(self.param_groups, self.base_optimizer.param_groups):
            for param, shard in zip(group["params"], sgroup["params"]):
                if not with_grad or param.grad is not None:
                    yield param, shard

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Reduce-scatter the gradients, clip, step the shards, all-gather the parameters."""
        if not self.inited:
            raise Zero1Error("NeuronZero1Optimizer was built with lazy_init=True: call init_zero() before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _sync_param_groups(self.param_groups, self.base_optimizer.param_groups)
        pairs = list(self._pairs())
        self._reduce_gradients(pairs)
        if self.grad_clipping:
            self._clip_grad_norm(max_norm=self.max_norm)
        self.base_optimizer.step(**kwargs)
        self.base_optimizer.zero_grad(set_to_none=True)
        self._update_parameters(pairs)
        _sync_param_groups(self.base_optimizer.param_groups, self.param_groups)
        return loss

    def _reduce_gradients(self, pairs):
        if not pairs:
            return
        dp = self.local_world_size
        cc_dtype = torch.float32 if self.higher_cc_precision else None
        rows = [_pad_dim0(p.grad.detach(), dp).reshape(dp, -1) for p, _ in pairs]
        dtypes = {r.dtype for r in rows}
        dtype = cc_dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
        flat = torch.cat([r.to(dtype) for r in rows], dim=1)            # [dp, sum of shard sizes]
        if dp > 1:
            out = flat.new_empty(flat.shape[1])
            dist.reduce_scatter_tensor(out, flat.reshape(-1).contiguous(), group=self._group)
            out = out * (1.0 / dp)
        else:
            out = flat[0] * 1.0
        offset = 0
        for (_, shard), row in zip(pairs, rows):
            n = row.shape[1]
            shard.grad = out[offset:offset + n].reshape(shard.shape).to(self.optimizer_dtype)
            offset += n

    def _update_parameters(self, pairs):
        if not pairs:
            return
        dp = self.local_world_size
        dtypes = {p.dtype for p, _ in pairs}           # gather in the parameters' dtype, as torch_xla
        dtype = dtypes.pop() if len(dtypes) == 1 else self.optimizer_dtype
        flat = torch.cat([s.detach().reshape(-1).to(dtype) for _, s in pairs])
        if dp > 1:
            gathered = flat.new_empty(dp * flat.numel())
            dist.all_gather_into_tensor(gathered, flat.contiguous(), group=self._group)
            gathered = gathered.reshape(dp, -1)
        else:
            gathered = flat.reshape(1, -1)
        offset = 0
        for param, shard in pairs:
            n = shard.numel()
            full = gathered[:, offset:offset + n].reshape((dp * shard.shape[0],) + tuple(shard.shape[1:]))
            param.data.copy_(full[:_dim0(param)].reshape(param.shape).to(param.dtype))
            offset += n

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm, norm_type=2.0):
        pairs = [(p, s) for p, s in self._pairs(with_grad=False) if s.grad is not None]
        self._grad_norm = sharded_grad_norm(pairs, norm_type, self._group, self.local_world_size, self.local_rank)
        coeff = float(max_norm) / (self._grad_norm + 1e-6)
        coeff = torch.clamp(coeff, max=1.0)
        for _, shard in pairs:
            shard.grad.detach().mul_(coeff.to(shard.grad.dtype))

    # -- state ------------------------------------------------------------------------------
    def state_dict(self):
        """The wrapper's ``param_groups`` plus ``base_state``: this rank's shard states, keyed
        as the inner optimizer keys them; ``shape_info`` gives each parameter's full shape."""
        sd = super().state_dict()
        sd["base_state"] = self.base_optimizer.state_dict()["state"]
        sd["shape_info"] = {i: tuple(p.shape) for i, (p, _) in enumerate(self._pairs(with_grad=False))}
        if self.save_master_weights:
            sd["sharded_master_weights"] = {i: s.detach() for i, (_, s) in enumerate(self._pairs(with_grad=False))}
        return sd

    def load_state_dict(self, state_dict):
        """Load what :meth:`state_dict` gave on the same DP rank of the same layout: the shards
        are re-cut from the parameters' current values (load the model first), then the inner
        optimizer's state is replaced. A state whose shards have other sizes (saved at another
        DP or TP degree) is an error naming both sizes."""
        state_dict = copy.copy(state_dict)
        base_state = state_dict.pop("base_state")
        masters = state_dict.pop("sharded_master_weights", None)
        state_dict.pop("shape_info", None)
        for key in ("dp_rank", "tp_rank"):
            state_dict.pop(key, None)
        super().load_state_dict(state_dict)
        self.init_zero()
        shards = [s for _, s in self._pairs(with_grad=False)]
        _check_shard_shapes(base_state, shards, self.local_world_size)
        inner = self.base_optimizer.state_dict()
        inner["state"] = base_state
        self.base_optimizer.load_state_dict(inner)
        if masters is not None:
            for i, shard in enumerate(shards):
                shard.data.copy_(masters[i].to(shard.device, shard.dtype))

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the shards' states and the shards)."""
        return optimizer_state_bytes(self.base_optimizer) + sum(
            s.numel() * s.element_size() for _, s in self._pairs(with_grad=False))

    # -- the deprecated per-rank files --------------------------------------------------------
    def save_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Deprecated in NxD (use ``save_checkpoint``): writes ``optim.dp_rank_XX.tp_rank_XX``
        under ``output_dir``, one file per rank, atomically."""
        state = _state()
        sd = self.state_dict()
        sd["dp_rank"], sd["tp_rank"] = state.get_data_parallel_rank(), state.get_tensor_model_parallel_rank()
        save_file(to_cpu(sd), _legacy_path(output_dir))
        dist.barrier()

    def load_sharded_state_dict(self, output_dir: str, num_workers_per_step: int = 8) -> None:
        """Deprecated in NxD (use ``load_checkpoint``): reads this rank's
        ``optim.dp_rank_XX.tp_rank_XX`` (``weights_only``: no code from the file runs)."""
        self.load_state_dict(load_file(_legacy_path(output_dir)))
        dist.barrier()


def _legacy_path(output_dir):
    state = _state()
    return os.path.join(output_dir, "optim.dp_rank_{:02d}.tp_rank_{:02d}".format(
        state.get_data_parallel_rank(), state.get_tensor_model_parallel_rank()))


def _check_shard_shapes(base_state, shards, dp):
    for index, entry in base_state.items():
        if not isinstance(index, int) or index >= len(shards):
            raise Zero1Error(f"the optimizer state has an entry for parameter {index!r}; this optimizer has "
                             f"{len(shards)} parameters: it was saved for another model")
        want = tuple(shards[index].shape)
        for name, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != want:
                raise Zero1Error(
                    f"ZeRO-1 state {name!r} of parameter {index} has shape {tuple(value.shape)}; this rank's "
                    f"shard is {want} (data-parallel degree {dp}): the state was saved at another data- or "
                    "tensor-parallel degree. Resume with the degrees it was saved with.")


def _pad_dim0(tensor, world):
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    rem = tensor.shape[0] % world
    if rem:
        pad = torch.zeros((world - rem,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        tensor = torch.cat([tensor, pad])
    return tensor


def _dim0(param):
    return param.shape[0] if param.dim() else 1


def _sync_param_groups(src, dst):
    if len(src) != len(dst):
        raise Zero1Error("Mismatch between number of source and destination parameter groups")
    for s, d in zip(src, dst):
        for key, value in s.items():
            if key != "params":
                d[key] = value


def sharded_grad_norm(pairs, norm_type, dp_group, dp_size, dp_rank=0):
    """NxD's ``get_grad_norm(zero1_optimizer=True)`` on the shards' gradients: ``pairs`` are
    (full parameter, shard: DP rank ``dp_rank``'s dim-0 chunk). TP-sharded parameters count
    on every TP rank, their rows tagged ``row_replicas`` (GQA's replicated key/value heads)
    once over their copies (:func:`kiln.distributed.grads.row_scale`); the others are
    replicated over TP, so their sum is divided by TP before the TP all-reduce (NxD's
    ``force_spmd``); parameters marked ``shared`` are left out. Then PP, then DP (each DP
    rank holds a different shard). 2-norms and inf-norms."""
    from kiln.distributed.grads import pow_sum, row_scale
    state = _state()
    norm_type = float(norm_type)
    device = pairs[0][1].grad.device if pairs else torch.device("cpu")
    tp_part = torch.zeros((), dtype=torch.float32, device=device)
    rep_part = torch.zeros((), dtype=torch.float32, device=device)
    for param, shard in pairs:
        if getattr(param, "shared", False):
            continue
        g = shard.grad.detach().float()
        if math.isinf(norm_type):
            val = g.abs().max()
        else:
            rows = g.shape[0] if g.dim() else 1
            scale = row_scale(param, rows, dp_rank * rows) if param.dim() else None
            val = pow_sum(g, norm_type, scale)
        if getattr(param, "tensor_model_parallel", False):
            tp_part = torch.maximum(tp_part, val) if math.isinf(norm_type) else tp_part + val
        else:
            rep_part = torch.maximum(rep_part, val) if math.isinf(norm_type) else rep_part + val
    tp = state.get_tensor_model_parallel_size()
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    total = torch.maximum(tp_part, rep_part) if math.isinf(norm_type) else tp_part + rep_part / tp
    for group, size in ((state.get_tensor_model_parallel_group(), tp),
                        (state.get_pipeline_model_parallel_group(), state.get_pipeline_model_parallel_size()),
                        (dp_group, dp_size)):
        if size > 1:
            dist.all_reduce(total, op=op, group=group)
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of tensors in ``optimizer.state`` (what a rank holds besides the model)."""
    inner = getattr(optimizer, "base_optimizer", None) or getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        if hasattr(optimizer, "state_bytes"):
            return optimizer.state_bytes()
        return optimizer_state_bytes(inner)
    return sum(v.numel() * v.element_size() for st in optimizer.state.values()
               for v in st.values() if torch.is_tensor(v))


@torch.no_grad()
def clip_grad_norm(parameters, max_norm, norm_type=2):
    """NxD's ``clip_grad_norm`` for replicated (non-ZeRO) optimizers: the total norm of the
    gradients over TP and PP (as :func:`sharded_grad_norm`, DP left out: after the DP
    all-reduce every DP rank has the same gradients), clipped in place when
    ``max_norm/(norm+1e-6)`` is below 1. Returns the pre-clip norm."""
    params = [p for p in parameters if p.grad is not None]
    pairs = [(p, _GradView(p.grad)) for p in params]
    norm = sharded_grad_norm(pairs, norm_type, None, 1)
    coeff = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coeff.to(p.grad.dtype))
    return norm


class _GradView:
    def __init__(self, grad):
        self.grad = grad
