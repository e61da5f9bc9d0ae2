"""``neuronx_distributed.parallel_layers.checkpointing``: NxD's legacy ``save``/``load``
(:mod:`kiln.distributed.legacy_checkpoint`)."""
from kiln.distributed.legacy_checkpoint import (  # noqa: F401
    ensure_directory_exists, get_sharded_model_dict, load, save,
)
