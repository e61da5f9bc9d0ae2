"""Hugging Face models in one line, in Optimum's own spellings: ``kiln.optimum.neuron`` takes
Optimum Neuron's classes (``NeuronModelForSequenceClassification.from_pretrained(path,
export=True, batch_size=1, sequence_length=128)``), its ``save_pretrained`` directory and its
``pipeline``, on kiln's compiler and runtime."""
