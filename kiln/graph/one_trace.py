"""Capture in one trace: ``torch.export`` straight to core ATen with a decomposition table.

``torch.export.export`` traces a model to pre-dispatch ATen and ``run_decompositions``
traces that whole graph again with the table; on a 30-layer decoder the second trace costs
as much as the first or more. :func:`export_decomposed` gives torch's tracer the table for
the one trace instead, which is what ``run_decompositions`` itself does on its retrace.
:mod:`kiln.graph.capture` falls back to the two traces wherever this returns None.
"""
from __future__ import annotations

import threading
import warnings

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from kiln.swap import Swap

_ONE_PASS = threading.local()
_SPLITS: dict = {}          # (table function, registered operators) -> (CIA table, Python table)
_SPLITS_LOCK = threading.Lock()


def export_decomposed(wrapper, args, table):
    """``torch.export.export(wrapper, args).run_decompositions(table())`` in one trace, or
    None when that cannot be done (the caller then takes the two traces, which have their
    own workaround for refused views).

    The graph is the same: checked node for node on a Llama decode step, a BERT and a CNN
    (only the ``_assert_tensor_metadata`` checks kiln drops differ). Measured on
    SmolLM2-135M's 8-row decode step (1 thread): 3.2 s export + 6.6 s decomposition
    against 5.3-6 s. It goes through torch's private tracer (``torch.export._trace``, as
    pinned): the tracer's ``_export_to_aten_ir`` is given the table for this thread's call
    only."""
    try:
        import torch.export._trace as trace_mod
        from torch.export.exported_program import _override_composite_implicit_decomp
        cia, python_table = _split(table)
    except (ImportError, AttributeError, TypeError):
        return None
    if not callable(getattr(trace_mod, "_export_to_aten_ir", None)) or not hasattr(trace_mod, "_export"):
        return None
    _install_one_pass(trace_mod)
    _ONE_PASS.tables = (cia, python_table, _override_composite_implicit_decomp)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ep = trace_mod._export(wrapper, args, strict=False, pre_dispatch=False)
    except Exception:     # the two-trace path reports it, or works around it
        return None
    finally:
        _ONE_PASS.tables = None
    return ep if _constants_specialised(ep, args) else None


def _constants_specialised(ep, args) -> bool:
    """Whether every non-tensor input (an int, a float) was traced as the constant it is, as
    ``torch.export.export`` does. Traced to post-dispatch ATen directly, a number can stay an
    input the graph reads (``mul.Tensor(x, n)``); kiln compiles such inputs as constants
    and checks calls against them, so that graph is not taken."""
    leaves = pytree.tree_leaves(args)
    names = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    if len(names) != len(leaves):
        return False
    used = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    return not any(name in used for name, leaf in zip(names, leaves) if not isinstance(leaf, torch.Tensor))


def _install_one_pass(trace_mod):
    """Wrap the tracer's ``_export_to_aten_ir`` once per process: it applies the thread's
    tables while `export_decomposed` runs on that thread, and is torch's own
    function for every other caller and thread."""
    if getattr(trace_mod._export_to_aten_ir, "_kiln_one_pass", False):
        return
    original = trace_mod._export_to_aten_ir

    def to_aten_ir(*args, **kwargs):
        tables = getattr(_ONE_PASS, "tables", None)
        if tables is None or kwargs.get("pre_dispatch") or kwargs.get("decomp_table") is not None:
            return original(*args, **kwargs)
        cia, python_table, override = tables
        with _plain_py_impl(), override(cia):
            return original(*args, **dict(kwargs, decomp_table=python_table))

    to_aten_ir._kiln_one_pass = True
    trace_mod._export_to_aten_ir = to_aten_ir


def _split(table) -> tuple:
    """``(CIA decompositions, Python table)``: ``table()`` split as torch's
    ``_split_decomp_table_to_cia_and_python_decomp`` does, once per set of registered
    operators rather than once per capture. Building the table and splitting it walks every
    operator torch has: 0.13-0.35 s a capture here, the same for a tiny model as for an LLM.
    The split depends only on the table and on which operators have composite kernels, so a
    new custom operator (``torch.library``) makes a new key."""
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp
    key = (table, tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
           tuple(torch.ops._dir))
    with _SPLITS_LOCK:
        found = _SPLITS.get(key)
        if found is None:
            found = _split_decomp_table_to_cia_and_python_decomp(table())
            _SPLITS.clear()         # the operators changed: the old split is stale for good
            _SPLITS[key] = found
    cia, python_table = found
    return cia, dict(python_table)       # the tracer's own copy of the Python table


def _plain_py_impl():
    """While torch applies the CIA table, ``OperatorBase.py_impl`` for a dispatch key does
    what torch's does (register the kernel, clear the dispatch cache) without its inner
    function's annotations, which Python 3.11 evaluates on each call: torch's override makes
    11,210 such calls a trace, and building those typing aliases was ~70 % of its 0.1-0.5 s
    a capture under cProfile. Other keys (modes, transforms) go to torch's. Threads tracing
    at once: torch's is put back by the last one out."""
    return _PLAIN.held(torch._ops.OperatorBase, "py_impl")


def _plain_for(original):
    python_key = torch._C.DispatchKey.Python

    def py_impl(self, k):
        if type(k) is not torch._C.DispatchKey or k == python_key:
            return original(self, k)

        def inner(fn):
            if k in self.py_kernels:
                raise RuntimeError(f"Trying to override a python impl for {k} on operator {self.name()}")
            self.py_kernels[k] = fn
            self._dispatch_cache.clear()
            return fn
        return inner
    return py_impl


_PLAIN = Swap(_plain_for)        # torch's py_impl while a capture traces
