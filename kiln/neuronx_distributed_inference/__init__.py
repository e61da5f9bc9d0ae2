"""``kiln.neuronx_distributed_inference``: NxD Inference's module paths over
:mod:`kiln.compat.nxdi` (``models.config``, ``models.llama.modeling_llama``, ``utils.hf_adapter``)."""
