"""``neuronx_distributed.pipeline.model``: where NxD defines ``NxDPPModel``."""
from kiln.distributed.pipeline import NxDPPModel  # noqa: F401
