"""Runtime: a loaded artifact as a callable ``torch.nn.Module``.

Calls are checked against the compiled input specs, flattened, run through the
host program (device partitions on their engine, fallback ops in PyTorch) and
rebuilt into the traced output structure. Tensors cross into engines as shared
NumPy views, not copies. Several threads may call one model at once.

``Model`` is what every kiln model offers (call, ``submit``, ``map``, save,
core placement); ``CompiledModel`` is one compiled graph. Shape adapters
(buckets, dynamic batch) and pipelines wrap compiled models and are saved as
artifacts that nest theirs; ``load`` picks the class from the manifest's kind.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from concurrent.futures import Future

import torch

from kiln import engines
from kiln.artifact import schema, specs, trust
from kiln.host import cores, memory
from kiln.observe import profiler
from kiln.runtime import const_outputs, program as program_mod, value_checks
from kiln.observe import announce_model
from kiln.observe.metrics import ModelMetrics
from kiln.runtime.workers import Worker
from kiln.artifact.container import Artifact
from kiln.atomic import write_atomic
from kiln.errors import ArtifactError, InputError, KilnError
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.program import Program

HOST_CONSTANTS = "host_constants.safetensors"
DEFAULT = object()   # placement: the ``kiln.cores`` context or the process's visible cores


class Model(torch.nn.Module):
    """Call it like the original model; ``submit``/``map`` for asynchronous work.

    Subclasses provide ``flatten``, ``check``, ``run_flat``, ``output_structure``,
    ``input_specs``, ``manifest``, ``to_bytes`` and ``_place``.
    """

    _async_worker = None
    core = None
    _plain = None       # CompiledModel.flatten's fast path: the input count, when it applies
    _positional = None  # how many inputs a call may give positionally; None: every one
    # Non-finite values ("nan", "+inf", "-inf") an engine of this model was found at compile
    # time to answer differently from PyTorch (select.nonfinite_probe): refused in inputs.
    nonfinite: frozenset = frozenset()

    def forward(self, *args, **kwargs):
        flat = self.flatten(args, kwargs)
        self.check(flat)
        return specs.decode(self.output_structure, self.run_flat(flat))

    index_ranges: list = []     # (position, name, low, high, operator) of inputs that index

    def _check_values(self, flat):
        """The inputs' values (kiln.runtime.value_checks): indices in range, and no NaN or
        infinity an engine of this model answers otherwise than PyTorch."""
        if self.index_ranges:
            value_checks.check_ranges(flat, self.index_ranges)
        value_checks.check_nonfinite(flat, self.input_specs, self.nonfinite)

    # -- asynchronous calls -------------------------------------------------------
    def _executor(self) -> Worker:
        if self._async_worker is None:
            with _worker_lock:
                if self._async_worker is None:
                    object.__setattr__(self, "_async_worker", Worker(name=f"kiln-{self.name}"))
        return self._async_worker

    def submit(self, *args, **kwargs) -> Future:
        """Start a call and return its ``concurrent.futures.Future``.

        Calls submitted to one model run in submission order; bad inputs fail
        the future with the same error a direct call raises.
        """
        try:
            flat = self.flatten(args, kwargs)
            self.check(flat)
        except KilnError as e:
            fut: Future = Future()
            fut.set_exception(e)
            return fut
        return self._submit_flat(flat)

    def _submit_flat(self, flat) -> Future:
        """Start a call on checked flat inputs; models that stream (pipelines) override this."""
        return self._executor().submit(
            lambda: specs.decode(self.output_structure, self.run_flat(flat)))

    def map(self, inputs, max_in_flight: int = 4):
        """Run every item of ``inputs`` (a tensor, a tuple of positional inputs or
        a dict of keyword inputs), yielding results in order with at most
        ``max_in_flight`` calls submitted and not yet consumed."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        pending: collections.deque = collections.deque()
        for item in inputs:
            if isinstance(item, dict):
                pending.append(self.submit(**item))
            elif isinstance(item, (tuple, list)):
                pending.append(self.submit(*item))
            else:
                pending.append(self.submit(item))
            if len(pending) >= max_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    # -- placement -----------------------------------------------------------------
    def to_core(self, core_id: int):
        """Run this model only on kiln core ``core_id``'s CPUs; returns the model."""
        self._place(cores.get(core_id))
        return self

    # -- persistence ------------------------------------------------------------------
    def save(self, f, _extra_files=None):
        """Write the ``.kiln`` artifact (atomically).

        ``torch.jit.save(compiled, path)`` calls this with ``_extra_files``;
        then a TorchScript archive is written instead, whose module runs the
        embedded artifact through the ``kiln::run`` op.
        """
        if _extra_files is not None:
            from kiln.runtime.torchscript import to_torchscript
            return to_torchscript(self).save(f, _extra_files=_extra_files)
        data = self.to_bytes()
        if hasattr(f, "write"):
            f.write(data)
            return None
        path = str(f)
        write_atomic(path, lambda out: out.write(data))
        return path

    def save_to_buffer(self, _extra_files=None) -> bytes:
        """TorchScript bytes (``torch.jit.save`` to a file object calls this)."""
        from kiln.runtime.torchscript import to_torchscript
        return to_torchscript(self).save_to_buffer(_extra_files=_extra_files or {})

    @property
    def name(self) -> str:
        return self.manifest.get("model_name", "model")

    @property
    def report(self):
        return self.manifest.get("report")

    @property
    def cache_key(self):
        """The compile-cache key this model was stored under (None when compiled uncached)."""
        return (self.manifest.get("cache") or {}).get("key")

    def close(self):
        """Stop this model's worker threads (also done when it is garbage-collected)."""
        for attr in ("_async_worker", "_worker"):
            worker = self.__dict__.get(attr)
            if worker is not None:
                worker.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_worker_lock = threading.Lock()


class CompiledModel(Model):
    """One compiled graph: device partitions on engines, fallback ops on the host."""

    def __init__(self, artifact: Artifact, runtime_options: RuntimeOptions | None = None,
                 source: str = "artifact", core=DEFAULT, worker=None, *, loaded=None):
        super().__init__()
        memory.keep_freed_memory()      # a compiled step's buffers stay mapped between calls
        artifact.check_host(source)
        schema.check_model(artifact.manifest, artifact.blobs, source)
        self._artifact = artifact
        self._source = source
        self.runtime_options = runtime_options or RuntimeOptions()
        m = artifact.manifest
        self.manifest = m
        self.arg_names = m["inputs"]["args"]
        self.input_structure = m["inputs"]["structure"]
        self.input_specs = [specs.TensorSpec.from_dict(d) for d in m["inputs"]["tensors"]]
        self.output_structure = m["outputs"]["structure"]
        self.output_specs = [specs.TensorSpec.from_dict(d) for d in m["outputs"]["tensors"]]
        self._checks = [(s.name, tuple(s.shape), s.dtype) for s in self.input_specs]
        # what a call that passed the checks hands over, for the metrics (shapes are static)
        self._in_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self._checks)
        self._plain = specs.positional_tensors(self.input_structure, self.arg_names)
        # the traced inputs a call may give positionally (kiln.graph.positional.prefix);
        # absent (artifacts before 12-03, *args): every one, in order
        self._positional = m["inputs"].get("positional")
        if self._positional is not None and self._positional < len(self.arg_names):
            self._plain = None
        self.nonfinite = frozenset(k for p in m["partitions"] for k in p.get("nonfinite", ()))
        self.index_ranges = value_checks.ranges(m["inputs"]["tensors"])
        # CUDA artifacts take inputs on the CPU or the GPU and answer on the same device.
        self._devices = ("cpu", "cuda") if m.get("target", {}).get("device") == "cuda" else ("cpu",)
        self._worker = None
        self._constants = {}
        if HOST_CONSTANTS in artifact.blobs:
            from safetensors import SafetensorError
            from safetensors.torch import load as st_load
            try:
                self._constants = st_load(bytes(artifact.blobs[HOST_CONSTANTS]))
            except SafetensorError as e:
                raise ArtifactError(f"{source}: {HOST_CONSTANTS} cannot be read ({e})") from None
        program_mod.verify(m["program"], self._constants, self.input_specs,
                           [([specs.TensorSpec.from_dict(d) for d in p["inputs"]],
                             [specs.TensorSpec.from_dict(d) for d in p["outputs"]])
                            for p in m["partitions"]], self.output_specs, source)
        # A CUDA artifact's program runs on the GPU whoever calls it: host constants there,
        # CPU inputs moved in and outputs moved back (_on_gpu). Partitions alone would send
        # their outputs wherever their first input was, a constant's CPU for one, and the
        # host operations after them would meet tensors on two devices.
        self._gpu = None
        if len(self._devices) > 1 and torch.cuda.is_available():
            self._gpu = torch.device("cuda", torch.cuda.current_device())
            self._constants = {k: v.to(self._gpu) for k, v in self._constants.items()}
        self._held = const_outputs.storages(self._constants)    # outputs sharing these are copied
        self.program = None
        if core is DEFAULT:
            core = resolve_placement()
        if core is not None:
            self._place(core, worker)
        else:
            self.program = self._build_program(self.runtime_options, loaded)
        self._host_ops = bool(self.program.host_ops() or not m["partitions"])
        self.metrics = ModelMetrics(self.name)
        self.metrics.core = self.core.id if getattr(self, "core", None) is not None else None
        announce_model(self.metrics)   # now kiln.metrics(), kiln ls and KILN_PROFILE see it
        self._labels = self.program.labels([p["engine"] for p in m["partitions"]])
        self.cuda_graph = self._cuda_graph()

    def _cuda_graph(self):
        """A CUDA artifact's calls replay as a captured CUDA graph (kiln.runtime.cuda_graphs),
        unless turned off; None on CPUs."""
        if self._gpu is None or not self.runtime_options.resolved_cuda_graphs():
            return None
        from kiln.runtime.cuda_graphs import GraphedProgram
        return GraphedProgram(lambda: self._build_program(self.runtime_options), self._gpu,
                              name=f"model '{self.name}'")

    def _on_gpu(self, flat):
        """(``flat`` on the GPU, the device the outputs go back to or None) for a CUDA artifact."""
        if all(t.is_cuda for t in flat if isinstance(t, torch.Tensor)):
            return flat, None
        first = flat[0] if flat and isinstance(flat[0], torch.Tensor) else None
        home = first.device if first is not None and not first.is_cuda else None
        return [t.to(self._gpu) if isinstance(t, torch.Tensor) and not t.is_cuda else t for t in flat], home

    # -- calling ----------------------------------------------------------------
    def flatten(self, args, kwargs) -> list:
        if self._plain is not None and not kwargs and len(args) == self._plain \
                and all(type(a) is torch.Tensor for a in args):
            return list(args)       # every input a bare tensor, given in order (an LLM step's 63)
        names = self.arg_names
        # ``*args`` entries are named ``args[0]``, ``args[1]``...; names after the last one
        # are keyword-only (or **kwargs) in the model and are not taken positionally.
        star = [i for i, n in enumerate(names) if n.endswith("]") and "[" in n]
        limit = star[-1] + 1 if star else len(names)
        if len(args) > limit:
            what = "input(s)" if limit == len(names) else "positional input(s)"
            raise InputError(f"{self.name} takes {limit} {what} ({', '.join(names[:limit])}), "
                             f"got {len(args)} positional")
        value_checks.positional(self.name, names, self._positional, len(args))
        bound = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in bound:
                raise InputError(f"input '{k}' given twice")
            if k not in names:
                if value_checks.explicit_default(k, v, getattr(self, "manifest", None) or {}):
                    continue         # the traced default, given explicitly: the graph's own value
                raise InputError(f"unexpected input '{k}'; the model was compiled with inputs "
                                 f"{', '.join(names)}")
            bound[k] = v
        flat: list = []
        for name, structure in self.input_structure["dict"]:
            if name not in bound:
                if "none" in structure:
                    continue
                raise InputError(f"missing input '{name}': expected "
                                 f"{specs.describe(structure, self.input_specs)}")
            specs.flatten_inputs(structure, bound[name], name, flat, self.input_specs)
        return flat

    def check(self, flat):
        if len(flat) != len(self._checks):
            raise InputError(f"expected {len(self._checks)} input tensors, got {len(flat)}")
        if all(t.shape == shape and t.dtype == dtype and t.is_cpu
               for t, (_, shape, dtype) in zip(flat, self._checks)):
            self._check_values(flat)     # the common case, without a device object per input
            return
        for t, (name, shape, dtype) in zip(flat, self._checks):
            if t.shape != shape or t.dtype != dtype:
                raise InputError(
                    f"input '{name}': expected {shape} {specs.dtype_name(dtype)}, got "
                    f"{tuple(t.shape)} {specs.dtype_name(t.dtype)}")
            if t.device.type not in self._devices:
                where = " or a CUDA" if len(self._devices) > 1 else ""
                raise InputError(f"input '{name}': expected a CPU{where} tensor, got one on {t.device}")
        self._check_values(flat)

    def _build_program(self, runtime_options, loaded=None) -> Program:
        """``loaded``: ``(options, runners)``, the partitions as the compiler's checks loaded
        them, used where the program would load them with the same options: a compile then
        loads each build once, for its check, not a second time for the model it returns."""
        parts = self.manifest["partitions"]
        used = [engines.get(part["engine"], purpose="load") for part in parts]
        steps = self.manifest["program"].get("steps", [])
        if len(parts) > 1 or any("partition" not in step for step in steps):
            runtime_options = dataclasses.replace(runtime_options, spin=False)   # engines take turns
        native = [part for part, engine in zip(parts, used) if engine.native_code]
        if native:   # before any engine loads anything
            trust.require(self._artifact, native, self._source)
        if loaded is not None and (loaded[0] != runtime_options or len(loaded[1]) != len(parts)):
            loaded = None
        runners = []
        # only graphs that read an enclosing artifact's members (an LLM's shared weights) pass
        # the lookup, so engines written to the contract before it still load everything else
        shared = {"shared": self._artifact.shared} if self.manifest.get("shared_blobs") else {}
        for i, (part, engine) in enumerate(zip(parts, used)):
            if loaded is not None and loaded[1][i] is not None:
                runners.append(loaded[1][i])
                _check_signature(runners[-1], part, self._source)
                continue
            try:
                runners.append(engine.load(self._artifact.blobs[part["blob"]], runtime_options,
                                           origin=self._artifact.origin(part["blob"]), **shared))
            except KilnError:
                raise
            except Exception as e:
                raise ArtifactError(f"{self._source}: engine {part['engine']} could not load "
                                    f"partition {part.get('id')}: {e}") from e
            _check_signature(runners[-1], part, self._source)
        return Program(self.manifest["program"], self._constants, runners)

    def _place(self, core, worker=None):
        """Reload the engines on a worker pinned to ``core``'s CPUs (their thread
        pools inherit the pin), with one engine thread per CPU."""
        worker = worker or Worker(core.cpus, name=f"kiln-core{core.id}")
        opts = dataclasses.replace(self.runtime_options, cpus=core.cpus)
        program = worker.call(self._build_program, opts)
        old = self._worker
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "core", core)
        if getattr(self, "metrics", None) is not None:
            self.metrics.core = core.id
        if old is not None and old is not worker:
            old.close()

    def _executor(self):
        return self._worker or super()._executor()

    def take_turns(self):
        """Reload the engines for a graph that takes turns with host work (a
        ``torch.compile`` graph between eager operations, a device's program between
        steps being recorded): their threads must not busy-wait between calls, or they
        take the CPUs from that work (measured: a BERT training step under
        ``torch.compile(backend="kiln")``, 328 -> 270 ms on 2 cores)."""
        # on a GPU it is called with new activations and parameters each time: uncaptured
        # (a captured graph would copy every parameter in on every call)
        self.cuda_graph = None
        if not self.runtime_options.spin:
            return
        self.runtime_options = dataclasses.replace(self.runtime_options, spin=False)
        if self._worker is not None:
            self._place(self.core, self._worker)
        else:
            object.__setattr__(self, "program", self._build_program(self.runtime_options))

    @property
    def worker(self):
        """The pinned worker thread running this model, when it is placed on a core."""
        return self._worker

    def run_flat(self, flat: list) -> list:
        """Run on flat, already checked input tensors; returns flat outputs."""
        worker = self._worker
        if worker is not None:
            return worker.call(self._run_flat, flat)
        return self._run_flat(flat)

    def _run_flat(self, flat: list) -> list:
        rec = profiler.active()
        traced = rec is not None or profiler.torch_profiling()
        start = time.perf_counter()
        try:
            graph = self.cuda_graph if not traced else None
            outs = graph([t.detach() for t in flat]) if graph is not None else None
            device = host = None
            if outs is None:
                run, home = self._on_gpu(flat) if self._gpu is not None else (flat, None)
                if self._host_ops or traced:
                    # step by step: host fallback time is counted apart, and profiles get spans
                    span = _span_sink(rec, self.name) if rec is not None else None
                    scope = _torch_scope(self.name) if traced and profiler.torch_profiling() else None
                    with torch.no_grad():
                        outs, device, host = self.program.run_timed(run, self._labels, span, scope)
                else:  # engines never record autograd; skip the grad-mode switch
                    outs = self.program([t.detach() if t.requires_grad else t for t in run])
                if home is not None:
                    outs = [o.to(home) if isinstance(o, torch.Tensor) else o for o in outs]
                if self._held:
                    outs = const_outputs.fresh(outs, self._held)
        except BaseException:
            self.metrics.record_failure()
            raise
        end = time.perf_counter()
        self.metrics.record_call(end - start, self._in_bytes, outs, device, host)
        if rec is not None:
            core = self.core.id if self.core is not None else None
            rec.span(f"{self.name}", "call", start, end, {"core": core, "model": self.name})
        return outs

    @property
    def calls(self) -> int:
        """Completed calls so far."""
        return self.metrics.completed

    # -- persistence -------------------------------------------------------------
    def save(self, f, _extra_files=None):
        if _extra_files is None and not hasattr(f, "write"):
            return self._artifact.self_contained().save(f)
        return super().save(f, _extra_files)

    def to_bytes(self) -> bytes:
        # self-contained: a graph of an LLM whose weights lie in the LLM's file takes them along
        return self._artifact.self_contained().to_bytes()

    def __repr__(self):
        parts = self.manifest["partitions"]
        host = len(self.program.host_ops())
        ins = ", ".join(f"{s.name}: {s.describe()}" for s in self.input_specs)
        return (f"kiln.CompiledModel({self.name}; inputs {ins}; {len(parts)} device partition(s) "
                f"on {', '.join(sorted({p['engine'] for p in parts})) or 'none'}, {host} host op(s))")


def _check_signature(runner, part, source):
    """The engine's own account of a partition (for engines that give one) must agree with
    the manifest's, which the host program and the input checks rely on."""
    signature = getattr(runner, "signature", None)
    if signature is None:
        return
    for side, declared in zip(("inputs", "outputs"), signature()):
        specs_ = [specs.TensorSpec.from_dict(d) for d in part[side]]
        if len(declared) != len(specs_):
            raise ArtifactError(f"{source}: partition {part.get('id')} has {len(declared)} {side} in "
                                f"its {part['engine']} blob but {len(specs_)} in the manifest; the "
                                "artifact is corrupt or was edited")
        if side == "outputs":
            continue        # what a call is fed is what must match; engines may widen outputs
        for j, ((shape, dtype), s) in enumerate(zip(declared, specs_)):
            if (shape is not None and shape != tuple(s.shape)) or (dtype is not None and dtype != s.dtype):
                raise ArtifactError(
                    f"{source}: partition {part.get('id')} input {j} is {shape} {dtype} in its "
                    f"{part['engine']} blob but {s.describe()} in the manifest; the artifact is "
                    "corrupt or was edited")


def _span_sink(rec, model_name):
    """Per-step callback into kiln's recorder; host fallback steps are flagged."""
    def span(cat, label, start, end):
        rec.span(label, cat, start, end, {"model": model_name, "host_fallback": cat == "host"})
    return span


def _torch_scope(model_name):
    """Under torch.profiler, each step runs inside a ``kiln::<model>::<step>`` range."""
    def scope(label):
        return torch.profiler.record_function(f"kiln::{model_name}::{label}")
    return scope


def resolve_placement():
    """Where a new model runs: the ``kiln.cores`` context's core; else, with
    KILN_VISIBLE_CORES/KILN_NUM_CORES set, the union of the visible cores' CPUs;
    else wherever the process runs (None)."""
    core = cores.default_placement()
    if core is not None or not cores.restricted():
        return core
    return cores.Core(-1, -1, cores.union(cores.visible()))




