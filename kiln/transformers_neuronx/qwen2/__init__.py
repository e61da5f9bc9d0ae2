"""``transformers_neuronx.qwen2``."""
