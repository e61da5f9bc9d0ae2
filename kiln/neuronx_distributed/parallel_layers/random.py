"""``neuronx_distributed.parallel_layers.random``."""
from kiln.distributed.rng import (  # noqa: F401
    MODEL_PARALLEL_RNG_TRACKER_NAME, XLARNGStatesTracker, get_xla_rng_tracker, model_parallel_xla_manual_seed,
)
