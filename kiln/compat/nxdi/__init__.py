"""NxD Inference's spelling of LLM compilation (``neuronx_distributed_inference``), for
scripts that swap that package for ``kiln.neuronx_distributed_inference``::

    nc = NeuronConfig(batch_size=2, max_context_length=32, seq_len=64,
                      on_device_sampling_config=OnDeviceSamplingConfig(top_k=1))
    cfg = LlamaInferenceConfig(nc, load_config=load_pretrained_config(path))
    m = NeuronLlamaForCausalLM(path, cfg); m.compile(out_dir); m.load(out_dir)
    HuggingFaceGenerationAdapter(m).generate(ids, attention_mask=am, generation_config=gc)

The classes live here (:mod:`kiln.compat.nxdi.api`); ``kiln.neuronx_distributed_inference``
re-exports them under NxD Inference's module paths. ``compile`` writes one ``model.kiln``
(:func:`kiln.llm.build.compile_llm`) into the directory, with the configs it was made from
(``NeuronLlamaForCausalLM(dir)`` reads them back); ``load`` reads it back. What kiln
cannot honour yet is an error that says so: ``quantized=True``, non-fp32 ``torch_dtype``,
Neuron kernel options set to anything but their defaults.
``tp_degree=N`` shards the model over N ranks (docs/distributed.md).
"""
