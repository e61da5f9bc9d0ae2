"""``neuronx_distributed.trace``: NxD's tensor-parallel tracing at its module path
(implemented in :mod:`kiln.compat.nxd_trace`)."""
from kiln.compat.nxd_trace import (TensorParallelNeuronModel, parallel_model_load, parallel_model_save,
                                   parallel_model_trace)

__all__ = ["TensorParallelNeuronModel", "parallel_model_trace", "parallel_model_save", "parallel_model_load"]
