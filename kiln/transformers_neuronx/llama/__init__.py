"""``transformers_neuronx.llama``."""
