"""The fast cache key: what a model computes, read from its Python objects without capturing it.

``kiln.trace`` keys a cache entry by the captured graph (:func:`kiln.compiler.keys.graph_key`),
which costs a ``torch.export``. The fingerprint names the same entry through an alias before
any capture, so it must change whenever the answer can: a fingerprint shared by two models
that compute differently serves one the other's artifact, a silently wrong answer. It holds:

* every module's class: its source file's content, its package's version, and the code of
  the methods of classes defined outside installed packages (a class typed in a notebook or
  ``python -c`` has no file to read);
* every module's state, read deeply: numbers and strings, tensors by content (attributes
  that are neither parameters nor buffers included), containers, ``config`` objects by
  ``to_dict()``, functions by code, constants, closures and defaults, ``functools.partial``
  by its arguments, plain helper objects by their attributes, unregistered modules by their
  class and weights;
* the globals those methods and functions read that hold values (a ``SCALE = 3.0`` set at
  run time), and the source files of the user's own modules they reach (a helper in
  another file of the project), transitively;
* the weights, the example inputs' shapes and dtypes, the options and the environment.

Anything it cannot read (an object with no state to look at, such as a handle from a C
extension) makes the fingerprint None: that model is captured every time and keyed by its
graph, slower on a warm cache but never wrong. Installed packages are identified by their
versions, not read.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import logging
import os
import sys
import sysconfig
import types

import numpy as np
import torch

from kiln.artifact import specs
from kiln.compiler import keys
from kiln.host import target as target_mod

log = logging.getLogger("kiln")

_SKIP = {"_parameters", "_buffers", "_modules", "training",
         "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
         "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_non_persistent_buffers_set",
         "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
         "_is_full_backward_hook", "_compiled_call_impl"}
# Forward hooks change what the model computes; their dict keys are process-global
# counters, so only the hooks themselves (in order) go into the fingerprint.
_HOOKS = {"_forward_hooks", "_forward_pre_hooks"}
_DEPTH = 8
_SIMPLE = (int, float, bool, str, bytes, type(None))


class Opaque(Exception):
    """Something in the model the fingerprint cannot read."""


def fingerprint(model, named_inputs: dict, opts, extra=None) -> str | None:
    """The fast key (module doc), or None for a model it cannot describe (not an
    ``nn.Module``, or holding state it cannot read), which then always captures."""
    if not isinstance(model, torch.nn.Module):
        return None
    reader = _Reader(model)
    try:
        modules = [[name, reader.class_digest(type(mod)), reader.module_state(mod)]
                   for name, mod in model.named_modules()]
        sources = reader.sources()
    except Opaque as e:
        log.info("kiln cache: %s holds %s, which the fingerprint cannot read; capturing it every time",
                 type(model).__name__, e)
        return None
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    leaves, in_specs = [], []
    structure = {n: specs.encode(v, n, leaves, in_specs) for n, v in named_inputs.items()}
    return keys._hash_json({
        "kind": "fingerprint", "modules": modules, "sources": sources, "weights": keys.tensors_digest(tensors),
        "inputs": [s.to_dict() for s in in_specs], "structure": structure,
        "options": keys._options_for_key(opts), "extra": extra, "env": keys._environment(),
        "target": target_mod.describe(opts.target, opts.device)})


class _Reader:
    """One fingerprint's walk: the values read, and the user modules reached on the way."""

    def __init__(self, model):
        self.registered = {id(m) for m in model.modules()}
        self.user_modules: set = set()
        self.seen_functions: set = set()
        self.classes: dict = {}

    # -- modules ---------------------------------------------------------------------------------
    def module_state(self, mod) -> dict:
        if isinstance(mod, torch.fx.GraphModule):
            # what it computes is its graph and its constants (plain tensor attributes), not
            # its bookkeeping; a lazily compiled one (AOTAutograd's) has no _code until run
            return {"graph": mod.code, **{k: self.value(v) for k, v in vars(mod).items()
                                          if isinstance(v, torch.Tensor)}}
        return {k: self.value(list(v.values()) if k in _HOOKS else v)
                for k, v in vars(mod).items() if k not in _SKIP}

    def class_digest(self, cls) -> list:
        """The class (:func:`keys._class_digest`: qualname, file content, package version),
        and for classes of the user's own code, their methods' code and what it reads."""
        if cls in self.classes:
            return self.classes[cls]
        self.classes[cls] = ["class", cls.__qualname__]      # while reading it (a method naming its class)
        out = keys._class_digest(cls)
        self._note(cls.__module__)
        own = [c for c in cls.__mro__ if any(not _library_code(f) for f in map(_function_of, vars(c).values()) if f)]
        if own:
            out = out + [[c.__qualname__, sorted((name, self.value(v)) for name, v in vars(c).items()
                                                 if _is_code(v))] for c in own]
        self.classes[cls] = out
        return out

    # -- values ----------------------------------------------------------------------------------
    def value(self, v, depth=0):
        """``v`` as canonical JSON; raises :class:`Opaque` for what cannot be read."""
        if isinstance(v, _SIMPLE):
            return v if not isinstance(v, bytes) else ["bytes", hashlib.sha256(v).hexdigest()]
        if depth > _DEPTH:
            raise Opaque(f"state nested deeper than {_DEPTH} levels")
        d = depth + 1
        if isinstance(v, torch.Tensor):
            return ["tensor", keys._compute_digest(v)]
        if isinstance(v, np.ndarray):
            return ["ndarray", str(v.dtype), list(v.shape), hashlib.sha256(np.ascontiguousarray(v).data).hexdigest()]
        if isinstance(v, (list, tuple)):
            return [type(v).__name__, [self.value(x, d) for x in v]]
        if isinstance(v, (set, frozenset)):
            # sorted: a set's order follows string hashing, which differs per process
            return ["set", sorted((self.value(x, d) for x in v), key=keys._hash_json)]
        if isinstance(v, dict):
            return ["dict", sorted([[self.value(k, d), self.value(x, d)] for k, x in v.items()], key=keys._hash_json)]
        if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout, torch.Size)):
            return ["torch", str(v)]
        if isinstance(v, enum.Enum):
            return ["enum", type(v).__qualname__, str(v)]
        if isinstance(v, torch.nn.Module):
            if id(v) in self.registered:        # its state is read as one of the model's modules
                return ["module", type(v).__qualname__]
            # kept outside the module tree (a plain list of layers): its weights count too
            return ["unregistered module", self.class_digest(type(v)), self.module_state(v),
                    keys.tensors_digest(list(v.named_parameters()) + list(v.named_buffers()))]
        if isinstance(v, type):
            return ["class", self.class_digest(v)]
        if isinstance(v, types.ModuleType):
            self._note(v.__name__)
            return ["python module", v.__name__]
        if isinstance(v, functools.partial):
            return ["partial", self.value(v.func, d), self.value(v.args, d), self.value(v.keywords, d)]
        if isinstance(v, types.MethodType):
            return ["method", self.value(v.__func__, d), self.value(v.__self__, d)]
        if isinstance(v, (staticmethod, classmethod)):
            return [type(v).__name__, self.value(v.__func__, d)]
        if isinstance(v, property):
            return ["property", self.value(v.fget, d), self.value(v.fset, d)]
        if isinstance(v, types.FunctionType):
            return self.function(v, d)
        if hasattr(v, "to_dict") and callable(v.to_dict) and not isinstance(v, type):
            try:
                return [type(v).__qualname__, self.value(v.to_dict(), d)]
            except Opaque:
                raise
            except Exception:  # noqa: BLE001 - read it as a plain object instead
                pass
        if callable(v) and not hasattr(v, "__dict__"):    # builtins, C functions, torch ops
            return ["builtin", getattr(v, "__module__", None), getattr(v, "__qualname__", None) or repr(v)]
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict):     # an object by its attributes: a repr may leave some out
            return ["object", self.class_digest(type(v)), self.value(state, d)]
        text = repr(v)
        if " at 0x" in text:
            raise Opaque(f"a {type(v).__qualname__} ({text[:60]})")
        return [type(v).__qualname__, text]    # a value with no attributes (a number type, a range)

    def function(self, fn, depth) -> list:
        """A Python function: its code (constants included: ``t * 2.0`` and ``t * 3.0``
        share their bytecode), defaults, closure and the value-holding globals it reads.
        A library's function is named, not read: its package version covers it."""
        if _library_code(fn):
            return ["library function", fn.__module__, fn.__qualname__, keys._package_version(
                (fn.__module__ or "").split(".")[0])]
        if id(fn) in self.seen_functions:      # recursion (a function reading itself)
            return ["function", fn.__module__, fn.__qualname__]
        self.seen_functions.add(id(fn))
        self._note(fn.__module__)
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(self.value(cell.cell_contents, depth))
            except ValueError:                  # an empty cell
                cells.append(["empty cell"])
        names = sorted(_names(fn.__code__))
        reads = [[n, self.value(fn.__globals__[n], depth)] for n in names
                 if n in fn.__globals__ and not isinstance(fn.__globals__[n], types.ModuleType)]
        return ["function", fn.__module__, fn.__qualname__, _code_digest(fn.__code__),
                self.value(fn.__defaults__, depth), self.value(fn.__kwdefaults__, depth), cells, reads]

    # -- the user's source files -----------------------------------------------------------------
    def _note(self, module_name):
        if module_name and _is_user_module(module_name):
            self.user_modules.add(module_name)

    def sources(self) -> list:
        """Content digests of the user's modules reached, and of those they reach through
        their globals (imported modules, and functions and classes from them)."""
        todo, seen = list(self.user_modules), set(self.user_modules)
        while todo:
            mod = sys.modules.get(todo.pop())
            for v in list(vars(mod).values()) if mod is not None else ():
                name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
                if isinstance(name, str) and name not in seen and _is_user_module(name):
                    seen.add(name)
                    todo.append(name)
        return sorted(_source_digest(sys.modules.get(name)) for name in seen)


def _is_code(v) -> bool:
    return isinstance(v, (types.FunctionType, staticmethod, classmethod, property))


def _function_of(v):
    """The Python function behind a class attribute (a method, static or class method,
    property getter), or None."""
    v = v.fget if isinstance(v, property) else v
    v = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
    return v if isinstance(v, types.FunctionType) else None


def _library_code(fn) -> bool:
    """Whether ``fn`` is an installed package's or the interpreter's code (named, not read):
    its file is there and outside the user's code. Code typed in ``python -c``, a notebook
    or ``exec`` has no such file and is read."""
    return _library_file(fn.__code__.co_filename)


@functools.lru_cache(maxsize=4096)
def _library_file(path: str) -> bool:
    return os.path.isfile(path) and not _is_user_file(path)


def _names(code) -> set:
    """The global names ``code`` and the code nested in it read."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def _code_digest(code) -> str:
    """Bytecode, constants (nested code objects by their own digest) and names."""
    h = hashlib.sha256(code.co_code)
    for c in code.co_consts:
        h.update(_const(c).encode())
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                   code.co_kwonlyargcount, code.co_flags)).encode())
    return h.hexdigest()


def _const(c) -> str:
    """A code constant as text the same in every process: a frozenset's elements (``x in
    {"a", "b"}``) sorted, since its order follows per-process string hashing."""
    if isinstance(c, types.CodeType):
        return _code_digest(c)
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const(x) for x in c) + ")"
    return f"{type(c).__name__}:{c!r}"


def _source_digest(module) -> str:
    path = getattr(module, "__file__", None)
    if not path:
        return "no file"
    try:
        st = os.stat(path)
    except OSError:
        return "unreadable"
    return _file_digest(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1024)
def _file_digest(path, mtime_ns, size) -> str:
    """A file's content digest, cached while its modification time and size stay put (an
    edited file reloaded in the same process, as notebooks' autoreload does, is read again)."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


@functools.lru_cache(maxsize=None)
def _library_roots() -> tuple:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # kiln: kiln_source covers it
    for base in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        roots.add(os.path.join(base, "lib"))
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


@functools.lru_cache(maxsize=4096)
def _is_user_file(path: str) -> bool:
    real = os.path.realpath(path)
    return not real.startswith(_library_roots()) and "site-packages" not in real and "dist-packages" not in real


def _is_user_module(name) -> bool:
    """A module of the user's own code: one with a source file outside the interpreter's
    library and installed packages (``__main__`` run from a script included)."""
    if not isinstance(name, str) or name in sys.builtin_module_names:
        return False
    mod = sys.modules.get(name)
    path = getattr(mod, "__file__", None)
    if mod is None or not path:
        # a class or function typed in ``python -c`` or a notebook: no file, but its code is read
        return name == "__main__"
    return _is_user_file(path)
