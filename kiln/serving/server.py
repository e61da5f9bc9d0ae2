"""``kiln serve``: serve .kiln artifacts over HTTP with the Open Inference Protocol.

The protocol is KServe v2 as Triton speaks it, so ``tritonclient.http`` and
other v2 clients work unchanged:

==========================================  ==========================================
``GET  /v2/health/live``                     200 while the process runs
``GET  /v2/health/ready``                    200 once every model is loaded and warmed up
``GET  /v2``                                 server metadata (name, version, extensions)
``GET  /v2/models/{name}``                   model metadata: inputs/outputs, shapes (-1 varies)
``GET  /v2/models/{name}/ready``             200 when that model is ready
``GET  /v2/models/{name}/config``            batching and instance settings
``POST /v2/models/{name}/infer``             inference: JSON tensors or binary tensor data
``POST /v2/repository/index``                the models and their states
``GET  /metrics``                            Prometheus metrics
==========================================  ==========================================

(``/v2/models/{name}/versions/1/...`` works too; every model has version ``1``.)

Built on Starlette (ASGI) served by uvicorn. Each model gets a
:class:`kiln.serving.batching.Batcher`: a bounded queue, dynamic batching and one or
more instances over kiln cores; before a model's requests are merged, the server
proves on synthetic inputs that merging keeps every answer
(:func:`kiln.serving.batching.check_merging`), and runs them alone otherwise. Models are
named after their file (``bert.kiln`` -> ``bert``) unless named ``name=path``.
Errors use the protocol's ``{"error": "..."}`` body: 400 for bad requests, 404
for an unknown model, 408 for a body that does not arrive in time, 413 for one
over the size limit (checked as it streams in), 503 when a model's queue is
full, it is not ready yet or the server is shutting down, 504 when a request
times out. Logs are JSON lines on stderr. See ``docs/serving.md``.

Python API: :func:`serve` (blocking; what ``kiln serve`` runs) and
:func:`build_app` (the ASGI app, to run under any ASGI server).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import zipfile
import zlib
from dataclasses import asdict, dataclass

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.serving.batching import Batcher, Overloaded, RequestTimeout, Unavailable, check_merging, layout_of
from kiln.errors import ArtifactError, InputError, KilnError

logger = logging.getLogger("kiln.serve")

# KServe v2 datatypes <-> torch dtypes (BYTES, i.e. strings, has no tensor counterpart)
DATATYPES = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32,
    "FP64": torch.float64, "BF16": torch.bfloat16,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DATATYPES[_name.upper()] = getattr(torch, _name)
DATATYPE_OF = {v: k for k, v in DATATYPES.items()}
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BadRequest(KilnError):
    """A malformed or mismatched inference request (HTTP 400)."""


class BodyTooLarge(KilnError):
    """A request body over ``max_request_bytes`` (HTTP 413)."""


class BodyTimeout(KilnError):
    """The request body did not arrive within ``body_timeout_s`` (HTTP 408)."""


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
    merge_check: bool = True           # prove at load that merging requests keeps every answer


# -- logging ---------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event and the record's fields."""

    def format(self, record):
        out = {"ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "event": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log(level: str, event: str, **fields):
    logger.log(getattr(logging, level.upper()), event, extra={"fields": fields})


def logging_config(level: str = "info", access_log: bool = False) -> dict:
    """``logging.config.dictConfig`` settings: kiln's and uvicorn's logs as JSON lines on stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": handler},
        "loggers": {
            "kiln.serve": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["stderr"], "level": "INFO" if access_log else "WARNING",
                               "propagate": False},
        },
    }


# -- metrics -----------------------------------------------------------------------------------------
class ServeMetrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kiln_serve_requests", "Inference requests received", ["model"], registry=r)
        self.failures = Counter("kiln_serve_request_failures", "Inference requests that failed, by reason "
                                "(bad_request, overloaded, unavailable, timeout, internal)",
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


# -- tensors on the wire -----------------------------------------------------------------------------
def tensor_from_json(data, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    count = math.prod(shape)
    try:
        if dtype == torch.bool:
            flat = _flatten_json(data)
            if not all(isinstance(v, bool) for v in flat):
                raise ValueError("BOOL data must be true/false")
            t = torch.tensor(flat, dtype=torch.bool)
        elif dtype.is_floating_point:
            t = torch.tensor(_flatten_json(data), dtype=torch.float64).to(dtype)
        else:
            flat = _flatten_json(data)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
                raise ValueError(f"{DATATYPE_OF[dtype]} data must be integers")
            t = torch.tensor(flat, dtype=dtype)
    except (ValueError, TypeError, OverflowError, RuntimeError) as e:
        raise BadRequest(f"input '{name}': cannot read 'data' as {DATATYPE_OF[dtype]}: {e}") from None
    if t.numel() != count:
        raise BadRequest(f"input '{name}': shape {shape} needs {count} values, 'data' has {t.numel()}")
    return t.reshape(shape)


def _flatten_json(data) -> list:
    if not isinstance(data, list):
        raise ValueError("'data' must be a list")
    if not data or not isinstance(data[0], list):
        return data
    out: list = []
    stack = [data]
    while stack:           # row-major flattening of nested lists, without recursion limits
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def tensor_from_bytes(chunk, dtype: torch.dtype, shape: list, name: str) -> torch.Tensor:
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(chunk) != count * itemsize:
        raise BadRequest(f"input '{name}': shape {shape} of {DATATYPE_OF[dtype]} needs "
                         f"{count * itemsize} bytes, binary_data_size is {len(chunk)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:     # any non-zero byte is true (never an invalid bool in a tensor)
        return torch.frombuffer(bytearray(chunk), dtype=torch.uint8).ne(0).reshape(shape)
    return torch.frombuffer(bytearray(chunk), dtype=dtype).reshape(shape)


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def parse_body(body: bytes, header_length) -> tuple:
    """(JSON request, the binary data after it) of an infer request body."""
    if header_length is None:
        json_part, rest = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length must be an integer, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {n} is outside the body of {len(body)} bytes")
        view = memoryview(body)
        json_part, rest = view[:n], view[n:]
    try:
        payload = json.loads(bytes(json_part))
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"malformed JSON in the request: {e}") from None
    except RecursionError:
        raise BadRequest("malformed JSON in the request: nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadRequest("the inference request must be a JSON object")
    return payload, rest


# -- one served model ---------------------------------------------------------------------------------
class ServedModel:
    """A model's instances, batcher and protocol views (metadata, decoding, encoding)."""

    def __init__(self, name: str, source, config: ServeConfig, metrics: ServeMetrics):
        self.name, self.source, self.config, self.metrics = name, source, config, metrics
        self.instances: list = []
        self.cores: list = []         # the kiln core of each instance (None: unpinned)
        self.batcher: Batcher | None = None
        self.ready = False
        self.state = "LOADING"
        self.error: str | None = None
        self.model_name: str | None = None    # the artifact's own model name (manifest)
        self.merge_check = None               # kiln.serving.batching.MergeCheck, when one ran
        self._meta = None

    # -- loading -------------------------------------------------------------------------------
    def load(self):
        """Load every instance and warm it up (in the loading thread)."""
        import kiln
        from kiln.host import cores as placement
        n = max(1, int(self.config.instances))
        cores = placement.visible() if n > 1 else []
        started = time.perf_counter()
        data = None
        for k in range(n):
            t0 = time.perf_counter()
            core = cores[k % len(cores)].id if cores else None
            ctx = placement.cores(core) if core is not None else contextlib.nullcontext()
            with ctx:
                if isinstance(self.source, kiln.Model):
                    if n == 1:
                        model = self.source
                    else:
                        data = data if data is not None else self.source.to_bytes()
                        # bytes of a model this process already loaded (and trusted)
                        model = kiln.load(data, threads=self.config.threads, trust_native_code=True)
                else:
                    model = kiln.load(self.source, threads=self.config.threads)
            self.instances.append(model)
            self.cores.append(core)
            log("info", "instance_loaded", model=self.name, instance=k, core=core,
                kind=type(model).__name__, seconds=round(time.perf_counter() - t0, 3))
        first = self.instances[0]
        self.model_name = first.name
        self.input_specs = list(first.input_specs)
        self.output_specs = list(first.output_specs)
        self.input_index = {s.name: i for i, s in enumerate(self.input_specs)}
        self.output_index = {s.name: o for o, s in enumerate(self.output_specs)}
        self.layout = layout_of(first)
        for k, model in enumerate(self.instances):
            t0 = time.perf_counter()
            sets = warmup_inputs(model)
            for flat in sets:
                model.run_flat(flat)
            log("info", "instance_warmed_up", model=self.name, instance=k, calls=len(sets),
                seconds=round(time.perf_counter() - t0, 3))
        b = self.batcher = Batcher(self.name, self.instances, self.layout,
                                   max_batch_size=self.config.max_batch_size,
                                   max_queue_delay_ms=self.config.max_queue_delay_ms,
                                   max_queue=self.config.max_queue,
                                   observe=self.metrics.observer(self.name), log=log)
        if self.config.max_batch_size > 1 and not b.batching:
            log("info", "batching_off", model=self.name,
                reason="the model's inputs and outputs do not all have a variable batch dim (dim 0); "
                       "compile it with dynamic_batch=True or bucket dim 0 to batch requests")
        elif b.batching and self.config.merge_check:
            self.check_merging()
        elif b.batching:
            log("info", "merge_check_skipped", model=self.name,
                reason="merge_check is off: merged batches are trusted to equal requests run alone")
        self.metrics.instances.labels(self.name).set(len(self.instances))
        self.metrics.batching.labels(self.name).set(1 if b.batching else 0)
        return time.perf_counter() - started

    def check_merging(self):
        """Prove that merging requests keeps every answer, or turn batching off for this model."""
        b = self.batcher
        check = self.merge_check = check_merging(self.instances[0], self.layout, b.max_batch_size)
        if check.safe:
            log("info", "merge_checked", model=self.name, cases=check.cases,
                max_diff=check.max_diff, seconds=round(check.seconds, 3))
            return
        b.disable(check.describe())
        self._meta = None
        log("warning", "batching_unsafe", model=self.name, reason=check.describe(),
            output=check.output, case=check.case, row=check.row, max_diff=check.max_diff,
            tolerance=check.tolerance, error=check.error, seconds=round(check.seconds, 3),
            action="batching off: every request runs alone")

    def batching_note(self) -> str:
        """One line on whether and why requests are merged (model metadata and config)."""
        b = self.batcher
        if b.batching:
            return "on: " + (self.merge_check.describe() if self.merge_check is not None
                             else "merge check skipped (merge_check off)")
        return f"off: {b.off_reason}"

    def start(self):
        """On the event loop: start the batcher and declare the model ready."""
        self.batcher.start()
        self.ready, self.state = True, "READY"
        self.metrics.ready.labels(self.name).set(1)
        b = self.batcher
        log("info", "model_ready", model=self.name, instances=len(self.instances), batching=b.batching,
            max_batch_size=b.max_batch_size, max_queue_delay_ms=b.delay * 1e3, max_queue=b.max_queue,
            inputs=self.metadata()["inputs"], outputs=self.metadata()["outputs"])

    # -- protocol views ------------------------------------------------------------------------
    def metadata(self) -> dict:
        if self._meta is None:
            lay = self.layout
            self._meta = {
                "name": self.name, "versions": ["1"], "platform": "kiln",
                "parameters": {"model_name": self.model_name, "batching": self.batching_note()},
                "inputs": [{"name": s.name, "datatype": DATATYPE_OF.get(s.dtype, str(s.dtype)),
                            "shape": [-1 if d in lay.input_var[i] else int(n) for d, n in enumerate(s.shape)]}
                           for i, s in enumerate(self.input_specs)],
                "outputs": [{"name": s.name, "datatype": DATATYPE_OF.get(s.dtype, str(s.dtype)),
                             "shape": [-1 if d in lay.output_var[o] else int(n) for d, n in enumerate(s.shape)]}
                            for o, s in enumerate(self.output_specs)],
            }
        return self._meta

    def model_config(self) -> dict:
        b = self.batcher
        return {"name": self.name, "platform": "kiln", "backend": "kiln",
                "max_batch_size": b.max_batch_size if b.batching else 0,
                "dynamic_batching": ({"max_queue_delay_microseconds": int(b.delay * 1e6),
                                      "max_queue_size": b.max_queue} if b.batching else None),
                "max_queue_size": b.max_queue,
                "instance_group": [{"count": len(self.instances), "kind": "KIND_CPU", "cores": self.cores}],
                "parameters": {"model_name": {"string_value": self.model_name},
                               "batching": {"string_value": self.batching_note()}},
                "input": self.metadata()["inputs"], "output": self.metadata()["outputs"]}

    def decode(self, payload: dict, binary) -> tuple:
        """(flat inputs, rows, [(output index, binary)], request id, timeout) or BadRequest."""
        params = payload.get("parameters") or {}
        if not isinstance(params, dict):
            raise BadRequest("'parameters' must be a JSON object")
        entries = payload.get("inputs")
        if not isinstance(entries, list) or not entries:
            raise BadRequest("the request needs a non-empty 'inputs' list")
        tensors: dict = {}
        offset = 0
        meta_in = self.metadata()["inputs"]
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise BadRequest("every input must be an object with a 'name'")
            name = entry["name"]
            if name in tensors:
                raise BadRequest(f"input '{name}' is given twice")
            i = self.input_index.get(name)
            if i is None:
                raise BadRequest(f"unknown input '{name}'; model '{self.name}' takes "
                                 f"{', '.join(repr(s.name) for s in self.input_specs)}")
            spec, want = self.input_specs[i], meta_in[i]
            datatype, shape = entry.get("datatype"), entry.get("shape")
            if datatype != want["datatype"]:
                raise BadRequest(f"input '{name}': expected datatype {want['datatype']}, got {datatype!r}")
            if (not isinstance(shape, list)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
                raise BadRequest(f"input '{name}': 'shape' must be a list of non-negative integers, "
                                 f"got {shape!r}")
            if len(shape) != len(want["shape"]) or any(
                    (w == -1 and s < 1) or (w != -1 and s != w) for s, w in zip(shape, want["shape"])):
                raise BadRequest(f"input '{name}': expected shape {want['shape']} (-1: any size), got {shape}")
            eparams = entry.get("parameters") or {}
            if not isinstance(eparams, dict):
                raise BadRequest(f"input '{name}': 'parameters' must be a JSON object")
            size = eparams.get("binary_data_size")
            if size is not None:
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise BadRequest(f"input '{name}': binary_data_size must be a non-negative integer")
                if offset + size > len(binary):
                    raise BadRequest(f"input '{name}': binary_data_size {size} runs past the end of the "
                                     f"body ({len(binary) - offset} bytes of binary data left)")
                tensors[name] = tensor_from_bytes(binary[offset:offset + size], spec.dtype, shape, name)
                offset += size
            elif "data" in entry:
                tensors[name] = tensor_from_json(entry["data"], spec.dtype, shape, name)
            else:
                raise BadRequest(f"input '{name}' has neither 'data' nor a binary_data_size parameter")
        if offset != len(binary):
            raise BadRequest(f"{len(binary) - offset} bytes of binary data follow the last binary input")
        missing = [s.name for s in self.input_specs if s.name not in tensors]
        if missing:
            raise BadRequest(f"missing input(s) {', '.join(repr(m) for m in missing)} for model '{self.name}'")
        flat = [tensors[s.name] for s in self.input_specs]
        try:
            self.instances[0].check(flat)
        except InputError as e:
            raise BadRequest(str(e)) from None
        rows = int(flat[0].shape[0]) if self.batcher.batching else 1
        binary_default = params.get("binary_data_output", False)
        if not isinstance(binary_default, bool):
            raise BadRequest("parameter binary_data_output must be true or false")
        wanted = []
        requested = payload.get("outputs")
        if requested is None:
            wanted = [(o, binary_default) for o in range(len(self.output_specs))]
        else:
            if not isinstance(requested, list):
                raise BadRequest("'outputs' must be a list")
            for out in requested:
                if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                    raise BadRequest("every requested output must be an object with a 'name'")
                o = self.output_index.get(out["name"])
                if o is None:
                    raise BadRequest(f"unknown output '{out['name']}'; model '{self.name}' has "
                                     f"{', '.join(repr(s.name) for s in self.output_specs)}")
                oparams = out.get("parameters") or {}
                if not isinstance(oparams, dict):
                    raise BadRequest(f"output '{out['name']}': 'parameters' must be a JSON object")
                if oparams.get("classification"):
                    raise BadRequest("the classification extension is not supported")
                b = oparams.get("binary_data", binary_default)
                if not isinstance(b, bool):
                    raise BadRequest(f"output '{out['name']}': binary_data must be true or false")
                wanted.append((o, b))
        timeout = self.config.timeout_s
        if params.get("timeout") is not None:        # microseconds, as Triton
            t = params["timeout"]
            if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
                raise BadRequest("parameter timeout must be a positive number of microseconds")
            timeout = min(timeout, t / 1e6)
        req_id = payload.get("id")
        if req_id is not None and not isinstance(req_id, str):
            raise BadRequest("'id' must be a string")
        return flat, rows, wanted, req_id, timeout

    def encode(self, outs, wanted, req_id) -> Response:
        entries, blobs = [], []
        for o, binary in wanted:
            t = outs[o]
            entry = {"name": self.output_specs[o].name, "datatype": DATATYPE_OF[t.dtype],
                     "shape": list(t.shape)}
            if binary:
                data = tensor_to_bytes(t)
                entry["parameters"] = {"binary_data_size": len(data)}
                blobs.append(data)
            else:
                entry["data"] = t.reshape(-1).tolist()
            entries.append(entry)
        body = {"model_name": self.name, "model_version": "1", "outputs": entries}
        if req_id is not None:
            body["id"] = req_id
        header = json.dumps(body, separators=(",", ":")).encode()
        if not blobs:
            return Response(header, media_type="application/json")
        return Response(header + b"".join(blobs), media_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(len(header))})


def warmup_inputs(model) -> list:
    """Flat inputs that run every compiled variant of ``model`` once at its compiled shapes."""
    from kiln.runtime.buckets import Bucketed, DynamicBatch
    if isinstance(model, DynamicBatch):
        return warmup_inputs(model.inner)
    if isinstance(model, Bucketed):
        return [flat for v in model.variants for flat in warmup_inputs(v)]

    def filler(spec):
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            return torch.zeros(spec.shape, dtype=spec.dtype)
        return torch.ones(spec.shape, dtype=spec.dtype)
    return [[filler(s) for s in model.input_specs]]


# -- the server ------------------------------------------------------------------------------------------
class ServerState:
    """Everything the app's handlers share: models, config, metrics, lifecycle flags."""

    def __init__(self, models: dict, config: ServeConfig):
        self.config = config
        self.metrics = ServeMetrics()
        self.models = {name: ServedModel(name, src, config, self.metrics) for name, src in models.items()}
        self.draining = False
        self.failed = False
        self.in_flight = 0            # inference requests being handled
        self.on_fatal = None          # set by serve(): stop the server when a model fails to load
        self.loop = None

    def ready(self) -> bool:
        return not self.draining and all(m.ready for m in self.models.values())

    def load_all(self):
        """Loading thread: load and warm up every model, then start it on the event loop."""
        for sm in self.models.values():
            log("info", "model_loading", model=sm.name,
                source=sm.source if isinstance(sm.source, str) else type(sm.source).__name__,
                instances=self.config.instances)
            try:
                seconds = sm.load()
            except Exception as e:  # noqa: BLE001 - reported, and the server stops
                sm.state, sm.error = "UNAVAILABLE", f"{type(e).__name__}: {e}"
                self.failed = True
                log("error", "model_load_failed", model=sm.name, error=sm.error)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            log("info", "model_loaded", model=sm.name, seconds=round(seconds, 3))
            if not self._on_loop(sm.start):
                return
        self._on_loop(lambda: log("info", "server_ready", models=list(self.models)))

    def _on_loop(self, fn) -> bool:
        try:
            self.loop.call_soon_threadsafe(fn)
            return True
        except RuntimeError:      # the event loop closed: the server stopped while loading
            return False

    def begin_drain(self):
        """SIGTERM: readiness goes false; queued requests run without waiting for batches to fill."""
        if self.draining:
            return
        self.draining = True
        log("info", "draining", in_flight=self.in_flight)
        for sm in self.models.values():
            if sm.batcher is not None:
                sm.batcher.flush()

    async def shutdown(self):
        self.draining = True
        for sm in self.models.values():
            if sm.batcher is not None and sm.batcher._task is not None:
                await sm.batcher.close()
            sm.ready, sm.state = False, "UNAVAILABLE"
            self.metrics.ready.labels(sm.name).set(0)
        log("info", "stopped")


MAX_ERROR_CHARS = 2000


def _error(status: int, message: str, headers=None) -> Response:
    """The protocol's error body. ASCII JSON: a message quoting the client's bytes (a lone
    surrogate in a name) must not fail to encode; long quotes are cut."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + f"... ({len(message)} characters)"
    return Response(json.dumps({"error": message}), status_code=status, headers=headers,
                    media_type="application/json")


def _model(request: Request):
    """(state, served model) for the request's path, or an error response."""
    state: ServerState = request.app.state.kiln
    name = request.path_params["name"]
    sm = state.models.get(name)
    if sm is None:
        return state, _error(404, f"unknown model '{name}'; this server serves "
                                  f"{', '.join(repr(n) for n in state.models) or 'no models'}")
    version = request.path_params.get("version")
    if version is not None and version != "1":
        return state, _error(404, f"model '{name}' has no version '{version}'; it has version '1'")
    return state, sm


async def server_metadata(request):
    from kiln import __version__
    return JSONResponse({"name": "kiln", "version": __version__,
                         "extensions": ["binary_tensor_data", "model_repository"]})


async def health_live(request):
    return JSONResponse({"live": True})


async def health_ready(request):
    state: ServerState = request.app.state.kiln
    ok = state.ready()
    return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


async def model_metadata(request):
    state, sm = _model(request)
    if isinstance(sm, Response):
        return sm
    if sm.batcher is None:
        return _error(503, f"model '{sm.name}' is {sm.state.lower()}" + (f": {sm.error}" if sm.error else ""))
    return JSONResponse(sm.metadata())


async def model_config(request):
    state, sm = _model(request)
    if isinstance(sm, Response):
        return sm
    if sm.batcher is None:
        return _error(503, f"model '{sm.name}' is {sm.state.lower()}")
    return JSONResponse(sm.model_config())


async def model_ready(request):
    state, sm = _model(request)
    if isinstance(sm, Response):
        return sm
    ok = sm.ready and not state.draining
    return JSONResponse({"name": sm.name, "ready": ok}, status_code=200 if ok else 503)


async def repository_index(request):
    state: ServerState = request.app.state.kiln
    return JSONResponse([{"name": sm.name, "version": "1", "state": sm.state,
                          **({"reason": sm.error} if sm.error else {})} for sm in state.models.values()])


async def metrics_endpoint(request):
    state: ServerState = request.app.state.kiln
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def infer(request):
    state, sm = _model(request)
    if isinstance(sm, Response):
        return sm
    m = state.metrics
    name = sm.name
    m.requests.labels(name).inc()
    gauge = m.in_flight.labels(name)
    gauge.inc()
    state.in_flight += 1
    loop = asyncio.get_running_loop()
    start = loop.time()

    def fail(reason, status, message, headers=None):
        m.failures.labels(name, reason).inc()
        return _error(status, message, headers)

    try:
        if not sm.ready:
            return fail("unavailable", 503, f"model '{name}' is not ready ({sm.state.lower()})",
                        {"Retry-After": "1"})
        config = state.config
        try:
            encoding = request.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity", "gzip", "deflate"):
                raise BadRequest(f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none")
            body = await read_body(request, config.max_request_bytes, config.body_timeout_s)
            if encoding in ("gzip", "deflate"):
                body = _inflate(body, encoding, config.max_request_bytes)
            payload, binary = parse_body(body, request.headers.get("inference-header-content-length"))
            del body        # the tensors are copies: do not hold the raw body while queued
            flat, rows, wanted, req_id, timeout = sm.decode(payload, binary)
            del payload, binary
        except (BadRequest, InputError) as e:
            return fail("bad_request", 400, str(e))
        except BodyTooLarge as e:
            return fail("bad_request", 413, str(e))
        except BodyTimeout as e:       # and close the connection: the rest of its body is not awaited
            return fail("bad_request", 408, str(e), {"Connection": "close"})
        except ClientDisconnect:
            m.failures.labels(name, "disconnected").inc()
            log("debug", "client_disconnected", model=name, stage="reading the request body")
            return Response(status_code=400)      # nobody is listening
        except (OSError, EOFError, zlib.error) as e:
            return fail("bad_request", 400, f"cannot read the request body: {e}")
        try:
            outs = await sm.batcher.submit(flat, rows, timeout)
        except Overloaded as e:
            return fail("overloaded", 503, str(e), {"Retry-After": "1"})
        except Unavailable as e:
            return fail("unavailable", 503, str(e), {"Retry-After": "1"})
        except RequestTimeout as e:
            return fail("timeout", 504, str(e))
        except InputError as e:
            return fail("bad_request", 400, str(e))
        except Exception as e:  # noqa: BLE001 - one request's failure is its own
            log("error", "inference_failed", model=name, error=f"{type(e).__name__}: {e}")
            return fail("internal", 500, f"inference failed: {type(e).__name__}: {e}")
        response = sm.encode(outs, wanted, req_id)
        m.request_seconds.labels(name).observe(loop.time() - start)
        return response
    finally:
        gauge.dec()
        state.in_flight -= 1


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused (:class:`BodyTooLarge`) as soon as it passes ``limit`` bytes,
    before the rest is read, and (:class:`BodyTimeout`) when it takes longer than ``timeout``."""
    length = request.headers.get("content-length")
    if length is not None and "transfer-encoding" in request.headers:
        # RFC 9112 6.1: ambiguous framing (a request-smuggling pattern); refuse, do not guess
        raise BadRequest("a request must not have both Content-Length and Transfer-Encoding")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(f"request body of {length} bytes is over the limit of {limit} bytes")
    chunks: list = []
    size = 0

    async def receive():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout:g} s "
                          f"({size} bytes received)") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """Decompress a request body, refusing one that inflates past ``limit`` (a zip bomb)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    out = d.decompress(body, limit + 1)
    if len(out) > limit or d.unconsumed_tail:
        raise BadRequest(f"the {encoding} body inflates past the limit of {limit} bytes")
    if not d.eof:
        raise BadRequest(f"the {encoding} body is truncated")
    return out


async def _http_error(request, exc):
    return _error(exc.status_code, exc.detail or "error", getattr(exc, "headers", None))


async def _internal_error(request, exc):
    """Any other exception: a JSON 500 (Starlette re-raises it after, so uvicorn logs it)."""
    log("error", "request_failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return _error(500, f"internal error: {type(exc).__name__}")


def _routes():
    out = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        out += [Route(prefix, model_metadata, methods=["GET"]),
                Route(prefix + "/ready", model_ready, methods=["GET"]),
                Route(prefix + "/config", model_config, methods=["GET"]),
                Route(prefix + "/infer", infer, methods=["POST"])]
    return [Route("/v2", server_metadata, methods=["GET"]),
            Route("/v2/health/live", health_live, methods=["GET"]),
            Route("/v2/health/ready", health_ready, methods=["GET"]),
            Route("/v2/repository/index", repository_index, methods=["POST", "GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"])] + out


def _model_name_of(path: str) -> str:
    """The model name in an artifact's manifest (and a quick check that it is one)."""
    from kiln.artifact.container import MANIFEST
    if not os.path.exists(path):
        raise ArtifactError(f"{path}: no such file")
    try:
        with zipfile.ZipFile(path) as z:
            return json.loads(z.read(MANIFEST)).get("model_name", "model")
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
        raise ArtifactError(f"{path}: not a kiln artifact ({e})") from None


def default_name(path: str) -> str:
    """The URL name of an artifact served without ``name=``: the file's stem, as Triton names a
    model after its repository folder (``models/bert.kiln`` -> ``bert``). The artifact's own model
    name (often just the Python class) stays visible in the model's metadata."""
    _model_name_of(path)
    stem = os.path.basename(os.fspath(path))
    root, ext = os.path.splitext(stem)
    return root if ext and root else stem


def resolve_models(models) -> dict:
    """``{name: path or Model}`` from what :func:`build_app` accepts."""
    from kiln.runtime.model import Model
    if isinstance(models, dict):
        items = list(models.items())
    else:
        if isinstance(models, (str, os.PathLike, Model)):
            models = [models]
        items = []
        for spec in models:
            if isinstance(spec, tuple):
                items.append(spec)
            elif isinstance(spec, Model):
                items.append((spec.name, spec))
            else:
                spec = os.fspath(spec)
                name, sep, path = spec.partition("=")
                if sep and name and os.sep not in name and not os.path.exists(spec):
                    items.append((name, path))
                else:
                    items.append((None, spec))
    out: dict = {}
    for name, src in items:
        if not isinstance(src, Model):
            src = os.fspath(src)
            name = name or default_name(src)
        if name in out:
            raise KilnError(f"two models are named '{name}'; name them on the command line "
                            "(name=path.kiln)")
        if not name or "/" in name or not name.isprintable() or not _utf8(name):
            raise KilnError(f"model name {name!r} cannot be used in a URL path; name it on the "
                            "command line (name=path.kiln)")
        out[name] = src
    if not out:
        raise KilnError("no models to serve")
    return out


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:      # a file name that is not UTF-8 (surrogate escapes)
        return False


def build_app(models, config: ServeConfig | None = None, **settings) -> Starlette:
    """The ASGI app serving ``models``: paths (``"m.kiln"`` or ``"name=m.kiln"``), loaded
    ``kiln.Model`` objects, ``(name, path or model)`` pairs, or a ``{name: path or model}``
    dict. ``settings`` are :class:`ServeConfig` fields. Models load and warm up in a
    background thread once the app starts; ``/v2/health/ready`` turns 200 when all are ready.
    ``app.state.kiln`` is the :class:`ServerState`."""
    config = config or ServeConfig(**settings)
    state = ServerState(resolve_models(models), config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        threading.Thread(target=state.load_all, name="kiln-serve-load", daemon=True).start()
        try:
            yield
        finally:
            await state.shutdown()

    app = Starlette(routes=_routes(), lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.kiln = state
    return app


def serve(models, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          access_log: bool = False, drain_timeout: float = 30.0, **settings) -> int:
    """Serve ``models`` (see :func:`build_app`) until SIGTERM/SIGINT; returns an exit code.

    On SIGTERM the listening socket closes, readiness turns false, queued requests
    run at once and in-flight ones finish (for up to ``drain_timeout`` seconds)
    before the process exits. ``port=0`` picks a free port, logged as ``listening``."""
    import logging.config

    import uvicorn
    logging.config.dictConfig(logging_config(log_level, access_log))
    app = build_app(models, **settings)
    state: ServerState = app.state.kiln
    log("info", "starting", pid=os.getpid(), config=asdict(state.config),
        models={sm.name: sm.source if isinstance(sm.source, str) else type(sm.source).__name__
                for sm in state.models.values()})
    sock = _bind(host, port)
    bound = sock.getsockname()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            log("info", "listening", host=bound[0], port=bound[1], url=f"http://{_url_host(host)}:{bound[1]}")

        def handle_exit(self, sig, frame):
            log("info", "shutdown_requested", signal=signal.Signals(sig).name)
            super().handle_exit(sig, frame)
            if state.loop is not None:
                state.loop.call_soon_threadsafe(state.begin_drain)

    config = uvicorn.Config(app, log_config=None, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=drain_timeout, lifespan="on")
    server = Server(config)
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        # uvicorn re-raises the signal that stopped it once it is done; a no-op handler lets
        # serve() return (and the process exit 0) after a graceful shutdown
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if state.failed else 0


def _url_host(host):
    return f"[{host}]" if ":" in host else host


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KilnError(f"cannot listen on {host}:{port}: {e}") from None
    sock.set_inheritable(True)
    return sock


# -- command line ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser):
    """The ``kiln serve`` arguments (for ``kiln/cli.py``'s subparser)."""
    d = ServeConfig()
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="a .kiln artifact, or name=path.kiln to choose its URL name "
                        "(default: the file's name without .kiln)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size,
                   help=f"rows per merged batch (default {d.max_batch_size}; 1 turns batching off)")
    p.add_argument("--max-queue-delay-ms", type=float, default=d.max_queue_delay_ms,
                   help=f"how long a request waits for others to batch with (default {d.max_queue_delay_ms})")
    p.add_argument("--no-batching", action="store_true", help="run every request alone")
    p.add_argument("--instances", type=int, default=d.instances,
                   help="copies of each model, placed on kiln cores round-robin (default 1: unpinned)")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"queued requests per model beyond which requests get 503 (default {d.max_queue})")
    p.add_argument("--timeout", type=float, default=d.timeout_s,
                   help=f"per-request timeout in seconds, queue + inference (default {d.timeout_s:g})")
    p.add_argument("--threads", type=int, default=None, help="engine threads per instance (default: its CPUs)")
    p.add_argument("--max-body-bytes", type=_size, default=d.max_request_bytes, metavar="N",
                   help=f"largest request body (bytes, or with K/M/G: 64M); larger ones get 413 "
                        f"(default {d.max_request_bytes >> 20}M; also the limit on an inflated gzip body)")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                   help=f"seconds a request body may take to arrive before 408 (default {d.body_timeout_s:g})")
    p.add_argument("--no-merge-check", action="store_true",
                   help="trust that merging requests into a batch never changes a model's answers "
                        "(skip the check at load that turns batching off for models whose rows interact)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish (default 30)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--trust-native-code", action="store_true",
                   help="load native code (TorchInductor partitions) from artifacts that no key trusted "
                        "here signed (as KILN_TRUST_NATIVE_CODE=1); only for artifacts from a source you trust")


def _size(text: str) -> int:
    """``--max-body-bytes`` values: bytes, or a number with K, M or G (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive: {text!r}")
    return n


def run(args) -> int:
    """Run ``kiln serve`` from parsed :func:`add_arguments` arguments."""
    if getattr(args, "trust_native_code", False):
        os.environ["KILN_TRUST_NATIVE_CODE"] = "1"
    try:
        return serve(args.models, args.host, args.port, log_level=args.log_level,
                     access_log=args.access_log, drain_timeout=args.drain_timeout,
                     max_batch_size=1 if args.no_batching else args.max_batch_size,
                     max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
                     instances=args.instances, timeout_s=args.timeout, threads=args.threads,
                     max_request_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                     merge_check=not args.no_merge_check)
    except KilnError as e:
        print(f"kiln serve: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kiln serve", description="Serve .kiln artifacts over HTTP "
                                "with the Open Inference Protocol (KServe v2).")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
