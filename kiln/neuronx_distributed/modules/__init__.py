"""``neuronx_distributed.modules`` (empty, as NxD's)."""
