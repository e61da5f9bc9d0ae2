"""NxD Inference: ``models``."""
