"""``neuronx_distributed.pipeline.partition``: NxD's even layer split and stage placement."""
from __future__ import annotations

from kiln.distributed.pipeline_cut import auto_cuts


def create_partitions(pipeline_parallel_size: int, model_layer_names: list) -> list:
    """NxD's auto_partition cuts: the last layer name of each of the first ``pp - 1`` groups,
    the remainder of an uneven split going to the later stages."""
    return auto_cuts(pipeline_parallel_size, list(model_layer_names))


def stage_to_pipeline_parallel_rank(stage: int, pp_size: int | None = None) -> int:
    """Stage ``s`` runs on pipeline rank ``s % pp``."""
    if pp_size is None:
        from kiln.distributed import state
        pp_size = state.get_pipeline_model_parallel_size()
    return stage % pp_size
