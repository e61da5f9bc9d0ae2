"""Pipeline: one model's graph split into stages over several kiln cores.

Neuron's ``--neuroncore-pipeline-cores N`` shards a model's layers over N
NeuronCores and streams requests through them, so a model too slow (or too
big) for one core gets N cores' throughput without N copies of its weights.
kiln does the same with kiln cores:

* the model is captured once and every graph node is timed on the example
  inputs, because balancing by node count would put a cheap ``view`` on a par
  with a large matmul;
* the nodes, in topological order, are cut into N contiguous stages that
  minimise the slowest stage (the pipeline's throughput is one request per
  slowest stage); among cuts within a measurement-noise margin of the best,
  the one with the fewest tensors crossing stage boundaries wins;
* each stage is compiled as an ordinary kiln model and placed on its own core;
* a request runs stage 1 on core 0's worker, which then hands it to core 1's
  worker and takes the next request, so with several requests in flight every
  core is busy with a different one (engines release the GIL).

The artifact nests one ``.kiln`` per stage plus the wiring (which values each
stage consumes), so loading needs neither the model nor its source.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError

from kiln.artifact import schema, specs
from kiln.artifact.container import Artifact
from kiln.errors import CompilerArgsError, KilnError
from kiln.host import cores as placement
from kiln.errors import PlacementError
from kiln.runtime import value_checks
from kiln.runtime.workers import Worker
from kiln.runtime.model import DEFAULT, CompiledModel, Model


# -- runtime -----------------------------------------------------------------------------------
class _Request:
    __slots__ = ("flat", "produced", "outer", "prev", "decode")

    def __init__(self, flat, n, outer, prev, decode):
        self.flat = flat
        self.produced = [None] * n
        self.outer = outer
        self.prev = prev
        self.decode = decode


class Pipeline(Model):
    """Stages of one model on consecutive kiln cores, with requests streamed
    through them; see the module docstring."""

    # Same calling convention and the same input errors as a single compiled model.
    flatten = CompiledModel.flatten
    check = CompiledModel.check

    def __init__(self, stages, manifest: dict, core=DEFAULT):
        super().__init__()
        self.stages = list(stages)
        self.manifest = manifest
        meta = manifest["pipeline"]
        self.arg_names = manifest["inputs"]["args"]
        self.input_structure = manifest["inputs"]["structure"]
        self.input_specs = [specs.TensorSpec.from_dict(d) for d in manifest["inputs"]["tensors"]]
        self._positional = manifest["inputs"].get("positional")
        self.output_structure = manifest["outputs"]["structure"]
        self.output_specs = [specs.TensorSpec.from_dict(d) for d in manifest["outputs"]["tensors"]]
        self._checks = [(s.name, tuple(s.shape), s.dtype) for s in self.input_specs]
        self.nonfinite = frozenset().union(*(s.nonfinite for s in self.stages))
        self._devices = ("cpu",)            # pipelines run on CPU kiln cores
        self._stage_inputs = [[tuple(r) for r in st["inputs"]] for st in meta["stages"]]
        self._outputs = [tuple(r) for r in meta["outputs"]]
        self.index_ranges = self._index_ranges()
        self._drops = self._release_plan()
        self._lock = threading.Lock()       # the call counter
        self._order = threading.RLock()     # entry order; re-entered by submit() from a callback
        self._last: Future | None = None
        self._stats = [0]
        self._closed = False
        if isinstance(core, placement.Core):
            if any(s.core != core or s.worker is not self.stages[0].worker for s in self.stages):
                self._place(core)
            object.__setattr__(self, "core", core)
        else:
            targets = stage_cores(len(self.stages), "place a pipeline of")
            for stage, target in zip(self.stages, targets):
                here = stage.core
                if stage.worker is None or here is None or tuple(here.cpus) != tuple(target.cpus):
                    stage._place(target)

    def _index_ranges(self) -> list:
        """The pipeline's inputs that index, as the stages they reach check them: stages run
        unchecked (run_flat), so a token id past the vocabulary would otherwise reach an engine,
        which answers it (OpenVINO with zeros) where eager raises IndexError."""
        found = list(value_checks.ranges(self.manifest["inputs"]["tensors"]))
        for refs, stage in zip(self._stage_inputs, self.stages):
            for pos, _, low, high, what, exempt in getattr(stage, "index_ranges", None) or ():
                r = refs[pos] if pos < len(refs) else None
                if r is not None and r[0] == "input":
                    entry = (r[1], self.input_specs[r[1]].name, low, high, what, exempt)
                    if entry not in found:
                        found.append(entry)
        return found

    def _release_plan(self) -> list:
        """After stage k, which earlier outputs no request needs any more: a long
        pipeline would otherwise hold every intermediate activation of every
        request in flight."""
        last: dict = {}
        for k, refs in enumerate(self._stage_inputs):
            for r in refs:
                if r[0] == "stage":
                    last[(r[1], r[2])] = k
        keep = {(r[1], r[2]) for r in self._outputs if r[0] == "stage"}
        drops: list = [[] for _ in self.stages]
        for k, st in enumerate(self.manifest["pipeline"]["stages"]):
            for j in range(st["num_outputs"]):
                if (k, j) not in keep:
                    drops[last.get((k, j), k)].append((k, j))
        return drops

    # -- calling ---------------------------------------------------------------------------
    def _submit_flat(self, flat) -> Future:
        """A submitted call enters stage 1 at once and does not wait for earlier
        calls to leave the pipeline. Futures resolve in submission order; a call
        that fails in a stage fails only its own future."""
        return self._stream(flat, decode=True)

    def run_flat(self, flat: list) -> list:
        """Run on flat, already checked inputs: stream and wait."""
        if threading.get_native_id() in {s.worker.native_id for s in self.stages if s.worker}:
            raise KilnError(f"{self.name}: a pipeline cannot be called and waited on from its "
                            "own stage thread (e.g. in a done-callback of one of its futures); "
                            "that would deadlock. Use submit() there")
        return self._stream(list(flat), decode=False).result()

    def _stream(self, flat, decode) -> Future:
        if self._closed:
            raise KilnError(f"{self.name}: the pipeline is closed")
        outer: Future = Future()
        with self._order:   # requests enter stage 1 in the order of the resolution chain
            req = _Request(flat, len(self.stages), outer, self._last, decode)
            self._last = outer
            self._enter(0, req)
        return outer

    def _enter(self, k, req):
        """Queue ``req`` on stage k's worker. Never blocks, so stage k-1's worker
        calls it and goes straight on to its next request."""
        try:
            self.stages[k].worker.submit(self._step, k, req)
        except Exception as e:  # noqa: BLE001 - belongs to this request only
            self._settle(req, None, e)

    def _step(self, k, req):
        """Stage k of one request, on stage k's worker; then hand the request on.
        Workers run FIFO and each hands on in the order it ran, so requests
        stay in submission order through every stage."""
        try:
            if req.outer.cancelled():
                return self._settle(req, None, None)
            ins = [req.flat[r[1]] if r[0] == "input" else req.produced[r[1]][r[2]]
                   for r in self._stage_inputs[k]]
            req.produced[k] = list(self.stages[k].run_flat(ins))
            for j, i in self._drops[k]:
                req.produced[j][i] = None
            if k + 1 < len(self.stages):
                return self._enter(k + 1, req)
            outs = [req.flat[r[1]] if r[0] == "input" else req.produced[r[1]][r[2]]
                    for r in self._outputs]
            result = specs.decode(self.output_structure, outs) if req.decode else outs
        except BaseException as e:  # noqa: B036 - fails this request, not the worker
            return self._settle(req, None, e)
        with self._lock:
            self._stats[0] += 1
        self._settle(req, result, None)

    def _settle(self, req, result, exc):
        """Resolve ``req`` once every earlier request is resolved, so callers see
        results in submission order even when an early request fails fast."""
        outer = req.outer
        req.flat = req.produced = None

        def resolve():
            try:
                if exc is not None:
                    outer.set_exception(exc)
                elif not outer.cancelled():
                    outer.set_result(result)
            except InvalidStateError:   # cancelled meanwhile
                pass

        prev, req.prev = req.prev, None
        if prev is None:
            resolve()
        else:
            prev.add_done_callback(_Once(resolve))

    @property
    def calls(self) -> int:
        """Completed calls so far."""
        return self._stats[0]

    # -- placement ---------------------------------------------------------------------------
    @property
    def stage_cores(self) -> list:
        return [s.core for s in self.stages]

    def _place(self, core, worker=None):
        """All stages on one core, sharing one worker (``to_core``): it still runs,
        stage after stage, but no longer in parallel."""
        worker = worker or Worker(core.cpus, name=f"kiln-core{core.id}")
        for s in self.stages:
            s._place(core, worker)
        object.__setattr__(self, "core", core)

    # -- persistence -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        blobs = {st["blob"]: s.to_bytes()
                 for st, s in zip(self.manifest["pipeline"]["stages"], self.stages)}
        return Artifact(self.manifest, blobs).to_bytes()

    def close(self):
        self._closed = True
        for s in self.__dict__.get("stages", ()):
            s.close()
        super().close()

    def __repr__(self):
        meta = self.manifest["pipeline"]["stages"]
        where = ", ".join(str(c.id) if c is not None else "?" for c in self.stage_cores)
        shares = "/".join(f"{100 * st['cost_share']:.0f}%" for st in meta)
        ins = ", ".join(f"{s.name}: {s.describe()}" for s in self.input_specs)
        return (f"kiln.Pipeline({self.name}; inputs {ins}; {len(self.stages)} stages on cores "
                f"{where}; cost shares {shares})")


class _Once:
    """A done-callback that lets go of its function after running it: resolved
    futures keep their callbacks, and each request's callback would otherwise
    keep the next request (and its tensors) alive."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, _):
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def load_pipeline(art, opts, source, core=DEFAULT, worker=None, load_nested=None):
    meta = schema.check_pipeline(art.manifest, art.blobs, source)
    n = len(meta["stages"])
    if isinstance(core, placement.Core):
        targets = [core] * n
        worker = worker or Worker(core.cpus, name=f"kiln-core{core.id}")
    else:
        targets = stage_cores(n, "load a pipeline of")
        worker = None
    stages = []
    for st, target in zip(meta["stages"], targets):
        where = f"{source}:{st['blob']}"
        stages.append(load_nested(art.nested(st["blob"], where), opts, where,
                                    core=target, worker=worker))
    _check_stages(meta, stages, art.manifest, source)
    pipe = Pipeline(stages, art.manifest, core=core if isinstance(core, placement.Core) else DEFAULT)
    return pipe


def _check_stages(meta, stages, manifest, source):
    """What the pipeline metadata feeds each stage (run unchecked) must fit it."""
    fail = schema.Fail(source)
    inputs = [specs.TensorSpec.from_dict(d) for d in manifest["inputs"]["tensors"]]
    outputs = [specs.TensorSpec.from_dict(d) for d in manifest["outputs"]["tensors"]]

    def spec_of(r):
        return inputs[r[1]] if r[0] == "input" else stages[r[1]].output_specs[r[2]]

    for k, (st, stage) in enumerate(zip(meta["stages"], stages)):
        p = f"pipeline.stages[{k}]"
        if st["num_outputs"] != len(stage.output_specs):
            fail(f"{p}.num_outputs", f"is {st['num_outputs']}, the stage has {len(stage.output_specs)}")
        if len(st["inputs"]) != len(stage.input_specs):
            fail(f"{p}.inputs", f"feeds {len(st['inputs'])} tensors to a stage that takes "
                 f"{len(stage.input_specs)}")
        for j, (r, want) in enumerate(zip(st["inputs"], stage.input_specs)):
            if not schema.same_spec(spec_of(r), want):
                fail(f"{p}.inputs[{j}]", f"is {spec_of(r).describe()}, the stage takes {want.describe()}")
    for j, (r, want) in enumerate(zip(meta["outputs"], outputs)):
        if not schema.same_spec(spec_of(r), want):
            fail(f"pipeline.outputs[{j}]", f"is {spec_of(r).describe()}, outputs.tensors[{j}] says "
                 f"{want.describe()}")




def stage_cores(n: int, what: str) -> list:
    """The cores stages 0..n-1 go to; a pipeline wider than the process is an error,
    not a silent doubling-up, because two stages on one core just take turns."""
    visible = placement.visible()
    if n < 1:
        raise CompilerArgsError(f"pipeline cores must be at least 1, got {n}")
    if n > len(visible):
        fix = ("use at most" if what.startswith("compile") else "recompile it with at most")
        raise PlacementError(
            f"cannot {what} {n} stages: a pipeline needs one kiln core per stage and this process "
            f"sees {len(visible)} ({'; '.join(str(c) for c in visible)}). Make more cores visible "
            f"(KILN_VISIBLE_CORES, KILN_NUM_CORES, KILN_CPUS_PER_CORE) or {fix} {len(visible)} "
            "pipeline cores")
    return visible[:n]
