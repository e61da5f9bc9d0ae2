"""NxD's gradient clipping for tensor-/pipeline-parallel parameters.

The norm is one norm over the whole (unsharded) model: each rank sums ``|g|^p`` of its
TP shards; a replicated (non-TP) parameter's gradient is the same on every TP rank, so
with ``force_spmd`` every rank adds it and the replicated part is divided by the TP
degree (the same program on every rank, NxD's default), otherwise only TP rank 0 adds it.
The sum is all-reduced over TP, then PP, then (ZeRO-1) the sharding groups. Parameters
marked ``.shared`` (tied weights synced elsewhere) are left out. The clip coefficient is
``max_norm / (norm + 1e-6)``, applied when below 1; the pre-clip norm is returned (a
one-element tensor, as NxD's).

Rows that several TP ranks hold copies of inside a TP-sharded parameter (GQA's key/value
rows with ``kv_size_multiplier`` m: every rank of a kv-shared group holds the head and its
whole gradient) are tagged ``row_replicas`` and count once, 1/m on each holder, so the
norm is the one-process model's. NxD's own ``get_grad_norm`` counts them m times (a larger
norm, so clipping harder than the same model in one process); kiln does not.
"""
from __future__ import annotations

import math

import torch

from kiln.distributed import state


def param_is_not_shared(param) -> bool:
    return not getattr(param, "shared", False)


def row_scale(param, rows: int, first_row: int = 0):
    """1 / (copies over TP) of ``param``'s dim-0 rows ``[first_row, first_row + rows)``
    from its ``row_replicas`` tag (``((row count, copies), ...)`` along dim 0), rows past
    the parameter (ZeRO-1's padding) 1; None when the parameter has no replicated rows."""
    segments = getattr(param, "row_replicas", None)
    if not segments:
        return None
    counts = torch.cat([torch.full((int(n),), float(c)) for n, c in segments])
    if counts.numel() < first_row + rows:
        counts = torch.cat([counts, torch.ones(first_row + rows - counts.numel())])
    return 1.0 / counts[first_row:first_row + rows]


def pow_sum(g, p: float, scale=None):
    """``sum |g|^p`` (a 0-dim float32 tensor), each dim-0 row weighted by ``scale``."""
    g = g.detach().float()
    elems = g * g if p == 2.0 else g.abs() ** p
    if scale is None:
        return elems.sum()
    return (elems.reshape(scale.numel(), -1).sum(1) * scale.to(elems.device)).sum()


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _group_for_mesh(mesh_rows):
    """The process group of this rank's row of ``mesh_rows``: one of the parallel state's."""
    me = state.global_rank()
    row = next((sorted(r) for r in mesh_rows if me in r), None)
    if row is None:
        raise ValueError(f"zero1_optimizer_groups {mesh_rows} has no group holding rank {me}")
    for kind in ("dp", "tp", "pp", "cp", "ep", "edp", "world"):
        mine = next((sorted(r) for r in _mesh(kind) if me in r), None)
        if mine == row:
            return state.get_world_group() if kind == "world" else _getter(kind)
    raise ValueError(f"zero1_optimizer_groups row {row} is none of the parallel state's groups; pass the data-parallel "
                     "mesh (parallel_state.get_data_parallel_group(as_list=True)) or get_zero1_sharding_groups()")


def _mesh(kind):
    getters = {"dp": state.get_data_parallel_replica_groups, "tp": state.get_tensor_model_parallel_replica_groups,
               "pp": state.get_pipeline_model_parallel_replica_groups,
               "cp": state.get_context_model_parallel_replica_groups,
               "ep": state.get_expert_model_parallel_replica_groups,
               "edp": state.get_expert_data_parallel_replica_groups,
               "world": lambda: state.get_world_group(as_list=True)}
    return getters[kind]()


def _getter(kind):
    return {"dp": state.get_data_parallel_group, "tp": state.get_tensor_model_parallel_group,
            "pp": state.get_pipeline_model_parallel_group, "cp": state.get_context_model_parallel_group,
            "ep": state.get_expert_model_parallel_group, "edp": state.get_expert_data_parallel_group}[kind]()


def _reduce(total, op, zero1, zero1_groups):
    import torch.distributed as dist
    red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    if zero1 and zero1_groups is None:      # NxD: the norm over the whole world
        if len(state.get_world_group(as_list=True)[0]) > 1:
            dist.all_reduce(total, op=red, group=state.get_world_group())
        return total
    if state.get_tensor_model_parallel_size() > 1:
        dist.all_reduce(total, op=red, group=state.get_tensor_model_parallel_group())
    if state.get_pipeline_model_parallel_size() > 1:
        dist.all_reduce(total, op=red, group=state.get_pipeline_model_parallel_group())
    if zero1_groups is not None and max(len(r) for r in zero1_groups) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_group_for_mesh(zero1_groups))
    return total


def get_grad_norm(parameters, norm_type=2, zero1_optimizer=False, zero1_optimizer_groups=None, force_spmd=True):
    """The total gradient norm of ``parameters`` across TP and PP ranks (see module doc)."""
    state.ensure_initialized()
    p = float(norm_type)
    if math.isinf(p):
        force_spmd = True       # MAX needs no de-duplication
    if not zero1_optimizer and zero1_optimizer_groups is not None:
        raise ValueError("Getting zero1_optimizer_groups while zero1_optimizer is False. When using zero-1 "
                         "optimizer grad clipping is handled by optimizer.")
    params = _as_list(parameters)
    if not params:
        raise ValueError("clip_grad_norm needs a non-empty list of parameters")
    tp_rank = state.get_tensor_model_parallel_rank()
    sharded, replicated = [], []
    for param in params:
        if param.grad is None or not param_is_not_shared(param):
            continue
        if getattr(param, "tensor_model_parallel", False) or (tp_rank == 0 and not force_spmd):
            sharded.append((param.grad.detach(), row_scale(param, param.shape[0]) if param.dim() else None))
        elif force_spmd:
            replicated.append(param.grad.detach())
    dtype, device = params[0].dtype, params[0].device
    if math.isinf(p):
        peak = [g.abs().max().float() for g in [g for g, _ in sharded] + replicated]
        total = torch.stack(peak).max().reshape(1).to(dtype) if peak else torch.zeros(1, dtype=dtype)
        return _reduce(total.to(device), "max", zero1_optimizer, zero1_optimizer_groups)
    total = torch.zeros(1, dtype=dtype, device=device)
    for g in replicated:
        total = total + torch.norm(g, p) ** p
    total = total / state.get_tensor_model_parallel_size()
    for g, scale in sharded:
        total = total + (torch.norm(g, p) ** p if scale is None else pow_sum(g, p, scale).to(dtype))
    total = _reduce(total, "sum", zero1_optimizer, zero1_optimizer_groups)
    return torch.pow(total, 1.0 / p)


def clip_grads_with_norm(parameters, total_norm, max_norm):
    """Scale every gradient by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    params = _as_list(parameters)
    if not params:
        raise ValueError("Parameters should be a non-empty list for gradient clipping")
    coeff = max_norm / (total_norm + 1.0e-6)
    scale = torch.where(coeff < 1, coeff, torch.ones_like(coeff))
    for param in params:
        if param.grad is not None:
            param.grad.detach().mul_(scale.to(param.grad.dtype))
    return total_norm


def clip_grad_norm(parameters, max_norm, norm_type=2, zero1_optimizer=False, zero1_optimizer_groups=None,
                   force_spmd=True):
    """NxD's ``clip_grad_norm``: clip in place, return the pre-clip total norm."""
    params = _as_list(parameters)
    total = get_grad_norm(params, norm_type, zero1_optimizer, zero1_optimizer_groups, force_spmd)
    clip_grads_with_norm(params, total, max_norm)
    return total
