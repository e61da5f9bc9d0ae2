"""The KV cache the runtime owns, and the context-bucket padding of prefill.

The cache is preallocated, one ``[B, H_kv, S_max, D]`` buffer per layer for keys and one
for values; each step's new keys and values are written into their positions in place
(position ``p`` of a sequence is at index ``p``), and a sequence's valid positions are
its first ``length``. A decode graph for fewer rows gets the first rows of each buffer
as views. The loop that fills it is :mod:`kiln.runtime.scheduler`.

**Sequence-length windows.** A decode step attends over every position its cache input
has, valid or not: SmolLM2's one-row int4 step took 12.3 ms with a 256-position cache and
24.8 ms with 2048 (8 rows: 37.7 and 109.6 ms), whatever the sequences' lengths. So graphs
may be compiled for smaller windows ``W`` (sequence-length buckets) and the cache laid
out for the smallest window that holds every running sequence: the same preallocated
memory viewed as ``[L, B, H_kv, W, D]``, contiguous, so a window's rows are views the
engines take as they are (a ``[:, :, :W]`` slice of the full layout would not be
contiguous and would be copied at every step). Moving to another window re-lays the
held positions out once (a copy), when the longest running sequence crosses a window's
edge or the long ones end; steps between pay nothing.

**Where the memory lives.** A cache made inside :func:`placed` takes its two buffers from
the memory given there instead of allocating them: an LLM keeps one :class:`CacheMemory`
and every cache of its schedulers (the server's one, each ``generate`` call's) takes its
buffers from it. On an NVIDIA GPU (:mod:`kiln.runtime.cuda_llm`) that keeps the buffers
at the addresses its decode steps' CUDA graphs were captured against. On a CPU it saves
each ``generate`` call a fresh allocation: for SmolLM2's two 47 MB buffers, zeroing kept
ones took 5.8 ms and allocating fresh zeros 38 ms (page faults) in a bare process, and a
one-token ``generate`` of a loaded model went from 133 to 104 ms. The lengths and the
valid-position mask stay on the CPU, where the scheduler reads them.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import weakref

import torch

from kiln.runtime import alloc

_MEMORY = contextvars.ContextVar("kiln_kv_memory", default=None)
ADVICE = ("The LLM artifact's cache_shape [layers, rows, kv heads, positions, head dim] sets it: compile "
          "the LLM with a smaller --batch-size or --cache-length (kiln llm compile), or free memory")


def zeros(shape, dtype, device="cpu") -> tuple:
    """The two flat zeroed buffers (keys, values) of a ``shape`` cache, or a :class:`KilnError`
    naming the size when they cannot be had (checked before allocating, see :mod:`kiln.runtime.alloc`)."""
    n = math.prod(shape)
    return alloc.allocate(lambda: tuple(torch.zeros(n, dtype=dtype, device=device) for _ in range(2)),
                          "KV cache (keys and values)", tuple(shape), dtype, ADVICE, count=2, device=device)


@contextlib.contextmanager
def placed(memory):
    """KV caches made inside take their keys' and values' buffers from ``memory(shape,
    dtype) -> (keys, values)`` (each flat, zeroed, ``prod(shape)`` elements); ``None``:
    fresh zeros on the CPU, as outside."""
    token = _MEMORY.set(memory)
    try:
        yield
    finally:
        _MEMORY.reset(token)


class CacheMemory:
    """An LLM's KV-cache memory: ``memory(shape, dtype) -> (keys, values)`` for
    :func:`placed`, on ``device``. The first buffers are kept and handed to the next cache
    once no live cache holds them (a server's one scheduler, ``generate``'s one per call),
    zeroed as fresh ones are, so a GPU's captured graphs stay valid and a CPU's next call
    skips the allocation; a cache made while another still holds them gets buffers of its
    own (two schedulers at once)."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self._buffers = None
        self._holder = None         # weakref to the flat view the live cache holds
        self._lock = threading.Lock()   # generate() may be called from several threads at once

    def __call__(self, shape, dtype):
        n = math.prod(shape)
        with self._lock:
            free = self._holder is None or self._holder() is None
            kept = self._buffers
            if kept is None or not free or kept[0].numel() != n or kept[0].dtype != dtype:
                fresh = zeros(shape, dtype, self.device)
                if kept is not None and not free:
                    return fresh     # the kept buffers are in use: these are this cache's alone
                kept = self._buffers = fresh
                free = False         # fresh zeros: nothing to clear
            views = tuple(b.view(-1) for b in kept)
            self._holder = weakref.ref(views[0])
        if free:
            for b in kept:
                b.zero_()           # this caller's alone now
        return views


class KVCache:
    """Keys and values of ``B`` sequences (rows), one ``[B, H_kv, S, D]`` buffer per layer
    and kind, allocated once. ``shape``: ``[L, B, H_kv, S, D]``.

    The per-layer buffers are views of one ``[L, B, H_kv, S, D]`` tensor per kind, so a
    step's new keys for every layer are written with one copy, not one per layer: at 30
    layers and 8 rows that was 480 small copies, ~10 % of a SmolLM2 decode step."""

    def __init__(self, shape: tuple, dtype=torch.float32, windows=()):
        self.shape = tuple(shape)
        self.windows = sorted({int(w) for w in windows if int(w) < shape[3]} | {shape[3]})
        memory = _MEMORY.get()
        self._memory = memory(self.shape, dtype) if memory is not None else zeros(self.shape, dtype)
        self.window = 0
        self._lay_out(self.windows[0])
        self.lengths = torch.zeros(shape[1], dtype=torch.int64)
        self._written: dict = {}    # id(decode graph) -> (graph, whether it writes the cache itself)
        # the token at each position of each row, where known: what a freed row still
        # holds (its values stay until overwritten), for prefix reuse
        self.held: list = [[] for _ in range(shape[1])]
        self.relayouts = 0

    @property
    def capacity(self) -> int:
        """Positions a row may hold (the largest window)."""
        return self.shape[3]

    def _lay_out(self, window: int):
        layers, rows, heads, _, dim = self.shape
        n = layers * rows * heads * window * dim
        self.keys, self.values = (m[:n].view(layers, rows, heads, window, dim) for m in self._memory)
        self.k, self.v = list(self.keys.unbind(0)), list(self.values.unbind(0))
        self.window = window
        self._row_views = {}        # rows -> the decode step's cache views (:meth:`inputs`)
        self._slots = torch.arange(window).unsqueeze(0)
        self._step_valid = torch.empty(rows, window, dtype=torch.bool)   # :meth:`inputs`' mask

    def fit(self, positions: int, shrink: bool = True):
        """Lay the cache out for the smallest window holding ``positions`` (every row's
        need); ``shrink=False`` only ever grows it. Positions beyond the new window are
        dropped from what freed rows hold (running rows never have any there)."""
        if positions > self.capacity:
            raise ValueError(f"{positions} positions exceed the cache's {self.capacity}")
        window = next(w for w in self.windows if w >= positions)
        if window == self.window or (window < self.window and not shrink):
            return
        old = self.window
        kept = min(old, window)
        saved = (self.keys[..., :kept, :].clone(), self.values[..., :kept, :].clone())
        self._lay_out(window)
        for buf, data in zip((self.keys, self.values), saved):
            buf[..., :kept, :] = data
            buf[..., kept:, :] = 0
        for held in self.held:
            del held[window:]
        self.relayouts += 1

    def write_slot(self, slot: int, new_k, new_v, tokens=None):
        """Append ``[L, H_kv, n, D]`` new keys and values after row ``slot``'s current length;
        ``tokens``: the ``n`` token ids they belong to, when the caller knows them."""
        start, n = int(self.lengths[slot]), new_k.shape[2]
        if start + n > self.window:
            raise ValueError(f"sequence {slot} needs {start + n} cache positions; the cache holds "
                             f"{self.capacity}, laid out for {self.window}")
        self.keys[:, slot, :, start:start + n] = new_k
        self.values[:, slot, :, start:start + n] = new_v
        self._grow(slot, start, n, tokens)

    def written_by(self, graph) -> bool:
        """Whether decode step ``graph`` writes the step's keys and values into the cache
        inputs it is given, every one of them at every call (ONNX Runtime's, through
        :meth:`kiln.runtime.program.Program.written_inputs`): then they are counted
        (:meth:`wrote_slot`), not written again."""
        known = self._written.get(id(graph))
        if known is None or known[0] is not graph:
            program = getattr(graph, "program", None)
            written = program.written_inputs() if hasattr(program, "written_inputs") else frozenset()
            known = self._written[id(graph)] = (graph, set(range(2, 2 + 2 * len(self.k))) <= written)
        return known[1]

    def wrote_slot(self, slot: int, token):
        """A decode step wrote row ``slot``'s key and value for ``token`` into the cache itself
        (a graph that updates its cache inputs in place, :meth:`kiln.runtime.program.Program.written_inputs`):
        count them, without writing them again (~80 us a row and step for SmolLM2)."""
        start = int(self.lengths[slot])
        if start + 1 > self.window:
            raise ValueError(f"sequence {slot} needs {start + 1} cache positions; the cache holds "
                             f"{self.capacity}, laid out for {self.window}")
        self._grow(slot, start, 1, [token])

    def _grow(self, slot, start, n, tokens):
        self.lengths[slot] += n
        held = self.held[slot]           # appended in place: a decode step writes one token per row
        del held[start:]
        held.extend(tokens if tokens is not None else [None] * n)

    def longest_prefix(self, prompt: list) -> tuple:
        """``(row, n)``: the row holding the longest prefix of ``prompt`` (its keys and
        values at positions ``0..n-1``, freed rows included), ``n`` 0 when none does."""
        best = (0, 0)
        for row, held in enumerate(self.held):
            n = 0
            for a, b in zip(held, prompt):
                if a is None or a != b:
                    break
                n += 1
            best = max(best, (n, -row))
        return -best[1], best[0]

    def copy_prefix(self, src: int, dst: int, n: int):
        """Row ``dst`` starts as row ``src``'s first ``n`` positions (a shared prompt prefix)."""
        if src != dst:
            self.keys[:, dst, :, :n] = self.keys[:, src, :, :n]
            self.values[:, dst, :, :n] = self.values[:, src, :, :n]
        self.lengths[dst] = n
        self.held[dst] = self.held[src][:n]

    def move(self, src: int, dst: int):
        """Move row ``src``'s sequence to row ``dst`` (its valid positions only)."""
        n = int(self.lengths[src])
        self.keys[:, dst, :, :n] = self.keys[:, src, :, :n]
        self.values[:, dst, :, :n] = self.values[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0
        self.held[dst] = self.held[src][:n]

    def reset(self, slot: int):
        """Free a row: its length is 0, so nothing in it is attended to (the values stay)."""
        self.lengths[slot] = 0

    def parked(self, rows: int):
        """A decode step over the first ``rows`` rows has run. A graph that writes the
        step's keys into the cache in place (ONNX Runtime's GroupQueryAttention,
        :mod:`kiln.engines.ort_gqa`) writes an empty row's at its last slot: what an empty
        row holds there is no longer the token it held, so it is not offered for reuse
        (nor a full row's, whose step, riding along, writes there too)."""
        for slot in range(rows):
            if int(self.lengths[slot]) in (0, self.window):
                del self.held[slot][self.window - 1:]

    def valid(self) -> torch.Tensor:
        """``[B, W]`` bool: the positions each sequence may attend to (W: the window)."""
        return self._slots < self.lengths.unsqueeze(1)

    def row_inputs(self, slot: int) -> list:
        """One row's cache inputs (views): a chunk of a prompt prefilled against its cache."""
        return ([k[slot:slot + 1] for k in self.k] + [v[slot:slot + 1] for v in self.v]
                + [self.valid()[slot:slot + 1]])

    def inputs(self, rows: int) -> list:
        """A decode step's cache inputs for the first ``rows`` rows: views, not copies. The
        views are made once per layout (making SmolLM2's 60 cost ~0.1 ms a decode step, 1 %
        of it), and being the same tensors at every step they let an engine keep its binding
        of them (:class:`kiln.engines.onnxruntime.OrtRunner`). The valid-position mask is
        written into one buffer kept with the layout, for the same reason: it is the cache's
        own, rewritten by the next call, so a caller uses it for the step it asked for. Every
        tensor returned is the same object at every step of a layout, which lets the runner
        skip even checking the binding (:meth:`kiln.engines.onnxruntime.OrtRunner._bound_call`)."""
        views = self._row_views.get(rows)
        if views is None:
            views = self._row_views[rows] = ([k[:rows] for k in self.k] + [v[:rows] for v in self.v]
                                             + [self._step_valid[:rows]])
        torch.lt(self._slots, self.lengths.unsqueeze(1), out=self._step_valid)
        return list(views)


def padded(prefill, width: int):
    """``prefill`` compiled for prompts ``width`` tokens wide (a context bucket), called
    with narrower ones: ids padded on the right, positions continued. The padding comes
    after every real token, so causal attention never lets a real token see it."""
    def run(ids, positions, last):
        extra = width - ids.shape[1]
        if extra < 0:
            raise ValueError(f"prompt of {ids.shape[1]} tokens is longer than the context bucket ({width})")
        if extra:
            ids = torch.cat([ids, torch.zeros(ids.shape[0], extra, dtype=ids.dtype)], 1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1)], 1)
        return prefill(ids, positions, last)
    return run
