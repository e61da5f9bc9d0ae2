"""NxD's first checkpoint API, ``parallel_layers.save`` / ``parallel_layers.load`` (the
docs mark them "to be deprecated, use trainer.save_checkpoint"), still what
``parallel_model_trace`` examples use to load an unsharded checkpoint into each rank.

Layout: ``<dir>/tp_rank_TT_pp_rank_PP/checkpoint.pt`` (``..._dp_rank_DD`` when
``master_dp_only=False``), written by DP rank 0 (or every DP rank), atomically.
``load(path, model, sharded=False)`` reads one unsharded file (``{"model": state_dict}``
by default) and cuts this rank's shard of each tensor-parallel parameter with the same
function that cut the parameters at initialization
(:func:`kiln.distributed.shard.shard_state_dict`), after each layer's ``preshard_hook``.

Files are read with ``torch.load(weights_only=True)`` whatever ``weights_only`` says: no
checkpoint runs code when loaded (NxD defaults to ``weights_only=False``; a file that
needs it is a clear error naming the class). ``save_xser``/``load_xser`` (torch_xla's
one-file-per-tensor format) are accepted and write/read the plain layout; a real
torch_xla xser checkpoint is a clear error.
"""
from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from kiln.distributed.ckpt_files import CheckpointError, agree, load_file, save_file, to_cpu

_RANK_DIR = re.compile(r"^tp_rank_(\d+)_pp_rank_(\d+)(?:_dp_rank_\d+)?$")


def _state():
    from kiln.distributed import state
    state.ensure_initialized()
    return state


def ensure_directory_exists(filename: str) -> None:
    """Create ``filename``'s directory if it does not exist."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def _rank_dir(output_dir: str, master_dp_only: bool) -> str:
    state = _state()
    name = "tp_rank_{:02d}_pp_rank_{:02d}".format(state.get_tensor_model_parallel_rank(),
                                                   state.get_pipeline_model_parallel_rank())
    if not master_dp_only:
        name += "_dp_rank_{:02d}".format(state.get_data_parallel_rank())
    return os.path.join(output_dir, name)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _cast(obj, src, dst):
    if torch.is_tensor(obj):
        return obj.to(dst) if obj.dtype == src else obj
    if isinstance(obj, dict):
        return {k: _cast(v, src, dst) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, src, dst) for v in obj)
    return obj


def save(checkpoint: dict, output_dir: str, save_serially: bool = True, save_xser: bool = False,
         down_cast_bf16: bool = False, master_dp_only: bool = True) -> None:
    """Write this rank's ``checkpoint`` (e.g. ``{"model": model.state_dict()}``) to
    ``<output_dir>/tp_rank_TT_pp_rank_PP/checkpoint.pt``; every rank calls it. Only DP rank 0
    writes unless ``master_dp_only=False``. ``save_serially`` (one TP rank at a time, to
    bound host memory) is honoured with a barrier per TP rank."""
    state = _state()
    path = os.path.join(_rank_dir(output_dir, master_dp_only), "checkpoint.pt")
    if down_cast_bf16:
        checkpoint = _cast(checkpoint, torch.float32, torch.bfloat16)
    writes = master_dp_only is False or state.get_data_parallel_rank() == 0
    if save_serially and dist.is_initialized():
        for tp_rank in range(state.get_tensor_model_parallel_size()):
            if writes and tp_rank == state.get_tensor_model_parallel_rank():
                save_file(to_cpu(checkpoint), path)
            dist.barrier()
    elif writes:
        save_file(to_cpu(checkpoint), path)
    _barrier()


def check_degrees(chkpt_path: str) -> None:
    """A :class:`CheckpointError` when the rank directories under ``chkpt_path`` were written
    at another TP or PP degree than this run's."""
    state = _state()
    if not os.path.isdir(chkpt_path):
        return
    ranks = [tuple(int(x) for x in m.groups()) for m in map(_RANK_DIR.match, os.listdir(chkpt_path)) if m]
    if not ranks:
        return
    saved = (1 + max(r[0] for r in ranks), 1 + max(r[1] for r in ranks))
    now = (state.get_tensor_model_parallel_size(), state.get_pipeline_model_parallel_size())
    if saved != now:
        raise CheckpointError(
            f"checkpoint {chkpt_path} was saved at TP={saved[0]}, PP={saved[1]} and this run has TP={now[0]}, "
            f"PP={now[1]}: kiln does not reshard sharded checkpoints; resume at the saved degrees, or load an "
            "unsharded checkpoint with load(path, model, sharded=False)")


def _checkpoint_file(chkpt_path, sharded, master_dp_only):
    if not sharded:
        return chkpt_path
    check_degrees(chkpt_path)
    base = _rank_dir(chkpt_path, master_dp_only)
    if os.path.isfile(base):
        raise CheckpointError(f"{base} is a torch_xla serialization (xser) reference file: kiln reads the plain "
                              "layout (<dir>/tp_rank_XX_pp_rank_XX/checkpoint.pt); re-save the checkpoint "
                              "without save_xser on a torch_xla host")
    return os.path.join(base, "checkpoint.pt")


def load(chkpt_path: str, model=None, model_or_optimizer=None, model_key="model", load_xser: bool = False,
         sharded: bool = True, strict: bool = True, master_dp_only: bool = True, weights_only: bool = False):
    """Read this rank's checkpoint (``sharded``), or the one unsharded file ``chkpt_path``
    (``sharded=False``, which needs the model: its tensor-parallel parameters are cut from
    the full tensors), load ``ckpt[model_key]`` (the whole file when ``model_key`` is None)
    into ``model_or_optimizer`` (``model`` is NxD's deprecated alias), and return what
    remains of the checkpoint (None when ``model_key`` is None and something was loaded)."""
    if model is not None:
        model_or_optimizer = model
    if not sharded and model_or_optimizer is None:
        raise CheckpointError("load(..., sharded=False) needs the model (model_or_optimizer=...): an unsharded "
                              "checkpoint is cut into this rank's shard according to the model's layers")
    state = _state()
    path = _checkpoint_file(chkpt_path, sharded, master_dp_only)
    checkpoint, failed = None, None
    together = dist.is_initialized() and state.get_tensor_model_parallel_size() > 1
    for tp_rank in range(state.get_tensor_model_parallel_size()):   # one TP rank at a time, as NxD
        if tp_rank == state.get_tensor_model_parallel_rank():
            try:
                checkpoint = load_file(path, "checkpoint")
                if model_or_optimizer is not None:
                    checkpoint = _load_into(model_or_optimizer, checkpoint, model_key, sharded, strict)
            except Exception as e:              # every rank must hear of it, not wait for this one
                if not together:
                    raise
                failed = e
        if together:
            agree(failed)
    return checkpoint


def _load_into(target, checkpoint, model_key, sharded, strict):
    if model_key is not None and model_key not in checkpoint:
        raise CheckpointError(f"the checkpoint has no {model_key!r} entry (it has {sorted(checkpoint)[:8]}): "
                              "pass model_key=None to load the whole file as the state dict")
    state_dict = checkpoint[model_key] if model_key is not None else checkpoint
    if not sharded:
        from kiln.distributed.shard import shard_state_dict
        state = _state()
        module = getattr(target, "original_torch_module", target)
        state_dict = shard_state_dict(module, state_dict, state.get_tensor_model_parallel_rank(),
                                      state.get_tensor_model_parallel_size())
    if isinstance(target, torch.optim.Optimizer):
        target.load_state_dict(state_dict)
    else:
        target.load_state_dict(state_dict, strict=strict)
    if model_key is None:
        return None
    rest = dict(checkpoint)
    del rest[model_key]
    return rest


def get_sharded_model_dict(model, model_state_dict: dict) -> dict:
    """NxD's name for cutting an unsharded state dict into this rank's shards."""
    from kiln.distributed.shard import shard_state_dict
    state = _state()
    module = getattr(model, "original_torch_module", model)
    return shard_state_dict(module, model_state_dict, state.get_tensor_model_parallel_rank(),
                            state.get_tensor_model_parallel_size())
