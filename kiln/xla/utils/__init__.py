"""torch_xla.utils on kiln: see :mod:`kiln.xla`."""
