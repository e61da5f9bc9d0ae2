"""``transformers_neuronx.mistral``."""
