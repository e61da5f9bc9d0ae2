"""The settings shared by every model a server serves (``kiln serve --help`` explains them).

Kept apart from the app and the command line so that both (and a Python caller of
:func:`kiln.serving.app.build_app`) fill in one dataclass with one set of defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeConfig:
    """Settings shared by every served model (``kiln serve --help`` explains them)."""
    max_batch_size: int = 8            # rows per merged batch; 1 = batching off
    max_queue_delay_ms: float = 5.0    # how long the oldest request waits for others
    max_queue: int = 128               # queued requests per model before 503
    instances: int = 1                 # copies of each model, over kiln cores
    timeout_s: float = 30.0            # per request, queue + inference (a request may ask for less)
    threads: int | None = None         # engine threads per instance (default: its CPUs)
    max_request_bytes: int = 64 << 20  # larger bodies get 413 (checked while the body streams in)
    body_timeout_s: float = 60.0       # a request body must arrive within this (else 408)
    stall_timeout_s: float = 120.0     # an LLM step running longer turns /health 503 (0: never)
    merge_check: bool = True           # prove at load that merging requests keeps every answer
    # speculative decoding per LLM: model name ("*": every LLM) -> "ngram" or a draft .kiln path
    drafts: dict = field(default_factory=dict)
    prompt_lookup_max: int = 4         # n-gram drafting: longest suffix looked up
    prompt_lookup_min: int = 2         # ... and shortest
    # encoder models served on /v1/embeddings: {model name: its tokenizer's (sentence-transformers) directory}
    embeddings: dict = field(default_factory=dict)
