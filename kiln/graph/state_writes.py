"""A forward that writes to its inputs, parameters or buffers: refused with what to do.

A compiled model is a function of its inputs: its weights and buffers are fixed when it
is compiled, and it writes nothing but its outputs. A forward that updates state in place
(a call counter, an exponential moving average kept in a buffer, ``x.mul_(2)`` on its
input) computes something else at every call, and no compiled graph can follow it: the
comparison with eager then failed with a message about tolerances ("Loosen atol/rtol ...,
or pass validate=False"), whose advice gives a silently wrong model. The capture's own
eager call is watched instead, by each tensor's version counter (which every in-place
write bumps, in any grad mode), and a write is a :class:`~kiln.errors.CaptureError`
naming the tensors. A forward that *reassigns* a buffer, a parameter or a plain Python
attribute (``self.n = self.n + 1``, ``self.calls += 1``) writes no tensor in place but
changes the module all the same:
the module's bindings are compared before and after the call, and a change is refused
the same way (it had given the tolerance message too, the graph traced after the eager
call starting from the changed buffer), unless a second call on the changed state gives
the same answers (:func:`settles`: a cache rebuilt, not state that moves).

Capture leaves the user's module as it was (:func:`kept`): bindings and plain attributes
are put back and buffers written in place get their values back, refused or not. Parameters and inputs
written in place get theirs back too when the capture is refused (:func:`watched_call`): the
watched eager call copies each one just before its first write, so only what is written
is copied (a copy of every weight before each capture would double a large model's
memory). Until 12-03 a refused trace left the user's weights as its example call had
written them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from kiln.errors import CaptureError


def versions(model, named_inputs: dict) -> list:
    """``(label, tensor, version)`` for each input, parameter and buffer of ``model``."""
    watched = [(f"input '{name}'", value) for name, value in named_inputs.items() if isinstance(value, torch.Tensor)]
    if isinstance(model, torch.nn.Module):
        watched += [(f"parameter '{name}'", p) for name, p in model.named_parameters()]
        watched += [(f"buffer '{name}'", b) for name, b in model.named_buffers()]
    out = []
    for label, tensor in watched:
        try:
            out.append((label, tensor, tensor._version))
        except RuntimeError:            # an inference tensor keeps no version: not watched
            pass
    return out


def bindings(model) -> dict:
    """``{label: value}`` for each parameter and buffer ``model`` holds now (by identity),
    and each plain Python attribute of its modules (a number, a string, a bool or None:
    :func:`attributes`)."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.fx.GraphModule):
        return {}
    out = {f"parameter '{name}'": p for name, p in model.named_parameters(remove_duplicate=False)}
    out.update((f"buffer '{name}'", b) for name, b in model.named_buffers(remove_duplicate=False))
    out.update((f"attribute '{prefix}{'.' if prefix else ''}{key}'", value)
               for (prefix, _, key), value in attributes(model).items())
    return out


_PLAIN = (bool, int, float, complex, str, type(None))


def attributes(model) -> dict:
    """``{(module name, module, attribute): value}`` for the public plain attributes of each
    module of ``model`` (``self.calls = 0``; ``training`` is the mode, not state). A forward
    that changes one (``self.calls += 1``, a step count its output reads) computes something
    else at every call, as a buffer written in place does; until 12-03 it met the check
    against eager, whose advice was to loosen the tolerances."""
    out = {}
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                out[(prefix, module, key)] = value
    return out


def _moved(then, now) -> bool:
    if isinstance(then, torch.Tensor) or isinstance(now, torch.Tensor):
        return then is not now
    return then is not now and not (type(then) is type(now) and then == now)


def rebound(before: dict, model) -> list:
    """Labels of the parameters, buffers and plain attributes of ``model`` reassigned (or
    added, or removed) since :func:`bindings` gave ``before``."""
    after = bindings(model)
    changed = [f"{label} (reassigned)" for label, t in after.items()
               if label in before and _moved(before[label], t)]
    changed += [f"{label} (added)" for label in after if label not in before]
    changed += [f"{label} (removed)" for label in before if label not in after]
    return changed


@contextlib.contextmanager
def kept(model):
    """Put ``model``'s parameters and buffers back as they were on leaving: each module's
    bindings (a reassigned or added one undone), and the values of buffers written in
    place (copies of the buffers are taken first; they are small next to the weights)."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.fx.GraphModule):
        yield
        return
    modules = list(model.modules())
    held = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
    plain = attributes(model)
    saved, seen = [], set()
    with torch.no_grad():
        for _, _, buffers in held:
            for b in buffers.values():
                if b is None or id(b) in seen:      # a buffer two modules share: one copy
                    continue
                seen.add(id(b))
                try:
                    saved.append((b, b._version, b.detach().clone()))
                except RuntimeError:        # an inference tensor: no version, not watched
                    pass
    try:
        yield
    finally:
        for m, params, buffers in held:
            for now, then in ((m._parameters, params), (m._buffers, buffers)):
                if list(now) != list(then) or any(now[k] is not v for k, v in then.items()):
                    now.clear()
                    now.update(then)
        for (_, m, key), value in plain.items():
            if _moved(value, vars(m).get(key, value)):
                setattr(m, key, value)
        with torch.no_grad():
            for b, version, copy in saved:
                if b._version != version:
                    b.copy_(copy)


def settles(first, again) -> bool:
    """Whether ``again()`` (the eager call repeated on the state the first call left)
    returns exactly ``first``: a forward that reassigns a buffer to the same answers each
    time (rotary tables rebuilt, or grown for a longer input) is a cache, not state."""
    with torch.no_grad():
        second = again()
    a, b = pytree.tree_flatten(first), pytree.tree_flatten(second)
    return a[1] == b[1] and all(
        (torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else
         type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)
        for x, y in zip(a[0], b[0]))


# item assignment and augmented assignment: writes with no trailing underscore in their names
_WRITING_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


class _SaveBeforeWrite(TorchFunctionMode):
    """Copies a watched tensor's values just before the first call that writes to its memory
    (itself, or a view of it), so that :meth:`restore` can put them back. A call writes where
    it says so in Python: a method named in place (``mul_``, ``copy_``, ``_foreach_add_``),
    item assignment and augmented assignment (``w[0] = 1``, ``x += 1``), an ``out=`` argument,
    or ``inplace=True``. Writes made out of sight (inside a C++ or compiled function) are
    still named by the version check, but not undone. A function mode, not a dispatch mode:
    under a Python dispatch mode, ``torch.cond``'s eager path (which compiles its branches
    with dynamo) fails, and leaves dynamo unable to compile it again in the process."""

    def __init__(self, tensors):
        super().__init__()
        self._watched = {}          # storage address -> the watched tensors in it (views of one another)
        for t in tensors:
            try:
                self._watched.setdefault(t.untyped_storage().data_ptr(), []).append(t)
            except (RuntimeError, NotImplementedError):     # no storage of its own (a subclass)
                pass
        self._saved = {}            # id(tensor) -> (tensor, its values before the first write)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._watched:
            name = getattr(func, "__name__", "")
            if (name.endswith("_") and not name.endswith("__")) or name in _WRITING_DUNDERS \
                    or kwargs.get("inplace") is True:
                self._save(args[0] if args else None)
            if kwargs.get("out") is not None:
                self._save(kwargs["out"])
        return func(*args, **kwargs)

    def _save(self, t):
        if isinstance(t, (list, tuple)):            # a _foreach_ call's tensors, out=(a, b)
            for one in t:
                self._save(one)
            return
        if not isinstance(t, torch.Tensor):
            return
        try:
            owners = self._watched.get(t.untyped_storage().data_ptr(), ())
        except (RuntimeError, NotImplementedError):
            return
        for owner in owners:
            if id(owner) not in self._saved:
                self._saved[id(owner)] = (owner, owner.detach().clone())

    def restore(self):
        with torch.no_grad():
            for tensor, values in self._saved.values():
                tensor.copy_(values)
        self._saved.clear()


def watched_call(call, before: list, rewind) -> tuple:
    """``(call(), saved, before)``: the capture's eager call, watched for writes to the
    tensors of ``before`` (:func:`versions`); ``saved`` goes to :func:`refuse_writes`, which
    puts them back if it refuses (None where nothing is watched: an FX graph). A call that
    fails under the watch is made again without it, after the written tensors are put back
    and ``rewind()`` (the random generators) has run: an operator that takes graphs of its
    own may not run under it (``torch.cond``'s eager path compiles its branches with dynamo).
    Then writes are still named, not undone, and ``before`` is read again."""
    if not before:
        with torch.no_grad():
            return call(), None, before
    mode = _SaveBeforeWrite([tensor for _, tensor, _ in before])
    try:
        with torch.no_grad(), mode:
            return call(), mode, before
    except Exception:  # noqa: BLE001 - the plain call below raises the model's own error, if any
        mode.restore()
        rewind()
    again = [(label, tensor, tensor._version) for label, tensor, _ in before]
    with torch.no_grad():
        return call(), None, again


def refuse_writes(model_name: str, before: list, reassigned=(), saved=None) -> None:
    """Raise if any tensor in ``before`` (:func:`versions`) was written since, or a
    parameter or buffer was reassigned (``reassigned``: labels from :func:`rebound`);
    ``saved`` (:func:`watched_call`'s) puts the written tensors' values back first."""
    written = [label for label, tensor, version in before if tensor._version != version]
    written += list(reassigned)
    if written:
        if saved is not None:
            saved.restore()
        shown = ", ".join(written[:6]) + (f" and {len(written) - 6} more" if len(written) > 6 else "")
        raise CaptureError(
            f"{model_name} writes to {shown} in its forward (the example call changed "
            "them, in place or by reassigning them). A compiled model is a function of its inputs, its weights and buffers fixed "
            "when it is compiled, so these writes would not happen at each call and its answers "
            "would drift from eager's. Compile a forward that leaves its inputs, parameters and "
            "buffers unchanged: return an updated value instead of writing or reassigning it, or keep "
            "such state outside the model")
