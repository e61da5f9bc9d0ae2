"""The compile side: model or graph in, ``.kiln`` artifact (loaded) out.

``api`` (kiln.trace / kiln.analyze) → ``driver`` (one graph, through the hook) →
``phases`` (capture → plan → build → package) → ``selection`` (engine per partition).
Around them: ``buckets``/``stages`` (shape and pipeline planning), ``padcheck``
(padding and batching proofs), ``cache``/``caching`` (the persistent compile cache
and its hook), ``collect`` (parallel-compile), ``options`` (Neuron-style flags).
"""
from kiln.compiler.api import analyze, trace
from kiln.compiler.reuse import reuse_captures

__all__ = ["analyze", "reuse_captures", "trace"]
