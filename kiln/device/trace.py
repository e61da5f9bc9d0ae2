"""The recorded operations of kiln's device.

A :class:`Trace` is a straight-line program of ATen operations over values: its inputs
are the host tensors it reads, every other value is an operation's output, and every
operation is functional (in-place updates were recorded as their functional forms and
rebound by :mod:`kiln.device.dispatch`). Its key is built as it grows: operations,
wiring, constants, and the shapes, strides and dtypes of its inputs, never their data,
so a training step recorded again next iteration has the same key. A flush runs it
(:mod:`kiln.device.programs`), and :func:`follow` then makes it the template the next
trace replays against.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
import weakref

import torch
import torch.fx as fx

from kiln.device import foreach, inflight


def meta_like(data: torch.Tensor) -> torch.Tensor:
    """A meta tensor with ``data``'s shape, strides and dtype."""
    return torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device="meta")


class Ref:
    """A value of the trace inside an operation's recorded arguments."""
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self):
        return f"%{self.k}"


@dataclasses.dataclass
class Policy:
    mode: str = "eager"           # "eager" (queue, fused windows) or "lazy" (until mark_step)
    # eager mode: flush when this many operations are queued. Large enough for a small
    # model's whole training step (a 4-layer BERT step queues 642): split at 512, that
    # step ran at 0.73x CPU eager, whole level with lazy mode (docs/device.md)
    window: int = 2048
    # replay a step whose operations match a recent one's (kiln.device.replay); off: every
    # operation recorded afresh (for comparison: the programs are the same)
    replay: bool = True
    # compile in the background (kiln.device.compile_process: a process of its own), running
    # the program op by op until it is ready: first steps in a fraction of a second.
    # "auto": on, except in a process group of several ranks (in_background())
    background: bool | str = "auto"
    # lazy mode: a step's compiled program runs while the next step is recorded
    # (kiln.device.inflight); off by default
    overlap: bool = False
    compile_after: int = 2        # compile a program the n-th time it is seen (1 in lazy mode;
    #                               eager mode: 1 for windows ending an optimizer step)
    # -O2: each partition is timed against running it op by op and the faster kept, so a
    # compiled program is never slower than interpreting it
    options: dict = dataclasses.field(default_factory=lambda: {"optlevel": 2})


class _Op:
    __slots__ = ("func", "args", "kwargs", "outs", "single", "guard", "kind", "listed", "sigs")

    def __init__(self, func, args, kwargs, outs, single, guard=None, kind=None, listed=False):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs = outs        # value index per output (None where the op returned None)
        self.single = single    # the op returns one tensor, not a tuple or list
        # what a later trace's call must match to replay this op (kiln.device.replay)
        self.guard = guard
        self.kind = kind        # how the dispatcher recorded it: "plain", "view", or None
        self.listed = listed    # the op returns a list (a tuple otherwise, unless single)
        self.sigs = None        # the outputs' device-tensor signatures (kiln.device.tensor.signature)


_NAMES: dict = {}           # id(op) -> its name, for keys (str() and hash() of an op run Python;
#                             ops are never freed: torch keeps them in their packets)


class Trace:
    """A program being recorded. ``template``: an earlier trace (flushed, its data
    released) that this one replays while their operations match (see
    :mod:`kiln.device.replay`); a mismatch ends the replay for good (:meth:`diverge`)."""

    def __init__(self, template=None):
        self.ops: list = []
        self.metas: list = []             # value index -> meta tensor (None for inputs)
        self.inputs: list = []            # (value index, host tensor)
        self._input_of: dict = {}         # id(host tensor) -> value index
        self._memory: set = set()         # storage addresses of the inputs
        self._promised: list = []         # inputs a program in flight will compute
        self._mapped_at = -1              # inflight.landings() when they were last asked
        self.holders: dict = {}           # value index -> weakref to the cell holding it
        self.before: dict = {}            # id(cell) -> (cell, weakref to its data before the trace rebound it)
        # the key's text, one chunk per operation (with the inputs it introduced), so a
        # replay that stops part way takes the template's first chunks as its own
        self._chunks: list = []
        self._texts: list = []            # input texts waiting for their operation's chunk
        self.digest = None                # the key's digest, once flushed
        self.template = template
        self.replayed = 0                 # operations replayed from the template

    def __len__(self):
        return len(self.ops)

    def rebind(self, cell, k: int):
        """Point ``cell`` (updated in place) at the pending value ``k``, remembering the data
        it held before this trace for a flush that fails (:mod:`kiln.device.failed_steps`):
        weakly, so memory the trace does not read (overwritten by ``copy_``) is not held."""
        if cell.value is None and id(cell) not in self.before:
            self.before[id(cell)] = (cell, weakref.ref(cell.data))
        cell.data, cell.value = None, k
        self.hold(k, cell)

    def index_of(self, data: torch.Tensor, fresh: dict) -> int:
        """The value index ``data`` has, or will have as a new input: ``fresh`` maps the
        ``id`` of each host tensor the call reads that is not yet an input to its order of
        first use and the tensor (kept alive, so the ids stay unique), for :meth:`replay`
        or :func:`kiln.device.dispatch._record` to register. A dict, not a list searched
        by identity: an optimizer's ``_foreach_*`` call reads hundreds of new inputs, and
        the search made its guard quadratic in them."""
        k = self._input_of.get(id(data))
        if k is not None:
            return k
        if self._promised:          # perhaps the value of a promised input, landed since
            self._map_landed()
            k = self._input_of.get(id(data))
            if k is not None:
                return k
        hit = fresh.get(id(data))
        if hit is None:
            hit = fresh[id(data)] = (len(fresh), data)
        return len(self.metas) + hit[0]

    def input(self, data: torch.Tensor) -> Ref:
        k = self._input_of.get(id(data))
        if k is None:
            k = self._add_input(data)
            self._texts.append(f"in{k}:{data.dtype}{tuple(data.shape)}{data.stride()};")
        return Ref(k)

    def _add_input(self, data) -> int:
        k = len(self.metas)
        self.metas.append(None)       # an input's data is at hand: no meta tensor needed
        self.inputs.append((k, data))
        self._input_of[id(data)] = k
        if type(data) is inflight.Promise:
            self._promised.append(data)       # its memory is known once its program has run
            if data.landed():
                self._mapped_at = -1          # (a view of a value landed before: ask it now)
        elif data.numel():
            self._memory.add(data.untyped_storage().data_ptr())
        return k

    def reads_memory(self, data: torch.Tensor) -> bool:
        """Whether the trace reads ``data``'s memory (a host write to it must flush first).
        An input promised by a program still running cannot share it: that program's outputs
        are fresh memory, or copies where they would alias its inputs
        (:func:`kiln.device.binding.bind_values`); one whose program has run is asked here."""
        self._map_landed()
        return data.untyped_storage().data_ptr() in self._memory

    def _map_landed(self):
        """Inputs promised by a program that has run, known by their values from now on:
        the same input whether a call passes the promise or (once it has landed) its value,
        and their memory read by the trace."""
        if not self._promised or self._mapped_at == inflight.landings():
            return                  # none has landed since they were last asked
        self._mapped_at = inflight.landings()
        left = []
        for promise in self._promised:
            if not promise.landed():
                left.append(promise)
                continue
            value = promise.get()
            self._input_of[id(value)] = self._input_of[id(promise)]
            if value.numel():
                self._memory.add(value.untyped_storage().data_ptr())
        self._promised = left

    def settle_inputs(self):
        """Inputs promised by a program in flight replaced by their values (waiting for it)."""
        if inflight.in_use() and any(type(d) is inflight.Promise for _, d in self.inputs):
            self.inputs = [(k, inflight.resolve(d)) for k, d in self.inputs]

    def record(self, func, args, kwargs, out_metas, single, guard=None, kind=None, listed=False) -> list:
        outs = []
        for meta in out_metas:
            if meta is None:
                outs.append(None)
                continue
            outs.append(len(self.metas))
            self.metas.append(meta)
        self.ops.append(_Op(func, args, kwargs, outs, single, guard, kind, listed))
        name = _NAMES.get(id(func)) or _NAMES.setdefault(id(func), str(func))
        text = f"{name}{args!r}{kwargs!r}->{outs};"
        if self._texts:
            text = "".join(self._texts) + text
            self._texts.clear()
        self._chunks.append(text)
        return outs

    def replay(self, op, fresh) -> list:
        """Append the template's ``op`` (its guard matched): ``fresh`` are the new inputs
        it reads, in order; its outputs take the template's metas."""
        for _, data in fresh.values():
            self._add_input(data)
        metas = self.template.metas
        for k in op.outs:
            if k is not None:
                self.metas.append(metas[k])
        self.ops.append(op)
        return op.outs

    def switch(self, func, guard):
        """The next operation of another recent trace that shares this one's operations
        so far and continues with ``func`` and ``guard`` (it becomes the template), or
        None. A step after a one-off change (an evaluation, a new branch taken once)
        has the one-off as its first template; the step before the change shares its
        prefix, operation for operation (a replayed operation is its template's
        record, so sharing the last one means sharing them all)."""
        n = len(self.ops)
        for other in reversed(_RECENT.values()):
            if other is self.template or len(other.ops) <= n or (n and other.ops[n - 1] is not self.ops[n - 1]):
                continue
            op = other.ops[n]
            if op.func is func and op.guard == guard:
                self.template = other
                return op
        return None

    def diverge(self):
        """Stop replaying: the key so far is the template's first chunks."""
        template, self.template = self.template, None
        if template is not None:
            self._chunks = template._chunks[:len(self.ops)]
            self.replayed = len(self.ops)

    def release(self):
        """Drop the host data (after a flush): what is left is a template for later traces."""
        self.inputs, self._input_of, self._memory, self.holders = [], {}, set(), {}
        self._promised = []
        self.template = None

    def hold(self, k: int, cell):
        self.holders[k] = weakref.ref(cell)

    def live_outputs(self) -> list:
        """(value index, cell) for each value a live tensor still holds."""
        out = []
        for k, ref in self.holders.items():
            cell = ref()
            if cell is not None and cell.value == k:
                out.append((k, cell))
        return out

    def key(self, outputs) -> tuple:
        if self.digest is None:
            template = self.template
            if template is not None and len(template.ops) == len(self.ops):
                self.digest = template.digest          # replayed whole: the template's program
                self._chunks = template._chunks        # (for a trace that replays this one)
                self.replayed = len(self.ops)
            else:
                self.diverge()
                text = "".join(self._chunks).encode()
                self.digest = hashlib.blake2b(text, digest_size=16).hexdigest()
        return (self.digest, tuple(outputs))

    def graph(self, outputs) -> fx.GraphModule:
        """The program as an FX graph of flat tensors, dead code removed."""
        g = fx.Graph()
        env = {k: g.placeholder(f"in{k}") for k, _ in self.inputs}
        for op in self.ops:
            args, kwargs = _resolve(op.args, env), _resolve(op.kwargs, env)
            if foreach.is_foreach(op.func):        # engines see the per-tensor operations
                for i, k in enumerate(op.outs):
                    env[k] = g.call_function(*foreach.element_call(op.func, args, kwargs, i))
                continue
            node = g.call_function(op.func, args, kwargs)
            if op.single:
                env[op.outs[0]] = node
                continue
            for i, k in enumerate(op.outs):
                if k is not None:
                    env[k] = g.call_function(operator.getitem, (node, i))
        g.output(tuple(env[k] for k in outputs))
        g.eliminate_dead_code()
        return fx.GraphModule(torch.nn.Module(), g)

    def interpret(self, outputs) -> list:
        """Run the program op by op on CPU kernels."""
        env = {k: data for k, data in self.inputs}
        for op in self.ops:
            res = op.func(*_resolve(op.args, env), **_resolve(op.kwargs, env))
            if op.single:
                env[op.outs[0]] = res
            else:
                for k, r in zip(op.outs, res):
                    if k is not None:
                        env[k] = r
        return [env[k] for k in outputs]


def _resolve(a, env):
    """Recorded arguments with each value of the trace replaced by ``env[value]`` (graph
    nodes when building the graph, tensors when interpreting)."""
    if isinstance(a, Ref):
        return env[a.k]
    if isinstance(a, dict):
        return {k: _resolve(v, env) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return type(a)(_resolve(x, env) for x in a)
    return a


_NEXT: dict = {}               # a flushed trace's digest -> the trace that followed it last time
_LAST: list = [None]           # the trace flushed last
_RECENT: dict = {}             # digest -> trace, the last few distinct programs, oldest first


def follow(flushed: Trace, current: Trace, replay: bool = True):
    """After ``flushed`` ran: remember it as what follows the trace flushed before it,
    release its data, and give ``current`` (if it has recorded nothing yet) a template:
    the trace that followed ``flushed`` last time, else ``flushed`` itself (a lazy-mode
    step follows a step like it). Programs repeat in cycles (eager mode's windows, a
    step read part way), so the template is what came next, not only what came last."""
    before = _LAST[0]
    if before is not None and before.digest is not None:
        if len(_NEXT) >= 256:          # programs come and go; the steady ones come back
            _NEXT.clear()
        _NEXT[before.digest] = flushed
    flushed.release()
    _LAST[0] = flushed
    _RECENT.pop(flushed.digest, None)
    _RECENT[flushed.digest] = flushed
    if len(_RECENT) > 8:
        del _RECENT[next(iter(_RECENT))]
    if replay and not current.ops and flushed.digest is not None:
        current.template = _NEXT.get(flushed.digest, flushed)


def forget_templates():
    """Forget which trace followed which (with the compiled programs: tests, memory)."""
    _NEXT.clear()
    _LAST[0] = None
    _RECENT.clear()
