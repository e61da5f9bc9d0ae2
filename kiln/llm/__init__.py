"""kiln's LLM path (issue 17, being built): decoders compiled into prefill and decode
graphs with the KV cache as explicit tensors (:mod:`kiln.llm.decoder`); the cache and the
generation loop are runtime (:mod:`kiln.runtime.kv`)."""
