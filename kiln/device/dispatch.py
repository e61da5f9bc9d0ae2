"""Where every operation on a kiln device tensor goes: recorded into the current trace,
or run now on the host data.

An operation is **recorded** (not run) when it is functional, or an in-place update of a
tensor that is not a view and has no views (recorded as its functional form, and the
tensor rebound to the result), or a view of a pending tensor. Recording runs the
operation on meta tensors for the output's shape, dtype and strides; whatever meta
cannot do is run now instead.

An operation **runs now** on the host data (after flushing what it depends on) when it
returns something other than tensors (``item()``, ``equal``), draws random numbers
(``dropout``, ``uniform_``: from the CPU generator, in program order, so seeds give CPU's
numbers), mutates a view or a tensor with views, has a data-dependent output shape
(``nonzero``), or under ``torch.use_deterministic_algorithms(True)`` (op by op, as
TorchNeuron does). Views of concrete tensors run now too: they cost nothing and share
memory as views must.

``_foreach_*`` operations (an optimizer step) are recorded whole, one operation per
call (:mod:`kiln.device.foreach`). Python float arguments of arithmetic
(AdamW's bias corrections, a scheduled learning rate) become 0-dim tensor inputs, so a
new learning rate is new data, not a new program.
"""
from __future__ import annotations

import threading
import weakref

import torch

from kiln.device import (binding, collectives, failed_steps, foreach, fused_cells, inflight, inplace_views, meta,
                         metrics, mixing, programs, replay, rewrites, walk)
from kiln.device.opinfo import info as _info
from kiln.graph import draws
from kiln.device import tensor as dt
from kiln.device import trace as tr

aten = torch.ops.aten
LOCK = threading.RLock()
POLICY = tr.Policy()
DEBUG = False
_current = [tr.Trace()]


def current() -> tr.Trace:
    return _current[0]


def dispatch(func, args, kwargs):
    stand_in = fused_cells.TABLE.get(func)          # CUDA-only kernels ATen picks for the device
    if stand_in is not None:
        return stand_in(*args, **kwargs)
    if torch.is_inference_mode_enabled() and args and _info(func).view and isinstance(args[0], torch.Tensor) \
            and not args[0].is_inference():
        with torch.inference_mode(False):   # a view of a normal tensor is one (its base's version counter)
            return dispatch(func, args, kwargs)
    with LOCK:
        return _dispatch_any(func, args, kwargs)


_MISS = object()


def _dispatch_any(func, args, kwargs):
    func = rewrites.PLAIN_FORMS.get(func, func)      # before a replay compares it
    if _current[0].template is not None:
        out = _replay_call(func, args, kwargs)
        if out is not _MISS:
            return out
    return _dispatch(func, args, kwargs)


def _replay_call(func, args, kwargs):
    """The call replayed whole when the template recorded it as a plain operation or a
    view and it matches (:mod:`kiln.device.replay`): what :func:`_dispatch` would do,
    without the checks and rewrites whose outcome the guard already fixes."""
    trace = _current[0]
    n = len(trace.ops)
    ops = trace.template.ops
    if n >= len(ops) or ops[n].func is not func or ops[n].kind is None:
        return _MISS
    if torch.are_deterministic_algorithms_enabled() or rewrites.may_lift(func, args, kwargs):
        return _MISS            # the rewrite's call replays (a Python float becomes an input)
    op = ops[n]
    fresh = replay.matches(trace, op.guard, args, kwargs)
    if fresh is None:
        return _MISS            # recorded (or run) by _dispatch, which ends the replay
    out = _outputs(trace, trace.replay(op, fresh), op)
    if op.kind == "view":
        _note_views(out, args, func, kwargs)
    _window()
    return out


def _dispatch(func, args, kwargs):
    info = _info(func)
    if info.foreach:
        out = NotImplemented
        if not torch.are_deterministic_algorithms_enabled():
            out = foreach.record_whole(_record, _record_values, meta_call, _rebind_value, func,
                                       info.name, args, kwargs)
        if out is NotImplemented:
            return foreach.split(_dispatch_any, run_now, func, args, kwargs)
        _window()
        return out
    if info.name in inplace_views.NAMES:
        return inplace_views.apply(_dispatch_any, func, args, kwargs)
    if func is aten.native_dropout.default and _is_pending(args[:1]):
        out = _dropout(*args, **kwargs)
        if out is not NotImplemented:
            return out
    target = kwargs.get("device")
    leaving = target is not None and torch.device(target).type != dt.device_type()
    if not leaving and kwargs.get("layout") not in (None, torch.strided):
        raise NotImplementedError(f"{kwargs['layout']} tensors are not supported on kiln's device ({func}): it "
                                  "keeps dense tensors; move t.to_dense(), or keep the sparse tensor on the CPU (a "
                                  "layer that makes sparse gradients, nn.Embedding(sparse=True), trains here with sparse=False)")
    factory = not (dt.any_in(args) or dt.any_in(kwargs.values()))
    if not factory:
        mixing.check(func, info.name, args, kwargs)
    if factory or leaving or not info.recordable or torch.are_deterministic_algorithms_enabled():
        return run_now(func, args, kwargs)
    if func in _FILLS:
        return _fill_now(func, args, kwargs)
    lifted = rewrites.lift_scalars(_dispatch_any, func, args, kwargs)
    if lifted is not NotImplemented:
        return lifted
    if func is aten.cat.default:
        lone = rewrites.lone_in_cat(args, kwargs)
        if lone is not None:
            return _dispatch_any(aten.clone.default, (lone,), {"memory_format": torch.contiguous_format})
    if info.mutation:
        out = _record_mutation(func, info.name, info.schema, args, kwargs)
    elif info.view:
        out = _record_view(func, args, kwargs)
    else:
        out = _record(func, args, kwargs, "plain")
    if out is NotImplemented:
        return run_now(func, args, kwargs)
    _window()
    return out


def _window():
    if POLICY.mode == "eager" and len(current()) >= POLICY.window:
        materialize()


# A fill in a tensor's shape reads nothing but its layout: made on the host now, it is an
# input of the program, not an operation in it. AdamW's first step makes its state with
# zeros_like: recorded, that step was a program of its own (BERT-4L: 146 more operations,
# 165 inputs against the next steps' 311), compiled at first sight and never run again,
# while the steps' own program waited behind it for the compile process (72 s there).
_FILLS = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}


def _fill_now(func, args, kwargs):
    like = args[0]
    host = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
    return walk.tmap(_wrap_one, func(host, *binding.host(args[1:]), **binding.host(kwargs)))


# ---- running now ---------------------------------------------------------------------

def materialize(reason: str = "observed", overlap: bool = False):
    """Flush the current trace: run it and give every live pending tensor its data (after
    the program in flight, if any). ``overlap`` (lazy mode's ``mark_step``): a compiled
    program runs in the background, its outputs promised (:mod:`kiln.device.inflight`)."""
    with LOCK:
        if DEBUG:
            import traceback
            print("FLUSH", reason, len(current()), "".join(traceback.format_stack(limit=8)[:-1]))
        inflight.land()
        trace = current()
        if not len(trace):
            return
        _current[0] = tr.Trace()
        # a flush that fails gives the trace's tensors their data from before it, or its error
        bound = failed_steps.flush(programs.flush, trace, POLICY, at_step=reason == "optimizer step",
                                   overlap=overlap)
        if isinstance(bound, programs.Overlapped):
            metrics.count("OverlappedRuns")
            inflight.launch(bound.run, bound.inputs, [(cell, trace.metas[cell.value]) for cell in bound.cells],
                            binding.storages(trace), binding.bind_values, bound.name)
        else:
            binding.bind(trace, bound)
        tr.follow(trace, _current[0], POLICY.replay)


def _settle(tree):
    """Give the device tensors in ``tree`` whose data a program in flight promised their
    values (waiting for it): an operation that runs now reads them."""
    for a in walk.leaves(tree):
        if isinstance(a, dt.DeviceTensor) and type(a._kc.data) is inflight.Promise:
            a.host()


def _is_pending(tree) -> bool:
    return any(isinstance(a, dt.DeviceTensor) and a._kc.data is None for a in walk.leaves(tree))


def _wrap_one(t):
    return dt.wrap(t) if isinstance(t, torch.Tensor) else t


def run_now(func, args, kwargs):
    """Run ``func`` on the host data now: after flushing the trace if the operation reads
    a pending tensor, or writes data the trace still has to read."""
    info = _info(func)
    if info.written and inflight.flying() and any(
            _read_in_flight(args[i] if i < len(args) else kwargs.get(name)) for i, name in info.written):
        inflight.land()          # the program in flight reads the memory this writes
    if inflight.in_use():
        _settle((args, kwargs))
    if _is_pending((args, kwargs)) or any(_read_by_trace(args[i] if i < len(args) else kwargs.get(name))
                                           for i, name in info.written):
        materialize(f"run now: {func}")
    return _results(info, func, func(*binding.host(args), **binding.host(kwargs)), args, kwargs)


def _results(info, func, out, args, kwargs):
    """What :func:`run_now` returns for ``out``, ``func``'s result on the host data."""
    if info.c10d:
        return collectives.same_tensors(out, (args, kwargs))
    if info.returns_written:       # an out= kernel may have resized it
        if len(info.schema.returns) > 1:       # sort(out=(values, indices)): each written one
            return tuple(inplace_views.conform(_written_arg(info.schema, args, kwargs, r))
                         for r in info.schema.returns)
        return inplace_views.conform(_written_arg(info.schema, args, kwargs))
    if not info.returns:
        return None
    target = kwargs.get("device")
    if target is not None and torch.device(target).type != dt.device_type():
        return out
    base = args[0] if args and isinstance(args[0], dt.DeviceTensor) else None
    if info.view and base is not None:
        if isinstance(out, torch.Tensor) and _same_layout(base._kc.data, out):
            return dt.alias(base, out)            # detach, .data: the same cell
        wrapped = walk.tmap(_wrap_one, out)
        outs = wrapped if isinstance(wrapped, (list, tuple)) else [wrapped]
        for i, o in enumerate(outs):
            dt.note_view(o, base, func, args, kwargs, i if isinstance(wrapped, (list, tuple)) else None)
        return wrapped
    if info.host_outputs:          # outputs PyTorch keeps on the CPU whatever the inputs' device
        return type(out)(o if i in info.host_outputs else _wrap_one(o) for i, o in enumerate(out))
    return walk.tmap(_wrap_one, out)


def _read_in_flight(a) -> bool:
    """Whether writing ``a`` now would change what the program in flight reads."""
    for t in walk.leaves(a):
        data = t._kc.data if isinstance(t, dt.DeviceTensor) else t
        if isinstance(data, torch.Tensor) and data.numel() and inflight.reads(data):
            return True
    return False


def _read_by_trace(a) -> bool:
    """Whether writing ``a`` (or any tensor in it) now would change what the trace, when
    it runs, reads: the same memory, through whichever tensor or view."""
    trace = current()
    if not len(trace):
        return False
    for t in walk.leaves(a):
        if isinstance(t, torch.Tensor):
            data = t._kc.data if isinstance(t, dt.DeviceTensor) else t
            if data is not None and data.numel() and trace.reads_memory(data):
                return True
    return False


def _written_arg(schema, args, kwargs, ret=None):
    alias = (ret or schema.returns[0]).alias_info
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set == alias.before_set:
            return args[i] if i < len(args) else kwargs[a.name]
    return args[0]


# ---- recording -----------------------------------------------------------------------

def _meta_of(a):
    """The meta tensor standing for one argument (:func:`kiln.device.meta.stand_in`)."""
    return meta.stand_in(a, current())


def meta_call(func, args, kwargs):
    """``func`` on meta stand-ins of its arguments, in the current trace (:mod:`kiln.device.meta`)."""
    return meta.call(func, args, kwargs, current())


def _record(func, args, kwargs, kind=None):
    """Record a functional operation; returns its pending output(s), or NotImplemented.
    The trace's template's next operation is replayed instead when the call matches it
    (:mod:`kiln.device.replay`). ``kind``: how the dispatcher came to record the call
    ("plain", "view"), which lets a later trace replay the whole call."""
    got = _record_op(func, args, kwargs, kind)
    return got if got is NotImplemented else _outputs(*got)


def _record_values(func, args, kwargs):
    """:func:`_record` for a call whose outputs only rebind tensors updated in place
    (:func:`_rebind_value`): ``[(value index, signature)]``, with no device tensor made
    for each output (an AdamW step of a 4-layer BERT updates 730 tensors in 10 calls)."""
    got = _record_op(func, args, kwargs)
    if got is NotImplemented:
        return got
    trace, outs, op = got
    return list(zip(outs, _sigs(trace, outs, op)))


def _record_op(func, args, kwargs, kind=None):
    """``(trace, output value indices, operation)`` for the call, replayed or recorded,
    or NotImplemented. A replay needs only the guard (no argument references), so the
    guard is walked first and the arguments only when the call is recorded."""
    trace = current()
    if trace.template is not None:
        n, ops = len(trace.ops), trace.template.ops
        if n < len(ops) and ops[n].func is func:
            fresh = replay.matches(trace, ops[n].guard, args, kwargs)
            if fresh is not None:
                return trace, trace.replay(ops[n], fresh), ops[n]
        try:
            guard, fresh = replay.guard(trace, args, kwargs)
        except TypeError:
            return NotImplemented
        op = replay.next_op(trace, func, guard)
        if op is not None:
            return trace, trace.replay(op, fresh), op
        trace.diverge()
    try:
        gargs, gkwargs, guard, fresh = replay.walk(trace, args, kwargs)
    except TypeError:
        return NotImplemented
    try:
        meta_out = meta_call(func, args, kwargs)
    except Exception:
        return NotImplemented
    single = isinstance(meta_out, torch.Tensor)
    metas = [meta_out] if single else list(meta_out)
    if any(m is not None and not isinstance(m, torch.Tensor) for m in metas):
        return NotImplemented
    for _, data in fresh.values():
        trace.input(data)
    trace.record(func, gargs, gkwargs, metas, single, guard, kind, isinstance(meta_out, list))
    return trace, trace.ops[-1].outs, trace.ops[-1]


def _sigs(trace, outs, op) -> list:
    sigs = op.sigs
    if sigs is None:
        sigs = op.sigs = [None if k is None else dt.signature(trace.metas[k]) for k in outs]
    return sigs


def _outputs(trace, outs, op):
    """Pending device tensors for a recorded operation's outputs."""
    sigs = _sigs(trace, outs, op)
    tensors = []
    hold = trace.holders
    for k, sig in zip(outs, sigs):
        if k is None:
            tensors.append(None)
            continue
        cell = dt.Cell(value=k)
        hold[k] = weakref.ref(cell)
        tensors.append(dt.made(sig, cell))
    if op.single:
        return tensors[0]
    return tensors if op.listed else tuple(tensors)


def _dropout(x, p, train=None):
    """Dropout on a pending tensor without ending the program: the mask is drawn now,
    on the host, exactly as CPU's ``native_dropout`` draws it (same generator, dtype,
    layout and order, so seeds give CPU's masks), and the program multiplies by it as an input.
    (Computing the boolean mask autograd keeps in the program, instead of converting it
    here, made a 4-layer BERT's compiled lazy-mode step about 3x slower on a loaded
    machine, 2.3 s against 0.67 s; why was not looked into.)"""
    if not train or p == 0 or not x.dtype.is_floating_point:
        return NotImplemented
    keep = 1.0 - p
    # CPU draws into a tensor laid out like the input (empty_like), in memory order: a
    # transposed input (a transformer's dropout after attention) gets its numbers on
    # other elements than a contiguous one would. draws.keep_mask: the same bits, faster
    kept_where, kept_values = draws.keep_mask(_meta_of(x), keep, also_as_values=True)
    scale = 0.0 if keep == 0 else 1.0 / keep
    kept = _record(aten.mul.Tensor, (x, dt.wrap(kept_values)), {})
    out = _record(aten.mul.Tensor, (kept, scale), {})
    return out, dt.wrap(kept_where)


def _record_view(func, args, kwargs):
    base = args[0]
    if not isinstance(base, dt.DeviceTensor) or base._kc.data is not None:
        if isinstance(base, dt.DeviceTensor) and not kwargs and _no_tensors(args, 1):
            if type(base._kc.data) is inflight.Promise:
                return _promised_view(func, base, args)
            # a view of host data with nothing else to read (a weight's t(), every linear
            # layer at every step): what run_now does, less its checks (45 -> 19 µs)
            return _results(_info(func), func, func(base._kc.data, *args[1:]), args, kwargs)
        return run_now(func, args, kwargs)        # a view of host data: free, and shares memory
    meta_in = _meta_of(base)
    try:
        meta_out = meta_call(func, args, kwargs)
    except Exception:
        return NotImplemented
    if isinstance(meta_out, torch.Tensor) and _same_layout(meta_in, meta_out):
        return dt.alias(base, meta_out)           # detach, .data, alias: the same cell
    out = _record(func, args, kwargs, "view")
    if out is NotImplemented:
        return out
    _note_views(out, args, func, kwargs)
    return out


def _promised_view(func, base, args):
    """A view of host data a program in flight promised: promised too, without waiting
    (the next step's trace takes it as an input, as it takes the view itself after a step
    run in turn). A view whose shape meta cannot give waits and runs now."""
    try:
        meta_out = meta_call(func, args, {})
    except Exception:
        meta_out = None
    if not isinstance(meta_out, torch.Tensor):
        return run_now(func, args, {})
    promise = base._kc.data
    if _same_layout(promise, meta_out):
        return dt.alias(base, meta_out)           # detach, .data: the same cell
    out = dt.wrap(promise.view(func, tuple(args[1:]), meta_out))
    dt.note_view(out, base, func, args, {}, None)
    return out


def _no_tensors(args, start) -> bool:
    """Whether ``args[start:]`` hold no tensor (nor a device), nested one level in lists."""
    for a in args[start:]:
        if isinstance(a, (torch.Tensor, torch.device)):
            return False
        if isinstance(a, (list, tuple)) and any(isinstance(x, (torch.Tensor, torch.device)) for x in a):
            return False
    return True


def _note_views(out, args, func, kwargs):
    outs = out if isinstance(out, (list, tuple)) else [out]
    for i, o in enumerate(outs):
        dt.note_view(o, args[0], func, args, kwargs, i if isinstance(out, (list, tuple)) else None)


def _same_layout(a, b) -> bool:
    return (a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset())


def _record_mutation(func, name, schema, args, kwargs):
    """An in-place update recorded as its functional form, the updated tensors rebound
    to the results; NotImplemented (run now) for views, tensors with views, and
    operations without a functional form."""
    plan = rewrites.functional_form(func, name, schema, args, kwargs)
    if plan is None:
        return NotImplemented
    functional, fargs, fkwargs, targets, returns = plan
    for t in targets:
        if not isinstance(t, dt.DeviceTensor) or t._kc.live_base() is not None or t._kc.has_live_views():
            return NotImplemented
    try:    # the in-place form on meta: the errors eager would raise (a dtype it cannot hold)
        meta_call(func, args, kwargs)
    except Exception:
        return NotImplemented
    out = _record(functional, fargs, fkwargs)
    if out is NotImplemented:
        return out
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    updated = outs[-len(targets):] if targets else []
    for t, new in zip(targets, updated):
        _rebind(t, new)
    return returns(args, outs)


def _rebind(t, new):
    """Point ``t`` (updated in place) at ``new``'s pending value, cast to ``t``'s dtype
    as an in-place update would (``int_tensor.add_(float_tensor)`` stays int)."""
    if new.dtype != t.dtype:
        new = _record(aten._to_copy.default, (new,), {"dtype": t.dtype})
    current().rebind(t._kc, new._kc.value)


def _rebind_value(t, k: int, sig: tuple):
    """:func:`_rebind` to the pending value ``k`` of signature ``sig`` (:func:`_record_values`)."""
    if sig[0] != t.dtype:
        cell = dt.Cell(value=k)
        current().hold(k, cell)
        _rebind(t, dt.made(sig, cell))
        return
    current().rebind(t._kc, k)


dt.set_handlers(dispatch, materialize)
