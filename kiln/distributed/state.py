"""NeuronX Distributed's ``parallel_state``: which ranks form the tensor-, pipeline-,
data-, context- and expert-parallel groups, and the getters every parallel layer asks.

The layout is NxD's, so a script's rank arithmetic (samplers, checkpoint names) means the
same thing here: the world's ranks are ``arange(world).reshape(PP, DP, CP, TP)`` with TP
contiguous (TP groups ``[i*tp, (i+1)*tp)``, DP groups of stride TP (TP*CP with context
parallelism), PP groups of stride world/PP), and expert regions view the same ranks as
``reshape(PP, DP_exp, EP, TP)``. NxD's trn1 special case (TP=4 interleaved per node) is
a hardware wiring detail with no meaning on CPUs and is not reproduced.

Every group is created on every rank (``torch.distributed.new_group`` must be entered by
all ranks, as NxD's CPU mode does), with the world's backend: gloo, NCCL, or kiln's
``"xla"`` group for device tensors. The groups are also bound under kiln's symbolic names
(``"tp"``, ``"dp"``, ``"pp"``, ``"world"``, plus ``"cp"``, ``"ep"``, ``"edp"``) in
:mod:`kiln.distributed.groups`, which is how the ``kiln::`` collectives in graphs find
them. Sizes and ranks are computed from the mesh (as NxD's groups would report them), so
the one-rank fallback below needs no default process group.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import timedelta

from kiln.distributed import groups, mesh
from kiln.errors import KilnError

_KINDS = ("tp", "dp", "pp", "cp", "ep", "edp")


class ParallelStateError(KilnError, AssertionError):
    """A parallel-state getter was called before ``initialize_model_parallel``, or the
    state was initialized twice. An ``AssertionError`` as in NxD (code such as ``rmsg``
    catches that)."""


ParallelSizeError = mesh.ParallelSizeError

_WHAT_TO_DO = ("call torch.distributed.init_process_group(...) and then "
               "kiln.neuronx_distributed.parallel_layers.parallel_state.initialize_model_parallel("
               "tensor_model_parallel_size=...) before building parallel layers or asking for groups "
               "(for parallel_model_trace, build the model inside the function you pass it)")

_NOT_INIT = {
    "tp": "intra_layer_model parallel group is not initialized",
    "world": "intra_layer_model parallel group is not initialized",
    "dp": "data parallel group is not initialized",
    "pp": "pipeline_model parallel group is not initialized",
    "cp": "context_model parallel group is not initialized",
    "ep": "expert model parallel group is not initialized",
    "edp": "expert data parallel group is not initialized",
    "kv": "kv_shared parallel group is not initialized",
    "next": "intra_layer_model parallel group is not initialized",
    "prev": "intra_layer_model parallel group is not initialized",
}


@dataclass
class _State:
    rank: int
    world: int
    sizes: dict
    meshes: dict
    groups: dict = field(default_factory=dict)
    fallback: bool = False
    pipeline_ranks: list = field(default_factory=list)
    kv_size: int | None = None
    by_layer: bool = False      # set up by a layer built first (NxD's fallback), not by the script


_state: _State | None = None
_override = {"tp_size": None, "tp_rank": None}
_aot = [False]


def _fail(kind: str):
    raise ParallelStateError(f"{_NOT_INIT[kind]}: {_WHAT_TO_DO}")


def _need(kind: str = "tp") -> _State:
    if _state is None:
        _fail(kind)
    return _state


# -- building groups -----------------------------------------------------------------------
def _build_groups(state: _State, mesh_only: bool) -> None:
    import torch.distributed as dist
    if mesh_only:
        return
    made: dict = {}

    def new(ranks):
        key = tuple(sorted(ranks))
        if key not in made:   # every rank walks the same sequence, so dedup is consistent
            made[key] = dist.new_group(list(key)) if len(key) < state.world else dist.group.WORLD
        return made[key]
    for kind in _KINDS:
        for ranks in state.meshes[kind]:
            pg = new(ranks)
            if state.rank in ranks:
                state.groups[kind] = pg
    state.groups["world"] = dist.group.WORLD
    if state.sizes["pp"] > 1:
        mine = next(r for r in state.meshes["pp"] if state.rank in r)
        nxt, prv = mine[(mine.index(state.rank) + 1) % len(mine)], mine[mine.index(state.rank) - 1]
        for pair in mesh.sr_pairs(state.meshes["pp"], state.sizes["pp"]):
            pg = new(pair)
            if state.rank in pair and nxt in pair:
                state.groups["next"] = pg
            if state.rank in pair and prv in pair:
                state.groups["prev"] = pg
    for kind in ("tp", "dp", "pp", "cp", "ep", "edp", "world"):
        groups.register(kind, groups.TorchGroup(state.groups[kind]))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                              skip_collective_init: bool = False, lnc_size: int = 1,
                              mesh_only: bool = False) -> None:
    """NxD's ``initialize_model_parallel``. ``skip_collective_init`` (NxD's warm-up
    all-reduce, which Neuron's runtime needs and gloo does not) and ``lnc_size`` (trn2's
    logical-core grouping, which picks among replica layouts only for TP 32/64 on trn2
    hardware) are accepted and change nothing here. ``mesh_only`` computes the meshes
    without creating process groups (group getters then raise; ``as_list=True`` works)."""
    global _state
    import torch.distributed as dist
    if not dist.is_initialized():
        raise ParallelStateError(
            "initialize_model_parallel needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' | 'nccl' | 'xla') first (under torchrun)")
    if _state is not None and _state.by_layer:
        raise ParallelStateError("the parallel state was set up already, at tensor parallel size 1, when a "
                                 "parallel layer was built before initialize_model_parallel (the warning "
                                 "'parallel state is not initialized'): call initialize_model_parallel before "
                                 "building the model, or destroy_model_parallel() first")
    if _state is not None:
        raise ParallelStateError("tensor model parallel group is already initialized: call "
                                 "destroy_model_parallel() before initializing it again")
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes, meshes = mesh.layout(world, tensor_model_parallel_size, pipeline_model_parallel_size,
                           context_parallel_size, expert_model_parallel_size)
    state = _State(rank=rank, world=world, sizes=sizes, meshes=meshes)
    state.pipeline_ranks = next(r for r in meshes["pp"] if rank in r)
    _build_groups(state, mesh_only)
    _state = state


def initialize_fallback_parallel_state() -> None:
    """What NxD's layers do when built before ``initialize_model_parallel``: warn, then set
    up a one-rank state. With ``torch.distributed`` initialized that is
    ``initialize_model_parallel()`` (TP=1, every rank data-parallel). Without it, kiln
    does not initialize the default process group behind the script's back (a later
    ``init_process_group`` would then fail); it makes a standalone one-rank gloo group
    (usable with ``dist.all_reduce(..., group=)``) and binds kiln's names to one-rank
    stand-ins, whose collectives are the identity, as a one-rank group's are."""
    global _state
    import torch.distributed as dist
    if _state is not None:
        return
    warnings.warn("parallel state is not initialized: building a one-rank state (tensor parallel "
                  "size 1). " + _WHAT_TO_DO[0].upper() + _WHAT_TO_DO[1:] + " to shard across ranks.",
                  UserWarning, stacklevel=3)
    if dist.is_initialized():
        initialize_model_parallel()
        _state.by_layer = True
        return
    sizes, meshes = mesh.layout(1)
    state = _State(rank=0, world=1, sizes=sizes, meshes=meshes, fallback=True, pipeline_ranks=[0], by_layer=True)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(minutes=30))
    for kind in (*_KINDS, "world"):
        state.groups[kind] = pg
        groups.register(kind, groups.SoloGroup(1))
    _state = state


def ensure_initialized() -> None:
    """Layers call this: a missing state becomes NxD's one-rank fallback (with a warning)."""
    if _state is None:
        initialize_fallback_parallel_state()


def model_parallel_is_initialized() -> bool:
    return _state is not None and "tp" in _state.groups and "dp" in _state.groups


def destroy_model_parallel() -> None:
    """Forget the groups (as NxD: the process groups themselves are not destroyed)."""
    global _state
    _state = None
    _override.update(tp_size=None, tp_rank=None)
    for kind in (*_KINDS, "world"):
        groups.unregister(kind)


# -- getters -------------------------------------------------------------------------------
def _group(kind: str, as_list: bool):
    state = _need(kind)
    if as_list:
        return state.meshes[kind]
    if kind not in state.groups:
        _fail(kind)
    return state.groups[kind]


def _mine(kind: str) -> list:
    state = _need(kind)
    return next(r for r in state.meshes[kind] if state.rank in r)


def _size(kind: str) -> int:
    return len(_mine(kind))


def _rank(kind: str) -> int:
    return _mine(kind).index(_need(kind).rank)


def get_world_group(as_list: bool = False):
    return _group("world", as_list)


def get_tensor_model_parallel_group(as_list: bool = False):
    return _group("tp", as_list)


def get_tensor_model_parallel_replica_groups() -> list:
    return _group("tp", True)


def get_tensor_model_parallel_size() -> int:
    return _override["tp_size"] if _override["tp_size"] is not None else _size("tp")


def get_tensor_model_parallel_rank() -> int:
    return _override["tp_rank"] if _override["tp_rank"] is not None else _rank("tp")


def set_tensor_model_parallel_size(world_size: int) -> None:
    _override["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank: int) -> None:
    _override["tp_rank"] = rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of TP rank 0 in this rank's TP group."""
    return _mine("tp")[0]


def get_data_parallel_group(as_list: bool = False):
    return _group("dp", as_list)


def get_data_parallel_replica_groups() -> list:
    return _group("dp", True)


def get_data_parallel_size() -> int:
    return _size("dp")


def get_data_parallel_rank() -> int:
    return _rank("dp")


def get_data_parallel_src_rank() -> int:
    """NxD's formula: global rank modulo the number of DP groups."""
    return _need("dp").rank % len(_need("dp").meshes["dp"])


def get_pipeline_model_parallel_group(as_list: bool = False):
    return _group("pp", as_list)


def get_pipeline_model_parallel_replica_groups() -> list:
    return _group("pp", True)


def get_pipeline_model_parallel_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank("pp")


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _need("pp").pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _need("pp").pipeline_ranks
    return ranks[(get_pipeline_model_parallel_rank() - 1) % len(ranks)]


def get_pipeline_model_parallel_sr_group(parity: bool | None = None) -> list:
    """Send/recv pairs ``[rank, next]`` of every pipeline group (all of them, as NxD's CPU
    mode; with ``parity`` only the pairs starting at even/odd stage indices)."""
    state = _need("pp")
    pp = state.sizes["pp"]
    start, step = (0, 1) if parity is None else (int(parity), 2)
    return [[r[i], r[(i + 1) % pp]] for r in state.meshes["pp"] for i in range(start, pp, step)]


def get_next_rank_group(as_list: bool = False):
    return get_pipeline_model_parallel_sr_group() if as_list else _group("next", False)


def get_prev_rank_group(as_list: bool = False):
    return get_pipeline_model_parallel_sr_group() if as_list else _group("prev", False)


def get_context_model_parallel_group(as_list: bool = False):
    return _group("cp", as_list)


def get_context_model_parallel_replica_groups() -> list:
    return _group("cp", True)


def get_context_model_parallel_size() -> int:
    return _size("cp")


def get_context_model_parallel_rank() -> int:
    return _rank("cp")


def get_expert_model_parallel_group(as_list: bool = False):
    return _group("ep", as_list)


def get_expert_model_parallel_replica_groups() -> list:
    return _group("ep", True)


def get_expert_model_parallel_size() -> int:
    return _size("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank("ep")


def get_expert_data_parallel_group(as_list: bool = False):
    return _group("edp", as_list)


def get_expert_data_parallel_replica_groups() -> list:
    return _group("edp", True)


def get_expert_data_parallel_size() -> int:
    return _size("edp")


def get_expert_data_parallel_rank() -> int:
    return _rank("edp")


def get_zero1_sharding_groups() -> list:
    """The ranks ZeRO-1 shards optimizer state over: the data-parallel mesh (the DP and
    CP axes together when context parallelism is on, since CP ranks also hold replicas)."""
    return _need("dp").meshes["zero1"]


# doc-only names (tp_developer_guide uses them; NxD never defined them)
def get_data_parallel_world_size() -> int:
    return get_data_parallel_size()


def get_tensor_parallel_size() -> int:
    return get_tensor_model_parallel_size()


# -- misc ----------------------------------------------------------------------------------
def global_rank() -> int:
    import torch.distributed as dist
    if _state is not None:
        return _state.rank
    return dist.get_rank() if dist.is_initialized() else 0


def is_global_rank_zero() -> bool:
    return global_rank() == 0


def create_pg_with_ranks(ranks: list):
    """A group over the given pipeline-stage indices of this rank's pipeline group (shared
    weights across stages, e.g. tied embeddings). Every rank enters the creation of every
    pipeline group's copy, as ``new_group`` requires; returns this rank's."""
    import torch.distributed as dist
    state = _need("pp")
    mine = None
    for pp_ranks in state.meshes["pp"]:
        shared = [pp_ranks[k] for k in ranks]
        pg = dist.new_group(shared) if not state.fallback else state.groups["pp"]
        if state.rank in pp_ranks:
            mine = pg
    return mine


def initialize_kv_group(kv_shared_group_size: int = 1, sequential_ranks_in_group: bool = False) -> None:
    """Groups of TP ranks that hold the same KV heads (GQA with fewer KV heads than ranks).
    Interleaved by default: with TP 4 and size 2, ``[[0, 2], [1, 3]]``, NxD's trn1 layout."""
    import torch.distributed as dist
    state = _need("tp")
    if state.kv_size is not None:
        if kv_shared_group_size != state.kv_size:
            raise ParallelStateError(
                f"the kv-shared group is already initialized with size {state.kv_size}; NxD supports one "
                f"KV size for all layers (asked for {kv_shared_group_size})")
        return
    tp = get_tensor_model_parallel_size()
    if tp % kv_shared_group_size != 0:
        raise ParallelStateError(f"kv_shared_group_size: {kv_shared_group_size}, should divide tensor model "
                                 f"parallel group {tp}")
    state.kv_size = kv_shared_group_size
    state.meshes["kv"] = mesh.kv_mesh(state.meshes["tp"], tp, kv_shared_group_size, sequential_ranks_in_group)
    for ranks in state.meshes["kv"]:
        pg = state.groups["tp"] if state.fallback else dist.new_group(ranks)
        if state.rank in ranks:
            state.groups["kv"] = pg


def get_kv_shared_group(as_list: bool = False):
    return _group("kv", as_list) if (_state is None or "kv" in _state.meshes) else _fail("kv")


def get_kv_shared_group_size() -> int:
    state = _need("kv")
    if state.kv_size is None:
        _fail("kv")
    return state.kv_size


def set_aot_mode(mode: bool) -> None:
    _aot[0] = bool(mode)


def get_aot_mode() -> bool:
    return _aot[0]


def rmsg(msg: str) -> str:
    """``msg`` prefixed with ``[rank_G_ppP_tpT_dpD]`` (-1 for ranks not initialized)."""
    try:
        pp, tp, dp = get_pipeline_model_parallel_rank(), get_tensor_model_parallel_rank(), get_data_parallel_rank()
    except AssertionError:
        pp, tp, dp = -1, -1, -1
    return f"[rank_{global_rank()}_pp{pp}_tp{tp}_dp{dp}] {msg}"


def group_name(process_group=None) -> str:
    """kiln's symbolic collective name for an NxD ``process_group`` argument: ``"tp"`` for
    None or the TP group, the name of any other group of this state, or a name made from
    the group's ranks (bound on first use) for a group the script made itself."""
    if process_group is None:
        return "tp"
    if _state is not None:
        for kind in ("tp", "dp", "pp", "cp", "ep", "edp", "world", "kv"):
            if _state.groups.get(kind) is process_group:
                if kind == "kv" and not groups.is_bound("kv"):
                    groups.register("kv", groups.TorchGroup(process_group))
                return kind
    import torch.distributed as dist
    ranks = dist.get_process_group_ranks(process_group)
    name = "ranks:" + ",".join(map(str, ranks))
    if not groups.is_bound(name):
        groups.register(name, groups.TorchGroup(process_group))
    return name


def group_size(process_group=None) -> int:
    """The size of an NxD ``process_group`` argument (None: the TP group)."""
    if process_group is None:
        return get_tensor_model_parallel_size()
    return groups.get(group_name(process_group)).size


def group_rank(process_group=None) -> int:
    if process_group is None:
        return get_tensor_model_parallel_rank()
    return groups.get(group_name(process_group)).rank
