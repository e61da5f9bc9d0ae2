"""NxD Inference: ``models.llama``."""
