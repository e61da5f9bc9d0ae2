"""Tracing a model with torch.fx and cutting the graph into pipeline stages.

NxD's pipeline model is a torch.fx graph of the whole model in which the transformer
layers (and any ``leaf_module_cls``) stay opaque ``call_module`` nodes. A cut named
``"layers.1"`` ends a stage right *after* the node that calls that module. Every stage
becomes a ``GraphModule`` of its own, built from the same root, so its submodules and
parameters keep their original qualified names (``layers.1.mlp.weight``): a stage's
``state_dict`` is already in the original model's names, and two stages that use one
parameter (tied embeddings) hold the same ``Parameter`` object, which is how shared
weights are found.

What crosses a cut is every value made at or before the cut and used after it, in
graph order (values a stage does not use itself pass through it). Model inputs never
cross: every pipeline rank gets all of ``run_train``'s keyword arguments, as in NxD, and
feeds each stage the ones it reads. Parameters read with ``get_attr`` never cross either:
each stage that reads one reads its own reference.

Calls that must stay whole stay whole: kiln's collective mappings (``mappings.*``, also
called directly in a forward, e.g. sequence-parallel gathers), ``parallel_cross_entropy``
and ``from_parallel_logits_to_logprobs``, and any ``torch.autograd.Function``'s ``apply``
become one ``call_function`` node each. Traced into, their collectives
(``torch.ops.kiln.*``, which have no autograd) left every gradient before them zero, and
their own backward was lost. An in-place op whose result is unused (``logits.sub_(max)``)
is not dead code: it changes a value used later, so it is kept.
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.errors import KilnError


class PipelineError(KilnError, RuntimeError):
    """The pipeline cannot be built or run as asked (the message says which option)."""


class PipelineInputError(PipelineError, ValueError):
    """run_train/run_eval got inputs that do not match the traced ones."""


# kiln's parallel layers stay whole in the pipeline graph, as NxD keeps its PARALLEL_MODULES
PARALLEL_MODULE_NAMES = ("ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding",
                         "GQAQKVColumnParallelLinear")


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return list(value)
    return [value]


def _kiln_leaf_functions():
    """kiln's functions that run collectives inside autograd Functions, and the modules
    (kiln's, and the NxD-named aliases a script has imported) through which a forward
    may call them as ``module.function``."""
    from kiln.distributed import loss, mappings
    functions = [loss.parallel_cross_entropy, loss.from_parallel_logits_to_logprobs]
    functions += [value for name, value in vars(mappings).items()
                  if not name.startswith("_") and inspect.isfunction(value) and value.__module__ == mappings.__name__]
    aliases = ("kiln.neuronx_distributed.parallel_layers", "kiln.neuronx_distributed.parallel_layers.mappings",
               "kiln.neuronx_distributed.parallel_layers.loss_functions")
    modules = [mappings, loss] + [sys.modules[name] for name in aliases if name in sys.modules]
    return functions, modules


_FUNCTION_LEAVES: dict = {}


def _function_leaf(cls):
    """The graph target for ``cls.apply``: a plain function calling it (one per class)."""
    leaf = _FUNCTION_LEAVES.get(cls)
    if leaf is None:
        def leaf(*args, **kwargs):
            return cls.apply(*args, **kwargs)
        leaf.__name__ = leaf.__qualname__ = f"{cls.__name__}_apply"
        _FUNCTION_LEAVES[cls] = leaf
    return leaf


def _has_proxy(args, kwargs) -> bool:
    found = []
    fx.node.map_aggregate((args, kwargs), lambda x: found.append(x) if isinstance(x, fx.Proxy) else None)
    return bool(found)


class _LeafTracer(fx.Tracer):
    """torch.fx's tracer with NxD's leaf rule: a module is a leaf when its class is one of
    the leaf classes, when a leaf name is part of its class name, or when a leaf name is
    its qualified name. kiln's collective functions and autograd Functions are leaf calls
    (module doc)."""

    def __init__(self, leaves, autowrap_modules=(), autowrap_functions=()):
        import math
        kiln_functions, kiln_modules = _kiln_leaf_functions()
        super().__init__(autowrap_modules=(math, *autowrap_modules),
                         autowrap_functions=(*kiln_functions, *autowrap_functions), param_shapes_constant=True)
        self._autowrap_search.extend(m for m in kiln_modules if m not in self._autowrap_search)
        self.leaf_classes = tuple(leaf for leaf in leaves if isinstance(leaf, type))
        self.leaf_names = tuple(leaf for leaf in leaves if isinstance(leaf, str))

    def trace(self, root, concrete_args=None):
        """torch.fx's trace, with ``Function.apply`` on a proxy recorded as one call."""
        base = torch.autograd.function.Function
        original = base.__dict__["apply"]
        tracer = self

        def apply(cls, *args, **kwargs):
            if _has_proxy(args, kwargs):
                return tracer.create_proxy("call_function", _function_leaf(cls), args, kwargs)
            return original.__get__(None, cls)(*args, **kwargs)
        base.apply = classmethod(apply)
        try:
            return super().trace(root, concrete_args)
        finally:
            base.apply = original

    def is_leaf_module(self, m, module_qualified_name):
        if self.leaf_classes and isinstance(m, self.leaf_classes):
            return True
        name = type(m).__name__
        if any(leaf in name or leaf == module_qualified_name for leaf in self.leaf_names):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _tracer_class(tracer_cls):
    if tracer_cls is None or tracer_cls == "torch":
        return _LeafTracer
    if tracer_cls == "hf":
        raise PipelineError(
            "tracer_cls='hf': the installed transformers has no transformers.utils.fx (HF's fx "
            "tracer was removed in transformers 5); leave tracer_cls unset to trace with torch.fx, "
            "or pass a torch.fx.Tracer subclass")
    if isinstance(tracer_cls, type) and issubclass(tracer_cls, fx.Tracer):
        leaf_tracer = _LeafTracer

        class _UserLeafTracer(leaf_tracer, tracer_cls):   # the leaf rule first, then the user's
            pass
        return _UserLeafTracer
    raise PipelineError(f"tracer_cls={tracer_cls!r}: expected None, 'torch', 'hf' or a torch.fx.Tracer subclass")


def concrete_args(module: torch.nn.Module, input_names) -> dict:
    """The forward parameters that are not model inputs, fixed at their defaults."""
    params = inspect.signature(module.forward).parameters
    unknown = [n for n in input_names if n not in params]
    if unknown:
        raise PipelineInputError(
            f"input_names {unknown} are not parameters of {type(module).__name__}.forward "
            f"(it takes {list(params)})")
    return {name: p.default for name, p in params.items()
            if name not in input_names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and p.default is not inspect.Parameter.empty}


def trace_model(module, input_names, leaves, tracer_cls=None, autowrap_functions=(),
                autowrap_modules=(), autowrap_obj_methods=None) -> fx.GraphModule:
    """The whole model as one fx GraphModule, ``leaves`` kept as ``call_module`` nodes."""
    if autowrap_obj_methods:
        raise PipelineError("autowrap_obj_methods is not supported by kiln's pipeline tracer; "
                            "wrap those methods with torch.fx.wrap or make their module a leaf_module_cls")
    tracer = _tracer_class(tracer_cls)(list(leaves) + list(PARALLEL_MODULE_NAMES),
                                       autowrap_modules=tuple(_as_list(autowrap_modules)),
                                       autowrap_functions=tuple(_as_list(autowrap_functions)))
    try:
        graph = tracer.trace(module, concrete_args=concrete_args(module, input_names))
    except PipelineError:
        raise
    except Exception as exc:    # torch.fx's errors name a proxy, not the model option to change
        raise PipelineError(
            f"torch.fx could not trace {type(module).__name__} for the pipeline ({type(exc).__name__}: "
            f"{exc}); make the module that does data-dependent Python control flow a leaf "
            "(transformer_layer_cls / leaf_module_cls) or wrap the function (autowrap_functions)") from exc
    traced = fx.GraphModule(module, graph)
    traced.graph.eliminate_dead_code(is_impure_node=_is_impure)
    traced.recompile()
    return traced


def _is_inplace_name(name) -> bool:
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def _is_impure(node: fx.Node) -> bool:
    """torch.fx's rule, plus in-place calls (``x.sub_(m)``, ``torch.relu_``, ``inplace=True``,
    an ``inplace`` module): unused results, but they change values used later."""
    if node.is_impure():
        return True
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        return _is_inplace_name(node.target)
    if node.op == "call_function":
        return _is_inplace_name(getattr(node.target, "__name__", None))
    if node.op == "call_module":
        return getattr(node.graph.owning_module.get_submodule(node.target), "inplace", False) is True
    return False


def model_layers(module: torch.nn.Module, layer_cls, prefix: str = "") -> list[str]:
    """Qualified names of the ``layer_cls`` modules, in module order, not looking inside one."""
    found = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, layer_cls):
            found.append(path)
        else:
            found.extend(model_layers(child, layer_cls, path + "."))
    return found


def auto_cuts(num_stages: int, layer_names: list[str]) -> list[str]:
    """NxD's even split: ``len // num_stages`` layers a stage, the remainder one each to the
    *last* stages; the cut after each of the first ``num_stages - 1`` groups."""
    per = [len(layer_names) // num_stages] * num_stages
    for i in range(len(layer_names) % num_stages):
        per[num_stages - 1 - i] += 1
    cuts, end = [], 0
    for count in per[:-1]:
        end += count
        if end == 0:
            raise PipelineError(f"auto_partition: {len(layer_names)} transformer layers cannot fill "
                                f"{num_stages} pipeline stages")
        cuts.append(layer_names[end - 1])
    return cuts


@dataclass
class Stage:
    """One pipeline stage: its module and what it takes and gives.

    ``module(*received, *model_inputs)`` returns the tuple of values ``sent`` (or, on the
    last stage, the model's own output)."""
    index: int
    module: fx.GraphModule
    received: list = field(default_factory=list)     # names of the values from the previous stage
    model_inputs: list = field(default_factory=list)  # run_train kwargs this stage reads
    sent: list = field(default_factory=list)          # names of the values for the next stage


def _stage_of_nodes(graph: fx.Graph, cuts: list[str]) -> dict:
    marked = set(cuts)
    found, stage, where = set(), 0, {}
    for node in graph.nodes:
        where[node] = stage
        if node.op == "call_module" and node.target in marked and node.target not in found:
            found.add(node.target)
            stage += 1
    missing = [c for c in cuts if c not in found]
    if missing:
        called = [n.target for n in graph.nodes if n.op == "call_module"]
        raise PipelineError(f"pipeline cut {missing[0]!r} is not a module called in the traced graph "
                            f"(modules called: {called})")
    if stage != len(cuts):
        raise PipelineError(f"pipeline cuts {cuts} do not come in graph order")
    for node in graph.nodes:        # the output belongs to the last stage, even after a final cut
        if node.op == "output":
            where[node] = len(cuts)
    return where


def _crossing(graph: fx.Graph, where: dict, num_stages: int) -> list[list]:
    """For each cut s -> s + 1, the value nodes made at or before s and used after s."""
    sends: list[list] = [[] for _ in range(num_stages - 1)]
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        last_use = max((where[user] for user in node.users), default=where[node])
        for s in range(where[node], last_use):
            sends[s].append(node)
    return sends


def cut_stages(traced: fx.GraphModule, cuts: list[str], input_names) -> list[Stage]:
    """``traced`` cut after each module in ``cuts``: ``len(cuts) + 1`` stages."""
    graph = traced.graph
    where = _stage_of_nodes(graph, cuts)
    num_stages = len(cuts) + 1
    sends = _crossing(graph, where, num_stages)
    stages = []
    for s in range(num_stages):
        received = sends[s - 1] if s > 0 else []
        own = [n for n in graph.nodes if where[n] == s and n.op not in ("placeholder", "get_attr", "output")]
        g, env = fx.Graph(), {}
        for node in received:
            env[node] = g.placeholder(node.name)
        used = {arg for n in own for arg in n.all_input_nodes}
        output = next(n for n in graph.nodes if n.op == "output")
        if s == num_stages - 1:
            used |= set(output.all_input_nodes)
        if s < num_stages - 1:
            used |= set(sends[s])
        inputs = [n for n in graph.nodes if n.op == "placeholder" and n in used and n.target in input_names]
        for node in inputs:
            env[node] = g.placeholder(node.name)
        for node in graph.nodes:    # specialised arguments keep their defaults; parameters their owners
            if node in used and node not in env and node.op in ("placeholder", "get_attr"):
                env[node] = g.node_copy(node)
        for node in own:
            env[node] = g.node_copy(node, lambda n: env[n])
        if s == num_stages - 1:
            g.output(fx.node.map_arg(output.args[0], lambda n: env[n]))
        else:
            g.output(tuple(env[n] for n in sends[s]))
        g.lint()
        stages.append(Stage(s, fx.GraphModule(traced, g, class_name=f"PipelineStage{s}"),
                            received=[n.name for n in received],
                            model_inputs=[n.target for n in inputs],
                            sent=[n.name for n in sends[s]] if s < num_stages - 1 else []))
    return stages
