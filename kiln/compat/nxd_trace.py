"""NxD's ``trace.parallel_model_trace`` / ``parallel_model_save`` / ``parallel_model_load``.

NxD traces a tensor-parallel model by spawning ``tp_degree`` workers; each builds the
model with ``func()`` after its parallel state exists (so the parallel layers cut their
weights for that rank), compiles it, and the returned ``TensorParallelNeuronModel`` runs
every rank on each call and returns rank 0's output. kiln does the same with its own
pieces:

* the ranks are processes pinned to their own kiln cores
  (:func:`kiln.distributed.launch.start_ranks`); *this* process is rank 0, the others
  import this module and run :func:`rank_main`;
* each rank calls ``initialize_model_parallel(tp_degree)`` and ``func()``, then
  :func:`kiln.trace` with a one-thread stand-in (:class:`~kiln.distributed.groups.SoloGroup`)
  bound to ``"tp"``: the compiler's check of the graph against eager then covers this
  rank's engine partitions without the ranks having to meet inside the compiler (the
  collectives are host steps between partitions that look ``"tp"`` up when they run);
  afterwards ``"tp"`` is the real group again, and the ranks' assembled output is what
  the tests compare with the unsharded model;
* a call sends the inputs to every rank over a command group of its own (as
  :class:`kiln.runtime.lockstep.ProcessChannel` does), every rank runs its compiled model
  (the all-reduces meet in the graphs' host steps), and rank 0's output is returned.

A failed call is an error for that call, never the end of the model:

* rank 0 checks the inputs (names, shapes, dtypes, values: what a one-process kiln model
  checks) before the other ranks hear of the call, so a wrong-shaped call is the same
  :class:`~kiln.errors.InputError` and no rank runs anything;
* every command ends with the ranks telling rank 0 whether it failed on them (one small
  all-reduce, and the errors only when there are some), and a rank keeps serving after
  a failure: an error raised on another rank is an :class:`NxDTraceError` naming each
  failed rank and its error;
* the ranks are in step after a failure when each started as many collectives in the
  call as the others (they are counted): then the model keeps working. Otherwise (an
  error on some ranks only, before a collective the others waited in: the waiting ranks
  give up at the collective timeout, ``launch.start_ranks``'s, and the failed rank says
  at once on its stderr that they may be waiting) the model is stopped with an error
  saying so, and later calls say why it stopped.

``func`` runs in the children by import path, as NxD's workers import it: it must be a
module-level function. A function of the script that was run (``__main__``) is imported
in the children from the script's file under another module name, so - exactly as NxD
requires - the script must keep its work under ``if __name__ == "__main__":``.

Saved models are TorchScript (``torch.jit.save`` of each rank's compiled model, which
calls the ``kiln::run`` op): ``save_dir/tp_{rank}.pt``, loadable by
:func:`parallel_model_load` (which starts the ranks again, each loading its own file).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import torch

from kiln.errors import CompilerArgsError, InputError, KilnError

__all__ = ["TensorParallelNeuronModel", "parallel_model_trace", "parallel_model_save",
           "parallel_model_load", "rank_main"]

_ENTRY = "kiln.compat.nxd_trace:rank_main"
_MAIN_ALIAS = "__kiln_nxd_main__"


class NxDTraceError(KilnError):
    """A rank failed to build, compile, load or run its part of the model."""


# -- options ------------------------------------------------------------------------------
def _check_options(tp_degree, states, inline_weights_to_neff, bucket_config, max_parallel_compilations,
                   spmd_mode, checkpoint_loader_callable, force_custom_init_on_device, serialization_path):
    if not isinstance(tp_degree, int) or isinstance(tp_degree, bool) or tp_degree < 1:
        raise CompilerArgsError(f"parallel_model_trace: tp_degree={tp_degree!r}; expected an int >= 1")
    refused = {
        "states": (states is not None, "kiln's compiled models carry no extra states; leave it None"),
        "bucket_config": (bucket_config is not None, "bucketing is not supported by kiln's parallel_model_trace; "
                          "trace one model per shape"),
        "spmd_mode": (bool(spmd_mode), "kiln compiles each rank's own graph (spmd_mode=False)"),
        "checkpoint_loader_callable": (checkpoint_loader_callable is not None,
                                       "load weights inside func (e.g. parallel_layers.load(path, model, "
                                       "sharded=False))"),
        "force_custom_init_on_device": (bool(force_custom_init_on_device), "leave it False"),
        "serialization_path": (serialization_path is not None, "use parallel_model_save(model, dir) instead"),
        "inline_weights_to_neff": (inline_weights_to_neff is not True,
                                   "kiln's artifacts always hold their weights; leave it True"),
    }
    for name, (bad, advice) in refused.items():
        if bad:
            raise CompilerArgsError(f"parallel_model_trace: {name} is not supported by kiln: {advice}")
    if max_parallel_compilations is not None and (not isinstance(max_parallel_compilations, int)
                                                  or max_parallel_compilations < tp_degree):
        raise CompilerArgsError(
            f"parallel_model_trace: max_parallel_compilations={max_parallel_compilations!r}: kiln compiles "
            f"every rank at once, each in its own process on its own cores; leave it None (or >= tp_degree)")


def _func_ref(func) -> dict:
    """How a child finds ``func``: its module (or the script's file) and its name."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", "")
    if not callable(func) or module is None or "<" in qualname:
        raise InputError(
            f"parallel_model_trace: func {func!r} is not a module-level function. NxD's rule: func runs in "
            "each worker process, which imports it, so define it at the top level of a module or script "
            "(not a lambda, a local function or a method of an instance)")
    ref = {"module": module, "qualname": qualname, "file": None}
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise InputError("parallel_model_trace: func is defined in an interactive session (__main__ has no "
                             "file); the workers cannot import it. Put func in a module or a script file, with "
                             "the trace under `if __name__ == \"__main__\":`")
        ref["file"] = os.path.abspath(path)
    return ref


def _resolve_func(ref: dict):
    if ref["file"] is None:
        obj = importlib.import_module(ref["module"])
    elif ref["module"] == "__main__" and os.path.abspath(getattr(sys.modules["__main__"], "__file__", "") or
                                                         "") == ref["file"]:
        obj = sys.modules["__main__"]                   # rank 0: the script itself
    else:
        obj = sys.modules.get(_MAIN_ALIAS)
        if obj is None:       # a child: the script imported under another name (its main block stays off)
            spec = importlib.util.spec_from_file_location(_MAIN_ALIAS, ref["file"])
            obj = importlib.util.module_from_spec(spec)
            sys.modules[_MAIN_ALIAS] = obj
            spec.loader.exec_module(obj)
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


# -- one rank -------------------------------------------------------------------------------
def _build(payload: dict, rank: int):
    """Build and compile this rank's model (module doc)."""
    import kiln.distributed.ops  # noqa: F401 - registers torch.ops.kiln.*
    from kiln.compiler.api import trace
    from kiln.distributed import state
    tp = payload["tp_degree"]
    state.initialize_model_parallel(tp)
    built = _resolve_func(payload["func"])()
    module, aliases = built if isinstance(built, tuple) and len(built) == 2 else (built, {})
    if not isinstance(module, torch.nn.Module):
        raise InputError(f"parallel_model_trace: func() returned {type(module).__name__}; expected "
                         "(torch.nn.Module, input_output_aliases)")
    if aliases:
        raise CompilerArgsError("parallel_model_trace: func() returned input_output_aliases; kiln does not "
                                "support aliased (in-place state) outputs: return (module, {})")
    module.eval()
    from kiln.distributed import groups
    with groups.registered("tp", groups.SoloGroup(tp, rank)), torch.no_grad():
        return trace(module, payload["example_inputs"], compiler_args=payload["compiler_args"],
                     quiet=True)


def _load(payload: dict, rank: int):
    from kiln.runtime import script_op      # registers the kiln::run op the TorchScript calls
    import kiln.distributed.ops  # noqa: F401
    from kiln.distributed import state
    state.initialize_model_parallel(payload["tp_degree"])
    module = torch.jit.load(os.path.join(payload["model_dir"], f"tp_{rank}.pt"))
    script_op.model_for(module.artifact)     # loaded now on every rank, not in its first call
    return module


def _setup(payload: dict, rank: int):
    """Build or load this rank's model and report to every rank whether all succeeded."""
    import torch.distributed as dist
    model, error = None, None
    try:
        model = _build(payload, rank) if payload["mode"] == "trace" else _load(payload, rank)
    except Exception as e:  # noqa: BLE001 - told to every rank, then raised on rank 0
        error = f"{type(e).__name__}: {e}"
    errors = [None] * payload["tp_degree"]
    dist.all_gather_object(errors, error)
    channel = _channel()
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    return model, channel, failed


def _channel():
    import torch.distributed as dist
    from kiln.runtime.lockstep import ProcessChannel
    return ProcessChannel(dist.new_group(backend="gloo"))


class _Counted:
    """A collective group that counts the collectives this rank starts (module doc: whether
    the ranks are still in step after a call failed somewhere)."""

    def __init__(self, group):
        self.group, self.count = group, 0

    def __getattr__(self, name):
        return getattr(self.group, name)

    def all_reduce(self, x, op="sum"):
        self.count += 1
        return self.group.all_reduce(x, op)

    def all_gather(self, x, dim):
        self.count += 1
        return self.group.all_gather(x, dim)

    def reduce_scatter(self, x, dim):
        self.count += 1
        return self.group.reduce_scatter(x, dim)


def _count_collectives() -> list:
    """Wrap every collective group the graphs can name in a :class:`_Counted`."""
    from kiln.distributed import groups
    counted = []
    for name in groups.names():
        group = groups.get(name)
        if not isinstance(group, _Counted):
            group = _Counted(group)
            groups.register(name, group)
        counted.append(group)
    return counted


def _collectives(counted) -> int:
    return sum(g.count for g in counted)


def _attempt(fn, *args):
    """``(result, None)`` or ``(None, exception)``."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - reported to rank 0 by _report
        return None, e


def _report(channel, error, collectives: int):
    """Every rank's ``(error text or None, collectives started)`` for one command, on every
    rank; None when no rank failed (one all-reduce of a flag: the common case)."""
    import torch.distributed as dist
    flag = torch.tensor([0 if error is None else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=channel.group)
    if not int(flag):
        return None
    everyone = [None] * dist.get_world_size(channel.group)
    text = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(everyone, (text, collectives), group=channel.group)
    return everyone


def _serve(model, channel, rank: int):
    """A child's loop: run what rank 0 sends until it says stop. A command that fails here
    is reported to rank 0 (:func:`_report`), and the loop goes on."""
    counted = _count_collectives()
    while True:
        command, arg = channel.recv()
        if command == "stop":
            return
        before = _collectives(counted)
        if command == "run":
            with torch.no_grad():
                _, error = _attempt(lambda: model(*arg))
        elif command == "save":
            _, error = _attempt(torch.jit.save, model, os.path.join(arg, f"tp_{rank}.pt"))
        else:
            error = NxDTraceError(f"unknown command {command!r}")
        if error is not None:
            print(f"[kiln nxd_trace rank {rank}] {command} failed here ({type(error).__name__}: {error}); "
                  "reporting it to rank 0 (ranks waiting for this one in a collective give up at the "
                  "collective timeout, 30 minutes by default)", file=sys.stderr, flush=True)
        _report(channel, error, _collectives(counted) - before)


def rank_main(info, payload: dict):
    """The entry each child rank runs (see :func:`kiln.distributed.launch.start_ranks`)."""
    model, channel, failed = _setup(payload, info.rank)
    if not failed:
        _serve(model, channel, info.rank)


# -- rank 0 -----------------------------------------------------------------------------------
class TensorParallelNeuronModel(torch.nn.Module):
    """The ranks running one tensor-parallel model; calling it runs every rank and returns
    rank 0's output. ``models`` holds rank 0's compiled model (the others live in their
    processes); ``close()`` (or leaving a ``with`` block, or garbage collection) stops the
    ranks."""

    def __init__(self, model, ranks, channel, tp_degree: int):
        super().__init__()
        self.models = torch.nn.ModuleList([model]) if isinstance(model, torch.nn.Module) else [model]
        self._ranks, self._channel, self.tp_degree = ranks, channel, tp_degree
        self._stopped = None        # why the ranks were stopped, when not by close()
        self._checker = _input_checker(model)
        self._counted = _count_collectives()

    def forward(self, *tensors):
        self._check_open()
        self._checker.check(self._checker.flatten(tensors, {}))   # before any rank hears of it
        return self._run_ranks(tuple(tensors))

    def _run_ranks(self, tensors):
        """Run every rank on ``tensors`` (unchecked) and return rank 0's output."""
        self._command("run", tensors)
        before = _collectives(self._counted)
        out, error = _attempt(self.models[0], *tensors)
        self._settle("run", error, _collectives(self._counted) - before)
        return out

    def _check_open(self):
        if self._ranks is None:
            raise NxDTraceError(self._stopped or "this TensorParallelNeuronModel was closed; trace or load it again")

    def _command(self, command, arg=None):
        try:
            self._channel.send((command, arg))
        except Exception as e:  # noqa: BLE001 - a rank is gone
            raise NxDTraceError(f"a rank is gone ({e}); failures: {self._ranks.failures}") from e

    def _settle(self, command, error, collectives):
        """Hear from every rank how ``command`` went here and raise what failed (module doc)."""
        try:
            everyone = _report(self._channel, error, collectives)
        except Exception as e:  # noqa: BLE001 - a rank is gone
            raise NxDTraceError(f"a rank is gone ({e}); failures: {self._ranks.failures}") from e
        if everyone is None:
            return
        failed = "; ".join(f"rank {r}: {text}" for r, (text, _) in enumerate(everyone) if text is not None)
        if len({n for _, n in everyone}) > 1:
            counts = ", ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(everyone))
            self._stopped = (f"a {command} failed on some ranks only ({failed}), after different numbers of "
                             f"collectives ({counts}): the ranks were out of step and were stopped; trace or "
                             "load the model again")
            self.close()
            raise NxDTraceError(self._stopped) from error
        if [r for r, (text, _) in enumerate(everyone) if text is not None] == [0]:
            raise error                     # rank 0 alone: its own error, as one process raises it
        raise NxDTraceError(f"{command} failed ({failed}); the ranks are in step and the model keeps "
                            "working") from error

    def save(self, save_dir: str):
        self._check_open()
        os.makedirs(save_dir, exist_ok=True)
        self._command("save", os.path.abspath(save_dir))
        _, error = _attempt(torch.jit.save, self.models[0], os.path.join(save_dir, "tp_0.pt"))
        self._settle("save", error, 0)      # returns once every rank's file is written

    def close(self):
        ranks, self._ranks = getattr(self, "_ranks", None), None
        if ranks is None:
            return
        with contextlib.suppress(Exception):
            self._channel.send(("stop", None))
        with contextlib.suppress(Exception):
            ranks.wait(10)
        _stop(ranks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def _input_checker(model):
    """What checks a call's inputs as the model will: rank 0's compiled kiln model itself,
    or, for a loaded TorchScript module, the kiln model its ``kiln::run`` op runs."""
    if hasattr(model, "check") and hasattr(model, "flatten"):
        return model
    from kiln.runtime import script_op
    return script_op.model_for(model.artifact)


def _stop(ranks):
    """Leave the parallel state and the world, and stop the children."""
    from kiln.distributed import state
    with contextlib.suppress(Exception):
        state.destroy_model_parallel()
    ranks.terminate()


def _start(payload: dict) -> TensorParallelNeuronModel:
    from kiln.distributed import launch
    tp = payload["tp_degree"]
    ranks = launch.start_ranks(tp, _ENTRY, payload)
    try:
        model, channel, failed = _setup(payload, 0)
    except BaseException:
        _stop(ranks)
        raise
    if failed:
        _stop(ranks)
        what = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise NxDTraceError(f"parallel_model_{payload['mode']} failed ({what})")
    return TensorParallelNeuronModel(model, ranks, channel, tp)


def parallel_model_trace(func, example_inputs, states=None, compiler_workdir=None, compiler_args=None,
                         inline_weights_to_neff=True, bucket_config=None, tp_degree=1,
                         max_parallel_compilations=None, spmd_mode=False, checkpoint_loader_callable=None,
                         force_custom_init_on_device=False, serialization_path=None):
    """Compile ``func()``'s model on ``tp_degree`` ranks (module doc). ``func`` returns
    ``(module, input_output_aliases)`` and must be module-level; call this under
    ``if __name__ == "__main__":``. ``compiler_args`` are kiln's Neuron-style flags.
    ``compiler_workdir`` is accepted for compatibility and holds nothing: kiln compiles
    in memory and keeps graphs in its cache."""
    _check_options(tp_degree, states, inline_weights_to_neff, bucket_config, max_parallel_compilations,
                   spmd_mode, checkpoint_loader_callable, force_custom_init_on_device, serialization_path)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor)
                                                                for t in example_inputs):
        raise InputError("parallel_model_trace: example_inputs must be a tensor or a tuple of tensors")
    payload = {"mode": "trace", "tp_degree": tp_degree, "func": _func_ref(func),
               "example_inputs": tuple(example_inputs), "compiler_args": compiler_args}
    return _start(payload)


def parallel_model_save(model: TensorParallelNeuronModel, save_dir: str) -> None:
    """Write each rank's compiled model to ``save_dir/tp_{rank}.pt`` (TorchScript)."""
    if not isinstance(model, TensorParallelNeuronModel):
        raise InputError(f"parallel_model_save: expected a TensorParallelNeuronModel, got {type(model).__name__}")
    model.save(save_dir)


def parallel_model_load(model_dir: str) -> TensorParallelNeuronModel:
    """Start one rank per ``model_dir/tp_{rank}.pt`` and load each; returns the model."""
    count = 0
    while os.path.isfile(os.path.join(model_dir, f"tp_{count}.pt")):
        count += 1
    if count == 0:
        raise InputError(f"parallel_model_load: no tp_0.pt in {model_dir!r}; save with parallel_model_save")
    return _start({"mode": "load", "tp_degree": count, "model_dir": os.path.abspath(model_dir)})
