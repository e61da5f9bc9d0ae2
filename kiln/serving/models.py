"""One served model: its loaded instances, its batcher, and the protocol's views of it.

A :class:`ServedModel` loads every instance of an artifact (one per kiln core
with ``instances > 1``), warms each up on every compiled variant so the first
request does not pay for it, reads the model's :class:`~kiln.serving.layout.Layout`,
and builds its :class:`~kiln.serving.batching.Batcher`. Before requests are
merged, :meth:`ServedModel.run_merge_check` proves on synthetic rows that merging
keeps every answer, and turns batching off for this model otherwise.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from kiln.errors import BadRequestError, InputError, KilnError
from kiln.host import cores as placement
from kiln.runtime.buckets import Bucketed, DynamicBatch
from kiln.runtime.loader import load as load_model
from kiln.runtime.model import Model
from kiln.serving.batching import Batcher
from kiln.serving.layout import layout_of
from kiln.serving.logs import log
from kiln.serving.merging import check_merging
from kiln.observe.metrics import forget_calls
from kiln.serving.metrics import ServeMetrics
from kiln.serving.protocol import InferRequest, decode_request, encode_response, signature_of
from kiln.serving.settings import ServeConfig


# KServe datatypes as Triton's model config spells them (BYTES is TYPE_STRING there)
_TRITON_TYPE = {"BYTES": "TYPE_STRING"}


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
        self.merge_check = None               # kiln.serving.merging.MergeCheck, when one ran
        self.signature = None                 # kiln.serving.protocol.Signature, once loaded
        self.layout = None

    # -- loading -------------------------------------------------------------------------------
    def load(self) -> float:
        """Load every instance and warm it up (in the loading thread); returns the seconds taken."""
        started = time.perf_counter()
        self.load_instances()
        first = self.instances[0]
        self.model_name = first.name
        self.layout = layout_of(first)
        self.signature = signature_of(self.name, first.input_specs, first.output_specs,
                                      self.layout.input_var, self.layout.output_var)
        self.warm_up()
        b = Batcher(self.name, self.instances, self.layout, max_batch_size=self.config.max_batch_size,
                    max_queue_delay_ms=self.config.max_queue_delay_ms, max_queue=self.config.max_queue,
                    observe=self.metrics.observer(self.name), log=log)
        if self.config.max_batch_size > 1 and not b.batching:
            log("info", "batching_off", model=self.name,
                reason="the model's inputs and outputs do not all have a variable batch dim (dim 0); "
                       "compile it with dynamic_batch=True or bucket dim 0 to batch requests")
        elif b.batching and self.config.merge_check:
            self.run_merge_check(b)
        elif b.batching:
            log("info", "merge_check_skipped", model=self.name,
                reason="merge_check is off: merged batches are trusted to equal requests run alone")
        for model in self.instances:   # warm-up and merge-check calls are kiln's, not requests
            forget_calls(model)
            if getattr(model, "metrics", None) is not None:
                model.metrics.served_as = self.name   # kiln ls/top/monitor tell a=x.kiln from c=x.kiln
        # published only now, its batching settled: nothing reads a batcher whose merge check
        # has not run (the routes answer 503 until the model is ready anyway)
        self.batcher = b
        self.metrics.instances.labels(self.name).set(len(self.instances))
        self.metrics.batching.labels(self.name).set(1 if b.batching else 0)
        return time.perf_counter() - started

    def load_instances(self):
        """Load ``config.instances`` copies, placed on kiln cores round-robin when more than one."""
        n = max(1, int(self.config.instances))
        cores = placement.visible() if n > 1 else []
        data = None
        for k in range(n):
            t0 = time.perf_counter()
            core = cores[k % len(cores)].id if cores else None
            ctx = placement.cores(core) if core is not None else contextlib.nullcontext()
            with ctx:
                if isinstance(self.source, Model):
                    if n == 1:
                        model = self.source
                    else:
                        data = data if data is not None else self.source.to_bytes()
                        # bytes of a model this process already loaded (and trusted)
                        model = load_model(data, threads=self.config.threads, trust_native_code=True)
                else:
                    model = load_model(self.source, threads=self.config.threads)
            self.instances.append(model)
            self.cores.append(core)
            log("info", "instance_loaded", model=self.name, instance=k, core=core,
                kind=type(model).__name__, seconds=round(time.perf_counter() - t0, 3))

    def warm_up(self):
        """Run every compiled variant of every instance once, so no request pays for it."""
        for k, model in enumerate(self.instances):
            t0 = time.perf_counter()
            sets = warmup_inputs(model)
            for flat in sets:
                model.run_flat(flat)
            log("info", "instance_warmed_up", model=self.name, instance=k, calls=len(sets),
                seconds=round(time.perf_counter() - t0, 3))

    def run_merge_check(self, b: Batcher):
        """Prove that merging requests keeps every answer, or turn batching off in ``b``."""
        check = self.merge_check = check_merging(self.instances[0], self.layout, b.max_batch_size)
        if check.safe:
            log("info", "merge_checked", model=self.name, cases=check.cases,
                max_diff=check.max_diff, seconds=round(check.seconds, 3))
            return
        b.disable(check.describe())
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
        """The model metadata answer (``GET /v2/models/{name}``) of a loaded model (built at
        each call: nothing cached can outlive a change of its batching)."""
        sig = self.signature
        return {"name": self.name, "versions": ["1"], "platform": "kiln",
                "parameters": {"model_name": self.model_name, "batching": self.batching_note()},
                "inputs": sig.inputs, "outputs": sig.outputs}

    def model_config(self) -> dict:
        """The model config answer (``GET /v2/models/{name}/config``), in Triton's format: each
        input and output as ``name``, ``data_type`` (``TYPE_FP32``...) and ``dims``, without the
        batch dim when ``max_batch_size > 0`` (Triton's rule); kiln's own fields keep names of
        their own (``kiln_shape``: the full shape the metadata publishes; ``kiln_cores``: the kiln
        core of each instance, only where instances are pinned)."""
        b = self.batcher
        batched = b.max_batch_size if b.batching else 0
        meta = self.metadata()

        def entries(tensors):
            return [{"name": t["name"], "data_type": _TRITON_TYPE.get(t["datatype"], "TYPE_" + t["datatype"]),
                     "dims": list(t["shape"][1:] if batched else t["shape"]), "kiln_shape": t["shape"]}
                    for t in tensors]
        group = {"name": self.name, "count": len(self.instances), "kind": "KIND_CPU"}
        if any(c is not None for c in self.cores):
            group["kiln_cores"] = list(self.cores)
        return {"name": self.name, "platform": "kiln", "backend": "kiln",
                "max_batch_size": batched,
                "dynamic_batching": ({"max_queue_delay_microseconds": int(b.delay * 1e6),
                                      "max_queue_size": b.max_queue} if b.batching else None),
                "max_queue_size": b.max_queue,
                "instance_group": [group],
                "parameters": {"model_name": {"string_value": self.model_name},
                               "batching": {"string_value": self.batching_note()}},
                "input": entries(meta["inputs"]), "output": entries(meta["outputs"])}

    def decode(self, payload: dict, binary) -> tuple:
        """(request, rows it adds to a batch, timeout in seconds) of an infer request, checked
        by the protocol and by the model itself; raises :class:`BadRequestError`."""
        req: InferRequest = decode_request(self.signature, payload, binary, self.check_inputs)
        # rows (dim 0) whether or not requests are merged: kiln_serve_batch_size counts them
        rows = int(req.inputs[0].shape[0]) if req.inputs and req.inputs[0].dim() else 1
        timeout = self.config.timeout_s
        if req.timeout is not None:
            timeout = min(timeout, req.timeout)
        return req, rows, timeout

    def check_inputs(self, flat):
        """The model's own input check (dtypes, shapes within its buckets) as a bad request."""
        try:
            self.instances[0].check(flat)
        except InputError as e:
            raise BadRequestError(str(e)) from None

    def encode(self, outs, req: InferRequest) -> tuple:
        """(body, media type, headers) of the infer response."""
        return encode_response(self.signature, outs, req.outputs, req.id)


def warmup_inputs(model) -> list:
    """Flat inputs that run every compiled variant of ``model`` once at its compiled shapes."""
    if isinstance(model, DynamicBatch):
        return warmup_inputs(model.inner)
    if isinstance(model, Bucketed):
        return [flat for v in model.variants for flat in warmup_inputs(v)]

    def filler(spec):
        make = torch.zeros if spec.dtype.is_floating_point or spec.dtype.is_complex else torch.ones
        try:
            return make(spec.shape, dtype=spec.dtype)
        except (RuntimeError, MemoryError) as e:    # the allocator's own message names no input
            need = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            raise KilnError(f"warm-up: input {spec.name!r} of shape {list(spec.shape)} ({spec.dtype}) needs "
                            f"{need} bytes ({need / 2**30:.1f} GiB), which could not be allocated "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None
    return [[filler(s) for s in model.input_specs]]
