"""Capture: model + example inputs → a core-ATen graph via ``torch.export``.

Inputs are bound to the model's signature so that positional and keyword
example inputs (``input_ids=..., attention_mask=...``) become one ordered list
of named arguments; that order is the order of the graph's inputs and the order
the runtime flattens call arguments in.
"""
from __future__ import annotations

import inspect
import os
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from . import specs
from .errors import CaptureError

_TORCH_DIR = os.path.dirname(torch.__file__)

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


def bind_inputs(model, example_inputs, example_kwargs=None) -> dict:
    """Ordered {arg name: value} for the example call, in signature order."""
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
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise CaptureError(f"example inputs do not fit the signature of {_name(model)}: {e}") from None
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


def _name(model) -> str:
    return type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "function")


class _Positional(torch.nn.Module):
    """Calls the model with named arguments passed positionally to export.

    Exporting through this wrapper gives the graph one input per flat tensor
    in exactly :func:`bind_inputs`' order, whatever mix of positional and
    keyword arguments the user's example used.
    """

    def __init__(self, model, names, var_positional):
        super().__init__()
        self.model = model
        self.names = names
        self.var_positional = var_positional

    def forward(self, *values):
        args, kwargs = [], {}
        for name, value in zip(self.names, values):
            if name in self.var_positional:
                args.append(value)
            else:
                kwargs[name] = value
        return self.model(*args, **kwargs)


def capture(model, example_inputs, example_kwargs=None, *, decompose=True) -> Captured:
    """Capture in eval mode (inference graphs), leaving the user's module as it was."""
    was_training = isinstance(model, torch.nn.Module) and model.training
    if was_training:
        model.eval()
    try:
        return _capture(model, example_inputs, example_kwargs, decompose)
    finally:
        if was_training:
            model.train()


def _capture(model, example_inputs, example_kwargs, decompose) -> Captured:
    named = bind_inputs(model, example_inputs, example_kwargs)
    names = list(named)
    var_positional = {n for n in names if n.endswith("]")}
    if var_positional:
        raise CaptureError("models with *args in forward() are not supported yet; wrap the model "
                           "in a module with named arguments")
    leaves, in_specs = [], []
    structure = {"dict": [[n, specs.encode(v, n, leaves, in_specs)] for n, v in named.items()]}

    with torch.no_grad():
        eager = model(**named)
    out_leaves, out_specs = [], []
    out_structure = specs.encode(eager, "", out_leaves, out_specs)
    for i, s in enumerate(out_specs):
        if not s.name:
            out_specs[i] = specs.TensorSpec(f"output{i}", s.shape, s.dtype)

    module = model if isinstance(model, torch.nn.Module) else _FunctionModule(model)
    wrapper = _Positional(module, names, var_positional)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch-internal pytree deprecations
            ep = torch.export.export(wrapper, tuple(named.values()), strict=False)
    except Exception as e:  # torch raises many unrelated types here
        raise CaptureError(explain_export_failure(e, _name(model))) from e
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if decompose:
            ep = ep.run_decompositions()
    tensor_mask = [isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(tuple(named.values()))]
    gm = graph_module(ep, tensor_mask)
    graph_outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if len(graph_outputs) != len(out_leaves):
        raise CaptureError(f"{_name(model)} returns non-tensor values the compiled graph cannot "
                           "produce; return only tensors (in tuples, lists or dicts)")
    captured = Captured(gm, names, structure, in_specs, out_structure, out_specs,
                        list(leaves), [t.detach() for t in out_leaves], _name(model))
    captured.exported, captured.tensor_mask = ep, tensor_mask
    return captured


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
    gm.recompile()
    # The graph returns one value per flat tensor output, in pytree order; constants
    # (None, ints) live in the output structure instead.
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_node.args = (tuple(v for v in pytree.tree_leaves(out_node.args[0]) if isinstance(v, torch.fx.Node)),)
    gm.recompile()
    return gm


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def user_frame(stack_trace: str | None) -> str | None:
    """``file:line`` of the innermost frame outside torch itself, from an fx stack trace."""
    if not stack_trace:
        return None
    frames = _FRAME.findall(stack_trace)
    if not frames:
        return None
    outside = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    path, line, func, code = (outside or frames)[-1]
    return f"{path}:{line} in {func}: {code.strip()}"


def explain_export_failure(exc: Exception, model_name: str) -> str:
    """Turn a torch.export failure into a short message pointing at the user's line."""
    text = str(exc)
    kind = type(exc).__name__
    frames = [f for f in _FRAME.findall(text) if not f[0].startswith(_TORCH_DIR)]
    where = ""
    if frames:
        path, line, func, code = frames[-1]
        where = f"\n  at {path}:{line} in {func}: {code.strip()}"
    else:
        m = re.search(r'(/[^\s"]+\.py):(\d+)', text)
        if m and not m.group(1).startswith(_TORCH_DIR):
            where = f"\n  at {m.group(1)}:{m.group(2)}"
    if "data-dependent" in text or "GuardOnDataDependent" in kind or "DataDependent" in kind:
        why = ("the model branches or sizes something on a tensor's *value* (data-dependent control "
               "flow), which a compiled static graph cannot represent")
        fix = ("make the branch independent of tensor values, or use torch.cond / torch._check "
               "to express it")
    elif "Unsupported" in kind or "not supported" in text.lower():
        why = "the model uses a Python construct torch.export cannot trace"
        fix = "simplify that code path or move it outside the model's forward()"
    else:
        why = f"torch.export failed ({kind})"
        fix = "see the cause below; run torch.export.export(model, args) directly for the full report"
    first = text.strip().splitlines()[0] if text.strip() else kind
    return (f"cannot capture {model_name}: {why}.{where}\n  cause: {first[:400]}\n  fix: {fix}")
