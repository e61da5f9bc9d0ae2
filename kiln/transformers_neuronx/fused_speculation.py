"""transformers-neuronx: ``fused_speculation``."""
from kiln.compat.fused_speculation import FusedSpeculativeDecoder

__all__ = ["FusedSpeculativeDecoder"]
