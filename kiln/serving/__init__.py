"""kiln's HTTP server: ``.kiln`` artifacts behind the Open Inference Protocol (KServe v2).

Modules, from the wire inwards (importing this package imports none of them, so
Starlette and uvicorn load only when serving):

* :mod:`~kiln.serving.server`: ``kiln serve`` / ``python -m kiln.serving``: arguments,
  logging set-up, socket, uvicorn, graceful shutdown (:func:`~kiln.serving.server.serve`).
* :mod:`~kiln.serving.app`: the Starlette app and its routes, body limits, error statuses
  (:func:`~kiln.serving.app.build_app`).
* :mod:`~kiln.serving.protocol`: the KServe v2 codec, pure functions (JSON/binary tensors).
* :mod:`~kiln.serving.repository`: which models are served under which names, and their
  lifecycle; :mod:`~kiln.serving.models`: one served model (instances, warm-up, merge check).
* :mod:`~kiln.serving.batching`: the dynamic batcher; :mod:`~kiln.serving.layout`: what a
  model lets it merge; :mod:`~kiln.serving.merging`: merge, split, and the proof that merging
  is exact.
* :mod:`~kiln.serving.settings`, :mod:`~kiln.serving.metrics`, :mod:`~kiln.serving.logs`:
  the settings dataclass, Prometheus metrics, JSON-lines logs.

A second protocol (an OpenAI-compatible API, gRPC) is a codec module beside
``protocol.py`` plus its routes, sharing the repository, batcher, metrics and logs.
"""
