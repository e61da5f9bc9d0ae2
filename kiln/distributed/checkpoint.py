"""NxD's training checkpoints (``neuronx_distributed.trainer.save_checkpoint`` /
``load_checkpoint``): one file per rank that owns something, in NxD's layout, so a
checkpoint written by kiln reads like NxD's and the other way round (plain files)::

    <dir>/<tag>/checkpoint                                 "1", written first
    <dir>/<tag>/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt  local state_dict, DP rank 0 writes
    <dir>/<tag>/optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt  every DP rank under ZeRO-1, else DP rank 0
    <dir>/<tag>/scheduler.pt, user_content.pt              global rank 0
    <dir>/<tag>/done                                       "1", written last

Why this shape: a rank writes only what it holds (its TP/PP shard; under ZeRO-1 its 1/DP
of the optimizer state), so nothing is gathered and no rank needs the whole model in
memory. Every file is written atomically (temp file, fsync, rename: :mod:`kiln.atomic`)
and ``done`` only after every rank has finished, so a tag without ``done`` is an
interrupted save and is never loaded as the newest.

Loading uses ``torch.load(weights_only=True)``: nothing in a checkpoint file can run
code. State dicts of models, optimizers and schedulers are tensors and plain values and
load that way; ``user_content`` must be made of the same (dicts, lists, numbers,
strings, tensors), or loading it is a clear error rather than an unpickling of
arbitrary objects.

Degrees are not resharded: a checkpoint saved at another TP or PP degree (or, under
ZeRO-1, another DP degree) is a :class:`CheckpointError` naming the saved and current
degrees, read from the per-rank file names. Nor is optimizer state converted between
ZeRO-1 and a plain optimizer: loading one kind's state into the other is a
:class:`CheckpointError` saying which was saved.
"""
from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist

from kiln.atomic import write_atomic
from kiln.distributed.ckpt_files import CheckpointError, agree, load_file, save_file, to_cpu

_RANK_FILE = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")


def _state():
    from kiln.distributed import state
    return state


# -- files ------------------------------------------------------------------------------------
def _write_text(path: str, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def rank_file(prefix: str, dp: bool = False) -> str:
    state = _state()
    return "{}/dp_rank_{:02d}_tp_rank_{:02d}_pp_rank_{:02d}.pt".format(
        prefix, state.get_data_parallel_rank() if dp else 0, state.get_tensor_model_parallel_rank(),
        state.get_pipeline_model_parallel_rank())


def _staggered(num_workers: int, write) -> None:
    """Ranks write ``num_workers`` at a time (NxD staggers per host to bound host memory;
    kiln counts global ranks, which bounds it at least as much); a barrier between rounds."""
    if not isinstance(num_workers, int) or num_workers < 1:
        raise CheckpointError(f"num_workers={num_workers!r}: pass how many ranks write at once (1-32)")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = None
    for round_ in range((world + num_workers - 1) // num_workers):
        if rank // num_workers == round_:
            try:
                write()
            except Exception as e:      # noqa: BLE001 - raised after the rounds: the others still meet it
                failed = e
        if world > num_workers:
            dist.barrier()
    if failed is not None:
        raise failed


# -- tags -------------------------------------------------------------------------------------
def completed_tags(checkpoint_dir: str) -> list:
    """Tags under ``checkpoint_dir`` with a ``done`` marker, oldest first (by the marker's
    modification time, name as the tie-break)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = []
    for tag in os.listdir(checkpoint_dir):
        done = os.path.join(checkpoint_dir, tag, "done")
        if os.path.isfile(done):
            found.append((os.path.getmtime(done), tag))
    return [tag for _, tag in sorted(found)]


def has_checkpoint(checkpoint_dir_str: str) -> bool:
    """Whether ``checkpoint_dir_str`` holds at least one completed checkpoint."""
    return bool(completed_tags(checkpoint_dir_str))


def finalize_checkpoint() -> None:
    """Wait for asynchronous saves. kiln saves synchronously (``async_save=True`` included),
    so there is never anything to wait for."""


def _remove_old(checkpoint_dir: str, num_kept) -> None:
    """Keep the newest ``num_kept`` completed tags: rank 0 deletes the others' ``done``
    markers first (an interrupted removal leaves an incomplete tag, never a damaged one that
    looks complete), then their directories."""
    if num_kept is None or num_kept == -1:
        return
    if not isinstance(num_kept, int) or num_kept < 1:
        raise CheckpointError(f"num_kept_ckpts={num_kept!r}: pass a positive number of checkpoints to keep, "
                              "or None to keep all")
    if dist.get_rank() == 0:
        old = completed_tags(checkpoint_dir)[:-num_kept]
        for tag in old:
            os.unlink(os.path.join(checkpoint_dir, tag, "done"))
        for tag in old:
            shutil.rmtree(os.path.join(checkpoint_dir, tag), ignore_errors=True)
    dist.barrier()


# -- what to save -----------------------------------------------------------------------------
def _model_state(model):
    if isinstance(model, dict):
        return model
    if hasattr(model, "local_state_dict"):        # a bare NxDPPModel: this stage's params, original names
        return model.local_state_dict()
    return model.state_dict()


def _is_zero1(optimizer, flag: bool) -> bool:
    if isinstance(optimizer, dict):
        return flag
    config = getattr(optimizer, "nxd_config", None)
    if config is not None:
        return bool(config["optimizer_config"]["zero_one_enabled"])
    from kiln.distributed.zero1 import NeuronZero1Optimizer
    return isinstance(optimizer, NeuronZero1Optimizer)


def _check_save_options(use_zero1_dcp, avoid_saving_lower_precision_weights):
    if use_zero1_dcp:
        raise CheckpointError("use_zero1_dcp=True (ZeRO-1 state in torch.distributed.checkpoint's format) is not "
                              "supported by kiln: leave it False (each DP rank writes its own optim/ file)")
    if avoid_saving_lower_precision_weights:
        raise CheckpointError("avoid_saving_lower_precision_weights=True (skip bf16 weights when the ZeRO-1 "
                              "master weights are saved) is not supported by kiln: leave it False")


def save_checkpoint(checkpoint_dir_str=None, tag=None, model=None, optimizer=None, scheduler=None,
                    user_content=None, num_workers=8, use_xser=False, num_kept_ckpts=None, async_save=False,
                    zero1_optimizer=False, use_zero1_dcp=False, avoid_saving_lower_precision_weights=False,
                    path=None):
    """Save ``model``, ``optimizer``, ``scheduler`` and ``user_content`` under
    ``<checkpoint_dir_str>/<tag>/`` in NxD's layout (module docstring); every rank calls it.

    ``tag`` is required, as in NxD's code (its docs show ``tag=""``). ``path=`` is accepted
    for ``checkpoint_dir_str`` (the docs' spelling). ``use_xser=True`` is accepted and writes
    the same plain per-rank files (torch_xla's serialization exists to stream XLA tensors
    to disk one at a time; NxD's loader reads plain files too). ``async_save=True`` is
    accepted and saves synchronously: the call returns once ``done`` is written.
    ``zero1_optimizer`` says whether an optimizer passed as a dict is ZeRO-1 state.
    ``num_kept_ckpts`` removes the oldest completed tags beyond that many.
    """
    checkpoint_dir = _resolve_dir(checkpoint_dir_str, path, "save_checkpoint")
    if tag is None or str(tag) == "":
        raise CheckpointError("save_checkpoint needs a tag (the checkpoint's directory name under "
                              f"{checkpoint_dir}), e.g. save_checkpoint(dir, tag=f'step_{{step}}', ...)")
    _check_save_options(use_zero1_dcp, avoid_saving_lower_precision_weights)
    if not dist.is_initialized():
        raise CheckpointError("save_checkpoint needs torch.distributed initialized (NxD supports only "
                              "distributed training mode): call torch.distributed.init_process_group first")
    state, rank = _state(), dist.get_rank()
    root = os.path.join(checkpoint_dir, str(tag))
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(os.path.join(root, "done")):   # overwriting a tag: incomplete until done again
            os.unlink(os.path.join(root, "done"))
        _write_text(os.path.join(root, "checkpoint"), "1")
    dist.barrier()
    writes = []
    if model is not None and state.get_data_parallel_rank() == 0:
        writes.append((_model_state(model), rank_file("model")))
    if optimizer is not None:
        zero1 = _is_zero1(optimizer, zero1_optimizer)
        sd = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
        if zero1 or state.get_data_parallel_rank() == 0:
            writes.append((sd, rank_file("optim", dp=zero1)))
    if rank == 0 and scheduler is not None:
        writes.append((scheduler.state_dict(), "scheduler.pt"))
    if rank == 0 and user_content is not None:
        writes.append((user_content, "user_content.pt"))
    def write():
        for obj, name in writes:
            save_file(to_cpu(obj), os.path.join(root, name))
    failed = None
    try:            # a rank whose write fails (a full disk) must not leave the others waiting
        _staggered(num_workers, write)
    except Exception as e:      # noqa: BLE001 - every rank raises it or one naming it (agree)
        failed = e
    agree(failed, "save")       # and no 'done' is written
    if rank == 0:
        _write_text(os.path.join(root, "done"), "1")
    dist.barrier()
    _remove_old(checkpoint_dir, num_kept_ckpts)


def _resolve_dir(checkpoint_dir_str, path, who):
    if checkpoint_dir_str is not None and path is not None and str(checkpoint_dir_str) != str(path):
        raise CheckpointError(f"{who} got both checkpoint_dir_str={checkpoint_dir_str!r} and path={path!r}: "
                              "pass one")
    directory = checkpoint_dir_str if checkpoint_dir_str is not None else path
    if directory is None:
        raise CheckpointError(f"{who} needs the checkpoint directory (first argument)")
    directory = str(directory)
    if "://" in directory:
        raise CheckpointError(f"{directory}: kiln checkpoints go to a local or mounted filesystem path; "
                              "s3:// and other URLs are not supported (mount the bucket, or copy afterwards)")
    return directory


# -- loading ----------------------------------------------------------------------------------
def saved_degrees(root: str) -> dict:
    """The TP, PP (and, from ``optim/``, DP) degrees a checkpoint was saved at, from its
    per-rank file names. ``optim/``'s DP is the save's only for ZeRO-1 state (every DP rank
    writes its shard); without ZeRO-1 DP rank 0 alone writes, so it reads 1 whatever the
    save's DP was (:func:`check_optimizer_kind` tells the two apart first)."""
    found = {}
    for sub in ("model", "optim"):
        names = os.listdir(os.path.join(root, sub)) if os.path.isdir(os.path.join(root, sub)) else []
        ranks = [tuple(int(x) for x in m.groups()) for m in map(_RANK_FILE.match, names) if m]
        if ranks:
            found[sub] = {"dp": 1 + max(r[0] for r in ranks), "tp": 1 + max(r[1] for r in ranks),
                          "pp": 1 + max(r[2] for r in ranks)}
    return found


def check_degrees(root: str, zero1: bool) -> None:
    """A :class:`CheckpointError` naming saved and current degrees when they differ."""
    state = _state()
    now = {"tp": state.get_tensor_model_parallel_size(), "pp": state.get_pipeline_model_parallel_size(),
           "dp": state.get_data_parallel_size()}
    for sub, saved in saved_degrees(root).items():
        keys = ("tp", "pp", "dp") if sub == "optim" and zero1 else ("tp", "pp")
        diff = [k for k in keys if saved[k] != now[k]]
        if diff:
            said = ", ".join(f"{k.upper()}={saved[k]}" for k in keys)
            cur = ", ".join(f"{k.upper()}={now[k]}" for k in keys)
            raise CheckpointError(
                f"checkpoint {root} holds files for {said} ({sub}/ holds one file per rank) and this run has "
                f"{cur}: it was saved at those degrees, or files are missing from it (a partial copy; until "
                "12-03 this said only the first). kiln does not reshard training checkpoints: resume with the "
                "degrees it was saved at, or copy the checkpoint again (or load the model weights unsharded "
                "with parallel_layers.load(..., sharded=False))")


def _is_zero1_state(sd) -> bool:
    """Whether an optimizer state dict is ZeRO-1's: NxD's (torch_xla's ZeroRedundancyOptimizer)
    and kiln's keep the shards' states under ``base_state``."""
    return isinstance(sd, dict) and "base_state" in sd


def check_optimizer_kind(root: str, saved_zero1: bool, zero1: bool) -> None:
    """A :class:`CheckpointError` when the checkpoint's optimizer state and this run's
    optimizer differ in ZeRO-1: nothing is converted (torch's ``load_state_dict`` would take
    a ZeRO-1 dict into a plain optimizer and keep no state at all)."""
    if saved_zero1 == zero1:
        return
    if saved_zero1:
        raise CheckpointError(
            f"checkpoint {root}: its optimizer state was saved with ZeRO-1 (zero_one_enabled=True: each DP "
            "rank's shard of the state) and this run's optimizer is not ZeRO-1; kiln does not convert "
            "between the two. Resume with optimizer_config={'zero_one_enabled': True, ...} as it was saved, "
            "or load only the model (load_checkpoint(..., model=model) without optimizer=) and start the "
            "optimizer afresh")
    raise CheckpointError(
        f"checkpoint {root}: its optimizer state was saved without ZeRO-1 (DP rank 0's whole state, one file "
        "per TP/PP rank) and this run's optimizer is ZeRO-1 (zero_one_enabled=True); kiln does not convert "
        "between the two. Resume with optimizer_config={'zero_one_enabled': False, ...} as it was saved, "
        "or load only the model (load_checkpoint(..., model=model) without optimizer=), then call "
        "optimizer.optimizer.init_zero() and start the optimizer state afresh")


def _load_into(obj, sd, strict=True):
    if isinstance(obj, torch.nn.Module):
        obj.load_state_dict(sd, strict=strict)
    elif isinstance(obj, dict):
        obj.update(sd)
    else:
        obj.load_state_dict(sd)


def load_checkpoint(path, tag=None, model=None, optimizer=None, scheduler=None, num_workers=8, strict=True,
                    use_zero1_dcp=False):
    """Load what :func:`save_checkpoint` wrote into ``model``/``optimizer``/``scheduler``
    (each rank its own files) and return ``user_content`` (None when none was saved).
    The optimizer must be of the kind that saved the state, ZeRO-1 or not
    (:func:`check_optimizer_kind`); the degrees must be the saved ones.

    ``tag=None`` loads the newest completed tag. Load the model before (or with) the
    optimizer: a ZeRO-1 optimizer re-cuts its shards from the loaded parameters. An
    optimizer passed as a dict is filled in place; whether it is ZeRO-1 state is read
    from the file (its ``base_state``).
    """
    checkpoint_dir = _resolve_dir(path, None, "load_checkpoint")
    if use_zero1_dcp:
        raise CheckpointError("use_zero1_dcp=True is not supported by kiln: leave it False")
    if not dist.is_initialized():
        raise CheckpointError("load_checkpoint needs torch.distributed initialized: call "
                              "torch.distributed.init_process_group first")
    failed = user_content = None
    try:            # each rank reads its own files: one that fails must not leave the others waiting
        user_content = _load_tag(checkpoint_dir, tag, model, optimizer, scheduler, strict)
    except Exception as e:      # noqa: BLE001 - every rank raises it or one naming it (agree)
        failed = e
    agree(failed)
    return user_content


def _load_tag(checkpoint_dir, tag, model, optimizer, scheduler, strict):
    """This rank's part of :func:`load_checkpoint`: ``user_content``."""
    if tag is None:
        tags = completed_tags(checkpoint_dir)
        if not tags:
            raise CheckpointError(f"no completed checkpoint under {checkpoint_dir} (a tag directory with a "
                                  "'done' file): nothing to resume from; check has_checkpoint() first")
        tag = tags[-1]
    root = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isfile(os.path.join(root, "done")):
        raise CheckpointError(f"checkpoint {root} is not complete (no 'done' file: the save was interrupted "
                              f"or the tag does not exist); completed tags: {completed_tags(checkpoint_dir)}")
    check_degrees(root, False)                  # TP and PP first: the files below are this rank's
    zero1, optim_sd = False, None
    if optimizer is not None:                   # DP rank 0's file of this TP/PP rank: saved by either kind
        optim_sd = load_file(os.path.join(root, rank_file("optim")), "optimizer checkpoint")
        saved_zero1 = _is_zero1_state(optim_sd)
        zero1 = saved_zero1 if isinstance(optimizer, dict) else _is_zero1(optimizer, False)
        check_optimizer_kind(root, saved_zero1, zero1)
        check_degrees(root, zero1)
        if rank_file("optim", dp=zero1) != rank_file("optim"):
            optim_sd = load_file(os.path.join(root, rank_file("optim", dp=zero1)), "optimizer checkpoint")
    if model is not None:
        _load_into(model, load_file(os.path.join(root, rank_file("model")), "model checkpoint"), strict)
    if optimizer is not None:
        _load_into(optimizer, optim_sd)
    if scheduler is not None:
        scheduler.load_state_dict(load_file(os.path.join(root, "scheduler.pt"), "scheduler checkpoint"))
    user_content = None
    if os.path.exists(os.path.join(root, "user_content.pt")):
        user_content = load_file(os.path.join(root, "user_content.pt"), "user_content")
    return user_content
