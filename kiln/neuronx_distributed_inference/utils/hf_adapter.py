"""``neuronx_distributed_inference.utils.hf_adapter``."""
from kiln.compat.nxdi.api import HuggingFaceGenerationAdapter, load_pretrained_config

__all__ = ["HuggingFaceGenerationAdapter", "load_pretrained_config"]
