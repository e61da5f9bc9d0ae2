"""torch_xla's ``xla_model`` (``import torch_xla.core.xla_model as xm``) on kiln's lazy
device: what torch-neuronx training scripts call, with the same names and defaults.

Importing it puts kiln's device in lazy mode: nothing runs until ``xm.mark_step()`` (or
a value is read), so a training step is one program, compiled once through kiln's
compiler and cache. Compile settings come from ``NEURON_CC_FLAGS`` (``-O1``..``-O3``,
``--optlevel``, ``--auto-cast``, ``--auto-cast-type``, ``--target``; the cache from
``--cache_dir`` or ``NEURON_COMPILE_CACHE_URL``); flags that only mean something to
Neuron's compiler (``--model-type``, ``--distribution-strategy``...) are ignored with a
warning. Ranks and world size come from ``torch.distributed`` when it is initialised
(``torchrun`` + ``dist.init_process_group("xla")``), else from the launcher's environment
(``torchrun``, ``xmp.spawn``: ``RANK``, ``WORLD_SIZE``), else this is rank 0 of 1. The first
collective (``xm.optimizer_step``'s gradient all-reduce, ``mesh_reduce``...) of a rank that
the launcher says is one of several, in a script that made no process group, makes the
default one (the ``"xla"`` backend): torch_xla reduces over its runtime's devices with no
process group, and ranks each training alone would be a wrong answer given quietly.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import os
import sys
import time
import warnings

import torch

from kiln import config
from kiln.compiler import neuron_env
from kiln.device import metrics, modes, walk

REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX = "sum", "mul", "and", "or", "min", "max"
_closures: list = []


def device_options() -> dict:
    """kiln.trace options for the device's graphs, from Neuron's environment
    (:mod:`kiln.compiler.neuron_env`)."""
    options = neuron_env.device_options(stacklevel=3)
    for name in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        if config.flag(name):
            warnings.warn(f"kiln: {name}=1 is not honoured: kiln's device keeps float32 tensors float32, where "
                          "torch_xla would store them as bf16, so this script computes in float32. Use "
                          "model.to(torch.bfloat16), or torch.autocast('xla', dtype=torch.bfloat16), as "
                          "torch-neuronx advises in its place", RuntimeWarning, stacklevel=3)
    return options


def xla_device(n=None, devkind=None) -> torch.device:
    """kiln's device (lazy mode). ``n`` is accepted; one device per process, as
    torch-neuronx gives one NeuronCore per process under torchrun."""
    dev = modes.device()
    if modes.mode() != "lazy" or not _configured:
        modes.set_mode("lazy", **device_options())
        _configured.append(True)
    return dev


_configured: list = []


def xla_device_hw(device) -> str:
    return "NEURON"


def is_xla_tensor(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == modes.device().type


def mark_step(wait: bool = False):
    """End the step: run the recorded program, then the step closures."""
    modes.mark_step()
    pending, _closures[:] = list(_closures), []
    for fn, args in pending:
        fn(*args)


def add_step_closure(closure, args=(), run_async=False):
    """Run ``closure(*args)`` after the next ``mark_step``, when the step's values are
    real (logging a loss without breaking the step into two programs)."""
    _closures.append((closure, tuple(args)))


def wait_device_ops(devices=None):
    modes.synchronize()


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _launched(name: str, default: int) -> int:
    """A number the launcher (torchrun, ``xmp.spawn``) put in the environment, else ``default``."""
    value = config.get(name)
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _collective_dist():
    """``torch.distributed`` for a collective, or None for a single rank: the default group,
    made here from the launcher's environment (``env://``, the ``"xla"`` backend) when the
    launcher says there are several ranks and the script made none (see the module doc)."""
    dist = _dist()
    if dist is None and _launched("WORLD_SIZE", 1) > 1:
        import torch.distributed as tdist
        from kiln.device import process_group as xla_backend
        xla_backend.register()
        tdist.init_process_group("xla")
        dist = tdist
    return dist


def get_ordinal(defval: int = 0) -> int:
    dist = _dist()
    return dist.get_rank() if dist else _launched("RANK", defval)


def get_local_ordinal(defval: int = 0) -> int:
    return _launched("LOCAL_RANK", get_ordinal(defval))


def xrt_world_size(defval: int = 1) -> int:
    dist = _dist()
    return dist.get_world_size() if dist else _launched("WORLD_SIZE", defval)


get_world_size = xrt_world_size


def is_master_ordinal(local: bool = True) -> bool:
    return (get_local_ordinal() if local else get_ordinal()) == 0


def master_print(*args, fd=sys.stdout, finish=False, flush=True, **kwargs):
    if is_master_ordinal(local=False):
        print(*args, file=fd, flush=flush, **kwargs)


def rendezvous(tag: str, payload: bytes = b"", replicas=()) -> list:
    """Wait for every rank; returns each rank's payload."""
    dist = _collective_dist()
    if dist is None:
        return [payload]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, payload)
    return out


def _all_ranks(what: str, groups):
    """torch_xla's ``groups`` (replica groups) other than all ranks in one group are refused:
    reducing over every rank instead would be a wrong answer given quietly."""
    if not groups:
        return
    world = xrt_world_size()
    if len(groups) == 1 and sorted(groups[0]) == list(range(world)):
        return
    raise ValueError(f"xm.{what}(groups={groups!r}): replica groups other than all {world} ranks are not "
                     "supported by kiln yet; use torch.distributed.new_group and its collectives")


def all_gather(value, dim: int = 0, groups=None, output=None, pin_layout=True):
    """Every rank's ``value`` concatenated along ``dim`` (rank order), on every rank;
    written into ``output`` too when it is given."""
    _all_ranks("all_gather", groups)
    dist = _collective_dist()
    if dist is None:
        gathered = value.clone()
    else:
        parts = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, value.contiguous())
        gathered = torch.cat(parts, dim=dim)
    if output is not None:
        output.copy_(gathered)
        return output
    return gathered


def mesh_reduce(tag: str, data, reduce_fn):
    """``reduce_fn`` of every rank's ``data`` (a list in rank order; tensors moved to the
    CPU first), on every rank: torch_xla's way to average a metric, such as a test accuracy,
    over the ranks."""
    import torch.utils._pytree as pytree
    data = pytree.tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v, data)
    dist = _collective_dist()
    if dist is None:
        return reduce_fn([data])
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, data)
    return reduce_fn(out)


_OPS = {REDUCE_SUM: "SUM", REDUCE_MUL: "PRODUCT", REDUCE_MIN: "MIN", REDUCE_MAX: "MAX", REDUCE_AND: "BAND",
        REDUCE_OR: "BOR"}


def _reduce_op(reduce_type):
    import torch.distributed as tdist
    if reduce_type not in _OPS:
        raise ValueError(f"kiln: unknown reduce_type {reduce_type!r}: one of {', '.join(map(repr, _OPS))}")
    return getattr(tdist.ReduceOp, _OPS[reduce_type])


def all_reduce(reduce_type, inputs, scale: float = 1.0, groups=None, pin_layout=True):
    """Reduce over all ranks, then multiply by ``scale``, as torch_xla does: a single tensor
    gives a NEW tensor holding the result and is itself left unchanged; a list (or tuple) is
    reduced in place and returned. The result is not part of autograd's graph (torch_xla's
    collective has no gradient): ``mean = xm.all_reduce(SUM, loss, scale=1/world)`` to log
    the mean loss before ``loss.backward()`` leaves ``loss`` and its gradients alone. On a
    single rank the result is a copy (a tensor) or the list unchanged, ``scale`` unapplied,
    as torch_xla's. (Until 12-01 a single tensor was reduced in place and returned, and the
    scaling was recorded by autograd: that loss became the ranks' mean, and every gradient
    of the step was scaled by ``scale``.)"""
    _all_ranks("all_reduce", groups)
    op = _reduce_op(reduce_type)
    single = isinstance(inputs, torch.Tensor)
    dist = _collective_dist()
    if dist is None:
        return inputs.detach().clone() if single else inputs
    # the collective writes the tensors' memory with autograd kept out: through detached
    # aliases (the same memory, and on kiln's device the same cell), not the caller's tensors
    tensors = [inputs.detach().clone()] if single else [t.detach() for t in inputs]
    for t in tensors:
        dist.all_reduce(t, op=op)
    if scale != 1.0:
        # after every collective, as one operation: a scale between two collectives was a
        # program of one multiplication, compiled per tensor shape (each collective runs
        # what the device has queued)
        torch._foreach_mul_(tensors, scale)
    return tensors[0] if single else inputs


def reduce_scatter(reduce_type, input, scale: float, scatter_dim: int, shard_count: int, groups=None,
                   output=None, pin_layout=True, channel_id=None, use_global_device_ids=None):
    """torch_xla's ``reduce_scatter``: ``input`` reduced over the ranks, times ``scale``, split
    into ``shard_count`` (the world size) equal shards along ``scatter_dim``; this rank gets
    shard ``rank``, a new tensor (written into ``output`` and returned when it is given). A
    list of inputs gives a list of results (into ``output``, a list, when given). Outside
    autograd, as torch_xla's. Over torch.distributed it is an all-reduce then this rank's
    shard (any ``reduce_type``, any ``scatter_dim``)."""
    _all_ranks("reduce_scatter", groups)
    if not isinstance(input, torch.Tensor):
        if not isinstance(input, (list, tuple)) or not all(isinstance(v, torch.Tensor) for v in input):
            raise TypeError(f"`input` needs to be a Tensor or a list of Tensors, but given {type(input)}.")
        if output is not None and (not isinstance(output, list) or len(output) != len(input)):
            raise ValueError("`output` needs to be a list of Tensors as long as `input`")
        outs = output or [None] * len(input)
        return [reduce_scatter(reduce_type, v, scale, scatter_dim, shard_count, groups, o)
                for v, o in zip(input, outs)]
    _splits_over_world("reduce_scatter", "shard_count", shard_count, input, scatter_dim)
    op, dist = _reduce_op(reduce_type), _collective_dist()
    reduced = input.detach().clone()
    if dist is not None:
        dist.all_reduce(reduced, op=op)
    if scale != 1.0:
        reduced.mul_(scale)
    shard = reduced.chunk(shard_count, scatter_dim)[get_ordinal()].clone()
    if output is not None:
        output.copy_(shard)
        return output
    return shard


def _splits_over_world(op, name, count, tensor, dim):
    """``count`` parts along ``dim``, one per rank of the world: ValueError otherwise."""
    world = xrt_world_size()
    if count != world:
        raise ValueError(f"xm.{op}({name}={count}): kiln splits over all {world} ranks")
    if tensor.shape[dim] % count:
        raise ValueError(f"xm.{op}: dimension {dim} of {list(tensor.shape)} does not split into {count} equal parts")


def all_to_all(value, split_dimension: int, concat_dimension: int, split_count: int, groups=None,
               pin_layout=True):
    """torch_xla's ``all_to_all``: ``value`` split into ``split_count`` (the world size) equal
    blocks along ``split_dimension``, block ``j`` sent to rank ``j``; the blocks received
    (one from each rank, in rank order) concatenated along ``concat_dimension``. A new
    tensor, outside autograd (as torch_xla's)."""
    _all_ranks("all_to_all", groups)
    _splits_over_world("all_to_all", "split_count", split_count, value, split_dimension)
    dist = _collective_dist()
    if dist is None:
        return value.detach().clone()
    blocks = value.detach().movedim(split_dimension, 0).contiguous()     # block j: rows j*n/world...
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks)
    parts = [p.movedim(0, split_dimension) for p in received.chunk(split_count, 0)]
    return torch.cat(parts, dim=concat_dimension)


def reduce_gradients(optimizer, groups=None, pin_layout=True):
    """Average every parameter's gradient over the ranks (data parallelism)."""
    _all_ranks("reduce_gradients", groups)
    world = xrt_world_size()
    if world <= 1:
        return
    all_reduce(REDUCE_SUM, _fetch_gradients(optimizer), scale=1.0 / world)


def broadcast_master_param(model: torch.nn.Module) -> None:
    """Every rank's parameters and buffers made rank 0's (torch_xla's way to start the
    replicas equal), then ``mark_step``."""
    collective_broadcast([t.data for t in itertools.chain(model.parameters(), model.buffers())])
    mark_step()


def get_memory_info(device=None) -> dict:
    """torch_xla 2.x's memory report: ``bytes_used`` (what live device tensors hold),
    ``bytes_limit`` (the host's memory, which is the device's) and ``peak_bytes_used`` (the
    process's peak resident memory, :mod:`kiln.device.memory`)."""
    from kiln.device import memory
    return {"bytes_used": memory.memory_allocated(), "bytes_limit": memory.mem_get_info()[1],
            "peak_bytes_used": memory.max_memory_allocated()}


def get_xla_supported_devices(devkind=None, max_devices=None) -> list:
    """The devices this process may use: one, kiln's device, as torch-neuronx gives one
    NeuronCore to each process."""
    return [str(modes.device())]


def _is_tensor(v) -> bool:
    return isinstance(v, torch.Tensor)


def to_device(data, device):
    """``data`` (tensors in any nesting of containers, which keep their types) with its
    tensors on ``device``."""
    return walk.rebuild(data, lambda t: t.to(device), _is_tensor)


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """``datas`` (nested containers) with its tensors moved to ``device``; a lone tensor comes
    back in a list, as torch_xla returns it."""
    return to_device([datas] if isinstance(datas, torch.Tensor) else datas, device)


def _maybe_convert_to_cpu(data, convert: bool = True):
    return _to_cpu(data) if convert else data


def _fetch_gradients(optimizer) -> list:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def collective_broadcast(tensors, root_ordinal: int = 0, groups=None, pin_layout=True) -> None:
    """Every rank's ``tensors`` made rank ``root_ordinal``'s, in place."""
    _all_ranks("collective_broadcast", groups)
    dist = _collective_dist()
    if dist is not None:
        for t in tensors:
            dist.broadcast(t, src=root_ordinal)


# the CPU generator's states that get_rng_state named in this process, by name (bounded)
_named_states: collections.OrderedDict = collections.OrderedDict()


def _state_name(state: torch.Tensor) -> int:
    """A state's name: 63 bits of its hash (an int64 tensor holds it, as accelerate puts it)."""
    return int.from_bytes(hashlib.blake2b(state.numpy().tobytes(), digest_size=8).digest(), "big") >> 1


def get_rng_state(device=None) -> int:
    """torch_xla's device state: an integer that :func:`set_rng_state` puts back exactly
    (``s = get_rng_state(); draw; set_rng_state(s); draw`` draws the same twice). The device
    draws from the CPU generator (in program order), whose state (``torch.get_rng_state()``,
    5 KB) an integer cannot hold; the integer names it instead, by its hash, and this process
    keeps the state under that name (the last 256 named)."""
    state = torch.get_rng_state()
    name = _state_name(state)
    _named_states[name] = state
    _named_states.move_to_end(name)
    while len(_named_states) > 256:
        _named_states.popitem(last=False)
    return name


def set_rng_state(seed, device=None) -> None:
    """torch_xla's ``set_rng_state``: an integer :func:`get_rng_state` returned puts that state
    back: one named in this process, or the CPU generator's current one (setting it is then
    nothing to do). That is how a checkpoint resumes in a new process: Hugging Face's Trainer
    and accelerate save the CPU state and this integer together, and restore the CPU state
    first. Any other integer is a seed, and reseeds the generator every time, as torch_xla
    does (``torch.manual_seed``)."""
    seed = int(seed)
    if seed in _named_states:
        torch.set_rng_state(_named_states[seed])
    elif seed != _state_name(torch.get_rng_state()):
        torch.manual_seed(seed)


def set_replication(device, devices) -> None:
    """torch_xla's replication setup (accelerate calls it): one device per process here, and
    ranks replicate through ``torch.distributed``, so there is nothing to set."""


class RateTracker:
    """torch_xla's throughput meter: ``add(count)`` as samples are done; ``rate()`` is the
    rate since the last ``rate()`` call, smoothed by ``smooth_factor`` (0.8: mostly the
    previous rate), and ``global_rate()`` the rate since the tracker was made."""

    def __init__(self, smooth_factor=None):
        self._smooth = 0.8 if smooth_factor is None else smooth_factor
        self._start = self._last = time.time()
        self._done = self._pending = 0.0
        self._rate = None

    def add(self, count):
        self._pending += count

    def rate(self) -> float:
        now = time.time()
        if now <= self._last:
            return 0.0
        rate = self._pending / (now - self._last)
        if self._rate is not None:
            rate = (1 - self._smooth) * rate + self._smooth * self._rate
        self._done, self._pending, self._last, self._rate = self._done + self._pending, 0.0, now, rate
        return rate

    def global_rate(self) -> float:
        elapsed = time.time() - self._start
        return (self._done + self._pending) / elapsed if elapsed > 0 else 0.0


def optimizer_step(optimizer, barrier: bool = False, optimizer_args=None, groups=None, pin_layout=True):
    """All-reduce the gradients (when distributed), then ``optimizer.step()``;
    ``mark_step`` too when ``barrier`` (otherwise the loader's next batch does it)."""
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def _to_cpu(data):
    return walk.rebuild(data, lambda t: t.detach().cpu(), _is_tensor)


def save(data, file_or_path, master_only: bool = True, global_master: bool = False):
    """``torch.save`` of ``data`` moved to the CPU, written by the master only (atomically:
    a crash mid-write leaves the old file)."""
    cpu = _to_cpu(data)
    if master_only and not is_master_ordinal(local=not global_master):
        return
    if not isinstance(file_or_path, (str, os.PathLike)):
        torch.save(cpu, file_or_path)
        return
    from kiln.atomic import write_atomic
    write_atomic(os.fspath(file_or_path), lambda f: torch.save(cpu, f))


def metrics_report() -> str:
    return metrics.report()
