"""The server's Prometheus metrics (``GET /metrics``).

Each app gets a registry of its own (built with the app, not at import), so two
apps in one process, or tests, never share counters, and kiln's process-wide
observability (:mod:`kiln.observe`) stays apart from the HTTP server's.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kiln_serve_requests", "Inference requests received (KServe infer and "
                                "/v1/embeddings)", ["model"], registry=r)
        self.failures = Counter("kiln_serve_request_failures", "Inference requests that failed, by reason "
                                "(bad_request, overloaded, unavailable, timeout, internal, disconnected)",
                                ["model", "reason"], registry=r)
        self.request_seconds = Histogram("kiln_serve_request_duration_seconds", "Successful inference "
                                         "requests, end to end in the server", ["model"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("kiln_serve_queue_duration_seconds", "Time requests waited in "
                                       "the queue before their batch ran", ["model"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram("kiln_serve_inference_duration_seconds", "Time to run one "
                                           "(merged) batch, including merging and splitting", ["model"],
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("kiln_serve_batch_size", "Rows (dim 0) per executed batch", ["model"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("kiln_serve_queue_depth", "Requests waiting in the queue", ["model"],
                                 registry=r)
        self.in_flight = Gauge("kiln_serve_in_flight_requests", "Inference requests being handled",
                               ["model"], registry=r)
        self.ready = Gauge("kiln_serve_model_ready", "1 once the model is loaded and warmed up",
                           ["model"], registry=r)
        self.instances = Gauge("kiln_serve_model_instances", "Loaded instances of the model", ["model"],
                               registry=r)
        self.batching = Gauge("kiln_serve_model_batching", "1 when the model's requests are merged into "
                              "batches (dynamic batching on and proven exact at load)", ["model"], registry=r)
        self._llm_metrics(r)

    def _llm_metrics(self, r):
        """An LLM's (the OpenAI routes): per token and per request, and its KV cache."""
        self.llm_ttft = Histogram("kiln_llm_time_to_first_token_seconds", "From a generation's arrival to "
                                  "its first token (queue + prefill)", ["model"], buckets=TOKEN_BUCKETS + (
                                      5.0, 10.0, 30.0), registry=r)
        self.llm_itl = Histogram("kiln_llm_inter_token_latency_seconds", "Between consecutive tokens of "
                                 "one generation", ["model"], buckets=TOKEN_BUCKETS, registry=r)
        self.llm_prompt_tokens = Counter("kiln_llm_prompt_tokens", "Prompt tokens of accepted generations",
                                         ["model"], registry=r)
        self.llm_generated_tokens = Counter("kiln_llm_generated_tokens", "Tokens generated", ["model"],
                                            registry=r)
        self.llm_finished = Counter("kiln_llm_generations_finished", "Generations ended, by finish reason "
                                    "(stop, length, cancelled, error)", ["model", "reason"], registry=r)
        self.llm_tokens_per_second = Gauge("kiln_llm_tokens_per_second", "Tokens generated per second "
                                           "over the last 10 seconds, all generations", ["model"], registry=r)
        self.llm_kv_usage = Gauge("kiln_llm_kv_cache_usage_ratio", "Fraction of the KV cache's positions "
                                  "held by running generations", ["model"], registry=r)
        self.llm_slots_used = Gauge("kiln_llm_running_generations", "KV-cache slots (decode rows) in use",
                                    ["model"], registry=r)

    def observer(self, model: str):
        """The batcher's ``observe`` callback for ``model``."""
        q, i, b, d = (self.queue_seconds.labels(model), self.inference_seconds.labels(model),
                      self.batch_size.labels(model), self.queue_depth.labels(model))

        def observe(kind, value):
            if kind == "queue_seconds":
                q.observe(value)
            elif kind == "inference_seconds":
                i.observe(value)
            elif kind == "batch_size":
                b.observe(value)
            elif kind == "queue_depth":
                d.set(value)
        return observe
