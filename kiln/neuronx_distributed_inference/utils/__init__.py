"""NxD Inference: ``utils``."""
