"""``transformers_neuronx.gpt2``."""
