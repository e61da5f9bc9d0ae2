"""kiln's LLM path, compile side: a Hugging Face decoder (Llama family or GPT-2) compiled
into one ``.kiln`` artifact of fixed-shape graphs, prefill per context bucket, decode per
decode batch size, and optionally verify (speculative decoding), chunk (chunked prefill)
and smaller cache windows, each a :class:`kiln.llm.decoder.DecoderStep` with the KV cache
as explicit input tensors and the new keys and values as outputs, compiled through
:func:`kiln.trace`.

* :mod:`kiln.llm.decoder`: the model's own layers as one step function over the cache;
* :mod:`kiln.llm.build`: :func:`~kiln.llm.build.compile_llm`, which builds the graphs and
  returns a :class:`kiln.runtime.llm.LLM`;
* :mod:`kiln.llm.gate`: the accuracy gate an int8/int4 build must pass (perplexity and
  greedy agreement against float32, teacher-forced on a fixed text);
* :mod:`kiln.llm.parallel`: the graphs compiled side by side in worker processes;
* :mod:`kiln.llm.source`: a decoder and its tokenizer read from a local checkpoint
  directory or GGUF file (:mod:`kiln.llm.gguf_file` checks the file first);
* :mod:`kiln.llm.gguf_keep` / :mod:`kiln.llm.gguf_blocks`: ``quantize="gguf"``, the file's
  own blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept on ONNX Runtime's kernels.

The runtime side needs none of this package: :mod:`kiln.runtime.llm` (the loaded artifact,
``generate``), :mod:`kiln.runtime.kv` (the preallocated cache and its windows),
:mod:`kiln.runtime.scheduler` (continuous batching, chunked prefill, prefix reuse),
:mod:`kiln.runtime.speculative` and :mod:`kiln.runtime.sampling`. Usage: docs/llm.md."""
