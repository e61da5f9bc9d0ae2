"""``transformers_neuronx.module``."""
from kiln.compat.transformers_neuronx import save_pretrained_split

__all__ = ["save_pretrained_split"]
