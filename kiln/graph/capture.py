"""Capture: model + example inputs → a core-ATen graph via ``torch.export``.

Inputs are bound to the model's signature so that positional and keyword
example inputs (``input_ids=..., attention_mask=...``) become one ordered list
of named arguments; that order is the order of the graph's inputs and the order
the runtime flattens call arguments in.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from kiln.artifact import specs
from kiln.errors import CaptureError
from kiln.graph import (aten_graph, computed_indices, index_ranges, numpy_inputs, one_trace, randomness, state_writes,
                        subgraph_ops, tracing_lock)
from kiln.graph.explain import VIEW_FAILURES, explain_export_failure
from kiln.graph import positional
from kiln.graph.positional import Positional

# Runtime checks export inserts for shapes/dtypes it specialised on. kiln checks
# every input's shape and dtype before a call, so these are redundant.
_CHECK_OPS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default,
              torch.ops.aten.sym_constrain_range_for_size.default,
              torch.ops.aten.sym_constrain_range.default}


@dataclass
class Captured:
    """A captured model: the unlifted graph module plus its I/O description."""
    graph_module: torch.fx.GraphModule
    arg_names: list                      # names of the top-level arguments, in graph order
    input_structure: dict                # {"dict": [[name, structure], ...]}
    input_specs: list                    # TensorSpec per flat input tensor
    output_structure: dict
    output_specs: list
    example_inputs: list                 # flat input tensors
    eager_outputs: list                  # flat reference outputs from eager PyTorch
    model_name: str = "model"
    notes: list = field(default_factory=list)
    exported: object = None              # the ExportedProgram (decomposed) the graph came from
    tensor_mask: list | None = None      # which pytree input leaves are tensors
    draws: object = None                 # randomness.Draws before eager_outputs were computed
    capture_seconds: float | None = None  # set by a caller that captured it for a compile (the cache's hook)
    index_ranges: dict | None = None     # inputs that index, and eager's range (kiln.graph.index_ranges)
    positional: int | None = None        # how many leading arg_names a call may give positionally


def bind_inputs(model, example_inputs, example_kwargs=None) -> dict:
    """Ordered {arg name: value} for the example call, in signature order.

    ``*args`` entries are named ``args[0]``, ``args[1]``... A dict of names this
    function returned is accepted again as keywords (bucketed examples are built
    that way), so binding is idempotent. NumPy arrays are tensors (:mod:`kiln.graph.numpy_inputs`).
    """
    example_inputs, example_kwargs = numpy_inputs.as_tensors((example_inputs, example_kwargs))
    if isinstance(example_inputs, (torch.Tensor, dict)) or example_inputs is None:
        args = () if example_inputs is None else (example_inputs,)
    else:
        args = tuple(example_inputs)
    if isinstance(example_inputs, dict) and not example_kwargs:
        args, example_kwargs = (), example_inputs
    kwargs = dict(example_kwargs or {})
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        sig = inspect.signature(fn)
        if not args:
            args = _positional_from_names(sig, kwargs)
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise CaptureError(f"example inputs do not fit the signature of {model_name(model)}: {e}") from None
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            for i, v in enumerate(value):
                out[f"{name}[{i}]"] = v
        elif kind == inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def _positional_from_names(sig, kwargs: dict) -> tuple:
    """Pop from ``kwargs`` the values bound names give to ``*args`` entries (``args[0]``...)
    and positional-only parameters, with the positional parameters before them."""
    P = inspect.Parameter
    params = list(sig.parameters.values())
    star = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
    if f"{star}[0]" not in kwargs and not any(p.kind is P.POSITIONAL_ONLY and p.name in kwargs
                                             for p in params):
        return ()
    args = []
    for p in params:
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) and p.name in kwargs:
            args.append(kwargs.pop(p.name))
        elif p.kind is P.VAR_POSITIONAL:
            i = 0
            while f"{p.name}[{i}]" in kwargs:
                args.append(kwargs.pop(f"{p.name}[{i}]"))
                i += 1
            break
        else:
            break
    return tuple(args)


def positional_count(model, names) -> int:
    """How many of :func:`bind_inputs`' ``names`` (a prefix) must be passed positionally.

    Bound names are in signature order, so positional parameters come first. Only
    what cannot be passed by keyword is counted: ``*args`` entries (``args[0]``...)
    and positional-only parameters, together with everything before them. Models
    without either are called with keywords alone, as before.
    """
    fn = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return 0
    count = 0
    for i, name in enumerate(names):
        base = name.partition("[")[0] if name.endswith("]") else name
        p = params.get(base)
        if p is None or p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
            break
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY):
            count = i + 1
    return count


def call_bound(model, named: dict):
    """Call ``model`` with :func:`bind_inputs`' ``named`` values the way it was bound."""
    names = list(named)
    n = positional_count(model, names)
    return model(*(named[k] for k in names[:n]), **{k: named[k] for k in names[n:]})


def model_name(model) -> str:
    """What a compile of ``model`` is called unless ``name=`` says: its class, or a function's name."""
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "function")


def capture(model, example_inputs, example_kwargs=None, *, decompose=True, fast=True) -> Captured:
    """Capture in eval mode (inference graphs), leaving the user's module as it was.
    ``fast``: a graph that is already ATen is traced once with ``make_fx``
    (:mod:`kiln.graph.aten_graph`), with no ``ExportedProgram`` kept (``exported`` None).
    A forward that writes to (or reassigns) its inputs, parameters or buffers is refused
    (:mod:`kiln.graph.state_writes`), and buffers are put back as they were; FX graphs (PyTorch's, the device's) are not watched."""
    if isinstance(model, torch.jit.ScriptModule):
        raise CaptureError(f"{model_name(model)} is TorchScript (torch.jit.script or torch.jit.trace), which "
                           "torch.export cannot trace: pass the original nn.Module (or function) instead")
    with eval_mode(model), _stack_traces(getattr(model, "kiln_record_stack_traces", True)):
        return _capture(model, example_inputs, example_kwargs, decompose, fast)


@contextlib.contextmanager
def eval_mode(model):
    """``model`` in eval mode (dropout off, batch norm on its running statistics, which it
    then leaves alone), each module's own mode put back after: a model in training with a
    frozen batch norm in eval mode comes back so (``model.train()`` afterwards turned every
    module to training, and the frozen statistics moved at the next step). Its state is put
    back too (:func:`kiln.graph.state_writes.kept`): kiln's eager runs leave none behind."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    if modes:
        model.eval()
    try:
        with state_writes.kept(model):
            yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _stack_traces(record: bool):
    """Whether the trace records each node's source line (``node.meta["stack_trace"]``, which
    the op report's locations come from). A model whose lines are nobody's to fix says no
    with ``kiln_record_stack_traces = False`` (kiln's LLM graphs): recording costs about a
    sixth of a large model's trace."""
    import torch.fx.config as fx_config
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = before or not record
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def _capture(model, example_inputs, example_kwargs, decompose, fast=True) -> Captured:
    named = bind_inputs(model, example_inputs, example_kwargs)
    names = list(named)
    n_positional = positional_count(model, names)
    leaves, in_specs = [], []
    structure = {"dict": [[n, specs.encode(v, n, leaves, in_specs)] for n, v in named.items()]}

    draws = randomness.Draws()
    # an FX graph (PyTorch's, the device's) is functional by construction: not watched
    watched = [] if isinstance(model, torch.fx.GraphModule) else state_writes.versions(model, named)
    bound = state_writes.bindings(model)      # a buffer reassigned in forward is a write too
    eager, saved, watched = state_writes.watched_call(lambda: call_bound(model, named), watched, draws.restore)
    reassigned = state_writes.rebound(bound, model)
    if reassigned and state_writes.settles(eager, lambda: (draws.restore(), call_bound(model, named))[1]):
        reassigned = []                       # a cache rebuilt to the same values, not moving state
    state_writes.refuse_writes(model_name(model), watched, reassigned, saved)
    out_leaves, out_specs = [], []
    out_structure = specs.encode(eager, "", out_leaves, out_specs)
    for i, s in enumerate(out_specs):
        if not s.name:
            out_specs[i] = specs.TensorSpec(f"output{i}", s.shape, s.dtype)

    tensor_mask = [isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(tuple(named.values()))]
    with tracing_lock.held():      # one trace at a time in a process, after the eager run
        gm = aten_graph.traced(model, list(named.values()), decompositions) if decompose and fast else None
        if gm is not None:
            _reshape_views_of_whole_ops(gm)
            return _captured(gm, None, model, names, structure, in_specs, out_structure, out_specs, leaves,
                             out_leaves, tensor_mask, draws)
        module = model if isinstance(model, torch.nn.Module) else FunctionModule(model)
        wrapper = Positional(module, names, n_positional, tuple(named.values()))
        ep = one_trace.export_decomposed(wrapper, tuple(named.values()), decompositions) if decompose else None
        if ep is None:
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecations
                    ep = torch.export.export(wrapper, tuple(named.values()), strict=False)
            except Exception as e:  # torch raises many unrelated types here
                raise CaptureError(explain_export_failure(e, model_name(model))) from e
            if decompose:
                ep = decompose_program(ep, model_name(model))
        return _captured(graph_module(ep, tensor_mask), ep, model, names, structure, in_specs, out_structure,
                         out_specs, leaves, out_leaves, tensor_mask, draws)


def _captured(gm, ep, model, names, structure, in_specs, out_structure, out_specs, leaves, out_leaves,
              tensor_mask, draws) -> Captured:
    subgraph_ops.refuse(gm, model_name(model))
    randomness.lay_out_as_eager(gm)      # random ops draw into eager's layout, wherever they run
    graph_outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if len(graph_outputs) != len(out_leaves):
        raise CaptureError(f"{model_name(model)} returns non-tensor values the compiled graph cannot "
                           "produce; return only tensors (in tuples, lists or dicts)")
    captured = Captured(gm, names, structure, in_specs, out_structure, out_specs,
                        list(leaves), [t.detach() for t in out_leaves], model_name(model))
    captured.exported, captured.tensor_mask, captured.draws = ep, tensor_mask, draws
    captured.index_ranges = index_ranges.of_inputs(gm, captured.input_specs)   # before partitioning
    captured.positional = positional.prefix(model, names)
    return captured


def from_graph(gm: torch.fx.GraphModule, example_inputs, name: str = "graph") -> Captured:
    """A ``Captured`` for an FX graph taking and returning flat tensors: where a
    ``torch.compile`` backend or a lazy device's ``mark_step`` enters the compiler
    (at the plan phase, skipping the user's model). The graph is normalised to core
    ATen by exporting it like any module, which also checks that it is functional."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise CaptureError(f"from_graph takes a torch.fx.GraphModule, not {type(gm).__name__}")
    inputs = tuple(example_inputs)
    bad = [type(x).__name__ for x in inputs if not isinstance(x, torch.Tensor)]
    if bad:
        raise CaptureError(f"from_graph takes flat tensor inputs; got {', '.join(bad)}")
    captured = capture(gm, inputs)
    captured.model_name = name
    return captured


# Ops kept whole when the graph is lowered to core ATen. Scaled dot-product attention is
# the one that matters: engines have a fused form of it (ONNX's Attention op from opset
# 23, Inductor's and eager's flash-attention CPU kernel) and do not recognise the dozen
# ops its decomposition leaves behind (the scale split over Q and K, the safe-softmax
# guard for fully masked rows). OpenVINO converts it whole too, but not in every form
# (repeated key/value heads): it decomposes those in its own copy of the partition
# (kiln.engines.ov_graph.prepared).
KEEP_WHOLE = (torch.ops.aten.scaled_dot_product_attention.default,)


def decompositions():
    """torch.export's core-ATen decomposition table without the ops in KEEP_WHOLE and the
    index writes kept for their check (:mod:`kiln.graph.computed_indices`), and with
    :func:`_flash_attention_for_cpu` in place of torch's."""
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE + tuple(computed_indices.FROM_END_WHEN_COMPILED):
        table.pop(op, None)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    if flash in table:
        table[flash] = _flash_attention_for_cpu(table[flash])
    return table


def _flash_attention_for_cpu(torch_decomposition):
    """torch's decomposition of the CPU flash-attention op returns the attention
    *weights* as its second output, where the op returns their log-sum-exp (``[N, H,
    L]``): harmless for inference, which drops it, wrong in a training graph, which saves
    it for the backward pass (torch 2.13). This one returns the real log-sum-exp of the
    scaled, masked scores, in float32 as the kernel does."""
    def decompose(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        output, _ = torch_decomposition(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        if key.size(1) != query.size(1):                        # grouped-query attention
            repeat = query.size(1) // key.size(1)
            key = key.repeat_interleave(repeat, dim=1)
        scale_ = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
        scores = (query.float() @ key.float().transpose(-2, -1)) * scale_
        if is_causal:
            keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                      else scores + attn_mask.float())
        return output, torch.logsumexp(scores, dim=-1)
    return decompose


def decompose_program(ep, model_name: str = "model"):
    """``ep.run_decompositions()`` (core ATen but for :data:`KEEP_WHOLE`), retried once
    with views made reshapes when a ``view`` is refused.

    Why: ``torch.export`` records ``aten.view`` nodes that were valid for the strides
    its pre-dispatch trace saw, and drops ``.contiguous()`` calls that were no-ops
    there. ``run_decompositions()`` re-traces with the *decompositions* of the ops,
    and a decomposition need not give its output the strides the op's meta function
    gave. The one that breaks Hugging Face models is
    ``_scaled_dot_product_flash_attention_for_cpu`` (what ``scaled_dot_product_attention``
    dispatches to on CPU): its meta allocates the output like the query
    (``empty_like(query)``), so for ``q = x.view(b, s, h, d).transpose(1, 2)`` the
    output transposed back is contiguous and ``.reshape(b, s, -1).contiguous()
    .view(-1, h * d)`` (GPT-2's ``Conv1D``, any ``x.view(-1, x.size(-1))``) is a
    view; torch's decomposition (``torch/_decomp/decompositions.py``) returns it in a
    fixed ``(L, N, H, E)`` layout, tuned for ``nn.MultiheadAttention``, on which the
    same view is impossible: ``ValueError: Cannot view a tensor ... strides (32, 64, 1)``.
    Plain ``torch.export(...).run_decompositions()`` fails the same way (a torch bug).

    The workaround is general, not tied to attention: ``aten.view`` and
    ``aten.reshape`` mean the same thing wherever the view is possible (reshape
    *is* a view then), and where it is not, reshape copies, which is what eager's
    ``.contiguous()`` did. So when decomposition refuses a view, every ``aten.view``
    whose result is never written in place (there a copy would lose the aliasing)
    becomes ``aten.reshape`` and decomposition runs again; the graph is validated
    against eager afterwards like any other. Models that decompose the first time
    take exactly the old path.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # torch-internal pytree deprecations
        try:
            return ep.run_decompositions(decompositions())
        except Exception as e:
            first = e
        if any(s in str(first) for s in VIEW_FAILURES) and _views_to_reshapes(ep.graph_module):
            try:
                return ep.run_decompositions(decompositions())
            except Exception:
                pass
    raise CaptureError(explain_export_failure(first, model_name, stage="decomposing the exported "
                                              "graph to core ATen")) from first


def _views_to_reshapes(gm: torch.fx.GraphModule) -> int:
    """Turn the graph's ``aten.view`` nodes into ``aten.reshape`` where no in-place op
    writes to any alias of the viewed tensor (its base, the view, views of either),
    so a copy cannot miss a write; returns how many changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default \
                and not _written_in_place(_alias_root(node)):
            node.target = torch.ops.aten.reshape.default
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _returns_alias(node: torch.fx.Node) -> bool:
    import operator
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``node`` is a view of, following views (and in-place results) up."""
    while _returns_alias(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _written_in_place(node: torch.fx.Node) -> bool:
    """Whether an op may write to ``node``'s value through it or one of its views.
    Unknown callables (higher-order ops) count as writers."""
    import operator
    todo, seen = [node], set()
    while todo:
        value = todo.pop()
        for user in value.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if user.op != "call_function":
                return True
            if user.target is operator.getitem:        # an element of a split's list of views
                todo.append(user)
                continue
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                return True
            for i, arg in enumerate(schema.arguments):
                given = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
                uses = given is value or (isinstance(given, (list, tuple)) and value in given)
                if uses and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
            if _returns_alias(user):
                todo.append(user)                      # a view of it: follow its users too
    return False


def graph_module(ep, tensor_mask) -> torch.fx.GraphModule:
    """The runnable graph of an ExportedProgram in kiln's plain convention: flat tensors
    in (non-tensor leaves dropped), flat tensors out, no redundant runtime checks.
    Separate from capture so a saved ExportedProgram (parallel-compile) gets the same graph."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        gm = ep.module()
    gm.graph._codegen = torch.fx.graph.CodeGen()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    # export keeps a placeholder per pytree leaf; non-tensor leaves (None, ints)
    # were specialised into the graph, so their placeholders must be unused.
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(tensor_mask):
        raise CaptureError(f"internal: graph has {len(placeholders)} inputs for {len(tensor_mask)} leaves")
    for node, is_tensor in zip(placeholders, tensor_mask):
        if not is_tensor:
            if node.users:
                raise CaptureError(f"input '{node.name}' is a non-tensor value the graph depends on; "
                                   "pass it as a tensor or bake it into the model")
            gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CHECK_OPS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    # The graph returns one value per flat tensor output, in pytree order; constants
    # (None, ints) live in the output structure instead.
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_node.args = (tuple(v for v in pytree.tree_leaves(out_node.args[0]) if isinstance(v, torch.fx.Node)),)
    _reshape_views_of_whole_ops(gm, recompile=False)
    # code generated once, after every edit (0.1-0.25 s each for a 30-layer decoder's graph)
    gm.recompile()
    return gm


def _reshape_views_of_whole_ops(gm: torch.fx.GraphModule, recompile: bool = True) -> int:
    """An op kept whole lays its output out as the kernel torch picks at run time does
    (SDPA: flash attention's layout under no_grad, the math kernel's with grad), not
    necessarily as at export, so a view of it that export recorded can be refused.
    Those views become reshapes: the same view wherever it is possible, a copy elsewhere."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            root = _alias_root(node)
            if root.op == "call_function" and root.target in KEEP_WHOLE and not _written_in_place(root):
                node.target = torch.ops.aten.reshape.default
                changed += 1
    if changed and recompile:
        gm.recompile()
    return changed


class FunctionModule(torch.nn.Module):
    """A plain function as a module, so functions capture and run like models."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)
