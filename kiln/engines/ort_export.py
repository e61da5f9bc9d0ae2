"""A partition to ONNX through torch's dynamo exporter, without decomposing it twice.

``torch.onnx.export`` re-exports the module it is given (``torch.export``) and then runs
``run_decompositions`` with its registry's table, retracing every node. A kiln partition
is already core ATen, and the ONNX Runtime engine only takes nodes the exporter's registry
translates as they are (:meth:`kiln.engines.onnxruntime.OnnxRuntimeEngine.supports`), so
for it the decomposition pass changes nothing and costs the most: measured on SmolLM2's
30-layer prefill graph (2 cores, under a profiler), 18.4 of 39.7 s of export.

It also builds torch's ONNX registry once per opset rather than once per export: the
exporter fills a fresh ``ONNXRegistry`` from onnxscript's torchlib on every call (parsing
the source of some twenty thousand functions), which was 46 of 103 s of compiling a tiny
two-rank decoder's 42 partitions (profiled on the 2-core machine). The registry is only
read during an export that adds no custom translations, as kiln's do not.

``export`` skips that pass when every operator in the partition is one the registry
translates directly, by standing in for the exporter's ``decompose_with_registry`` for
the length of the call; otherwise (or where the exporter no longer has that function)
it is the plain public call. The stand-in is process-wide, so exports take a lock. What
comes out is checked against eager PyTorch like every compiled partition.

Nor does it trace the partition again. Given a module, the exporter first runs
``torch.export`` on it, a whole new trace of a graph that capture already traced: for
SmolLM2's 30-layer graphs most of the exporter's time. A kiln partition is already what
that trace would give (core ATen, every node's ``val`` recorded, weights as attributes),
so :func:`program_of` writes it as the ``ExportedProgram`` the exporter accepts in place
of a module, node for node (weights become lifted constants); the exporter then
translates it as it would its own trace, or first decomposes the operators only a
decomposition translates (:func:`translates_by_decomposition`), for which the program
carries its one module call. A partition it cannot write so (a node without its ``val``,
a submodule, an output that is an input) takes the public path.

And it works out each ONNX op's signature once (:func:`_signatures_once`): the exporter made
it from the op's schema for every node it emitted, a quarter of exporting a 30-layer decode
step (one SmolLM2 1-row step, alternating: 2.9-3.8 s an export before, 2.0-2.9 s after, the
same ONNX bytes). And the exporter's type-promotion pass runs only on a graph with a node
it would cast (:mod:`kiln.engines.ort_promotion`).
"""
from __future__ import annotations

import contextlib
import operator
import threading

import torch

from kiln.engines import ort_exact, ort_promotion

_LOCK = threading.Lock()


def export(partition, example_inputs, *, opset: int, optimize: bool, registry):
    """``torch.onnx.export(partition, ...)`` (dynamo), an ``ONNXProgram``."""
    partition = ort_exact.exact_scalars(partition) or partition
    partition = decomposed_locally(partition, registry) or partition
    program = program_of(partition)
    with _LOCK, _no_redecomposition(partition, registry), _registry_once(), _signatures_once(), \
            ort_promotion.only_where_needed(), ort_exact.exact_no_ops():
        return torch.onnx.export(partition if program is None else program, tuple(example_inputs), dynamo=True,
                                 opset_version=opset, optimize=optimize, verbose=False, report=False)


def program_of(partition):
    """``partition`` as an ``ExportedProgram`` without tracing it again (see the module's
    docstring), or None where it cannot be written so (the exporter then traces it)."""
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind,
                                              OutputSpec, TensorArgument)
    nodes = list(partition.graph.nodes)
    outputs = _outputs(nodes)
    if outputs is None or any(n.op not in ("placeholder", "get_attr", "call_function", "output") for n in nodes):
        return None
    if any("val" not in n.meta for n in nodes if n.op in ("placeholder", "call_function")):
        return None
    fake = torch._guards.detect_fake_mode([n.meta["val"] for n in nodes if n.op == "placeholder"])
    graph, env, constants, inputs = torch.fx.Graph(), {}, {}, []
    # the exported program's order: lifted constants first, then the user's inputs
    for node in (n for n in nodes if n.op == "get_attr"):
        value = _attribute(partition, node.target)
        if not isinstance(value, torch.Tensor):
            return None
        target = f"w_{len(constants)}"
        env[node] = graph.placeholder(target)
        env[node].meta.update(node.meta, val=fake.from_tensor(value) if fake is not None else value)
        constants[target] = value
        inputs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(env[node].name), target=target))
    for node in (n for n in nodes if n.op == "placeholder"):
        env[node] = graph.placeholder(node.name)
        env[node].meta.update(node.meta)
        inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(env[node].name), target=None))
    for node in (n for n in nodes if n.op == "call_function"):
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    signature = ExportGraphSignature(
        input_specs=inputs,
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[n].name), target=None) for n in outputs])
    try:
        return torch.export.ExportedProgram(root=torch.nn.Module(), graph=graph, graph_signature=signature,
                                            state_dict={}, range_constraints={},
                                            module_call_graph=_call_graph(signature), constants=constants)
    except Exception:  # noqa: BLE001 - torch's verifier refused it: the exporter traces it instead
        return None


def decomposed_locally(partition, registry):
    """``partition`` with each operator the exporter would decompose first (one its registry
    lacks, or one of :func:`kiln.engines.ort_decomps.decompose_first`'s) replaced by its
    decomposition, traced at that node's recorded values and written in its place, in a
    copy of the graph; None where no node needs it or one cannot be written so.

    The exporter's own pass (``run_decompositions``) re-traces the whole program to
    decompose a few nodes: a BERT-4L training step's two partitions, one ``squeeze.dims``
    and two accumulating ``index_put`` among 2,400 nodes, spent 21 of their 39 s of export
    in it (profiled, 2 cores). With those nodes decomposed here, every node translates as
    it is and that pass is skipped (:func:`_no_redecomposition`)."""
    nodes = list(partition.graph.nodes)
    todo = {n for n in nodes if _needs_decomposition(n, registry)}
    if not todo:
        return None
    table, graph, env = _friendly_table(registry), torch.fx.Graph(), {}
    try:
        for node in nodes:
            if node in todo:
                env[node] = _inline(graph, node, env, table)
            elif node.op == "call_function" and node.target is operator.getitem and isinstance(env[node.args[0]],
                                                                                                  tuple):
                env[node] = env[node.args[0]][node.args[1]]
            else:
                env[node] = graph.node_copy(node, lambda n: _single(env[n]))
    except _NotInlined:
        return None
    local = torch.fx.GraphModule(partition, graph)
    return local if _translates_directly(local, registry) else None


class _NotInlined(Exception):
    pass


def _single(value):
    if not isinstance(value, torch.fx.Node):      # a decomposed node's tuple used whole
        raise _NotInlined
    return value


def _inline(graph, node, env, table):
    """``node``'s decomposition written into ``graph``: a Node, or a tuple for an operator
    returning several tensors (None where the decomposition returns None)."""
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    flat, spec = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    given = [a for a in flat if isinstance(a, torch.fx.Node)]
    vals = [a.meta.get("val") for a in given]
    if not all(isinstance(v, torch.Tensor) for v in vals) or \
            not all(isinstance(d, int) for v in vals for d in v.shape):
        raise _NotInlined
    fake = detect_fake_mode(vals)
    if fake is None:
        raise _NotInlined

    def call(*tensors):
        it = iter(tensors)
        args, kwargs = torch.utils._pytree.tree_unflatten(
            [next(it) if isinstance(a, torch.fx.Node) else a for a in flat], spec)
        return node.target(*args, **kwargs)
    try:
        with fake:
            sub = make_fx(call, decomposition_table=table)(*vals)
    except Exception as e:  # noqa: BLE001 - a decomposition that cannot be traced here: the exporter's pass
        raise _NotInlined from e
    inner = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], [_single(env[a]) for a in given]))
    for n in sub.graph.nodes:
        if n.op == "call_function":
            inner[n] = graph.node_copy(n, lambda x: inner[x])
            inner[n].meta.setdefault("stack_trace", node.meta.get("stack_trace"))
        elif n.op == "output":
            result = torch.fx.node.map_arg(n.args[0], lambda x: inner[x])
        elif n.op != "placeholder":          # a constant the trace lifted: not written here
            raise _NotInlined
    return tuple(result) if isinstance(result, (list, tuple)) else result


def _call_graph(signature) -> list:
    """The program's one module call, which the exporter's decomposition pass needs to
    rebuild the module (``ep.module()``): its inputs and outputs as flat tuples, and, as
    ``torch.export`` writes the root's entry, no argument names (a decomposition renames
    the nodes: an output named there that a decomposition replaced fails the verifier)."""
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import InputKind
    users = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    in_spec = torch.utils._pytree.tree_flatten((tuple(range(len(users))), {}))[1]
    out_spec = torch.utils._pytree.tree_flatten(tuple(range(len(signature.output_specs))))[1]
    return [ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec))]


def _outputs(nodes):
    """The partition's outputs, each a distinct computed node; else None."""
    out = next((n for n in nodes if n.op == "output"), None)
    values = out.args[0] if out is not None else None
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if not all(isinstance(v, torch.fx.Node) and v.op == "call_function" for v in values) or \
            len(set(values)) != len(values):
        return None
    return values


def _attribute(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


_REGISTRIES: dict = {}     # opset -> the exporter's ONNXRegistry, built once


def registry_for(opset_version=None):
    """torch's ONNX registry for ``opset_version`` (its default when None), built once, with
    each torchlib function's signature worked out when an op first asks for it."""
    from torch.onnx._internal.exporter import _constants
    version = _constants.TORCHLIB_OPSET if opset_version is None else opset_version
    if version not in _REGISTRIES:
        _REGISTRIES[version] = _lazy_registry(version)
    return _REGISTRIES[version]


def _lazy_registry(version: int):
    """``ONNXRegistry.from_torchlib(version)`` without its eager part: from_torchlib infers the
    ONNX signature of all ~560 torchlib functions up front, parsing each one's source (2-4 s a
    process, most of a tiny model's ONNX export); an export meets a few dozen of them. Here
    each function's metadata is made with the inference skipped, and ``get_decomps`` runs it
    (the same ``OnnxDecompMeta.__post_init__``) the first time an op is looked up."""
    from onnxscript.function_libs.torch_lib import ops, registration  # noqa: F401 - registers torchlib
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    class LazySignatures(_registration.ONNXRegistry):
        def get_decomps(self, target):
            decomps = super().get_decomps(target)
            for meta in decomps:
                if getattr(meta, "kiln_lazy", False):
                    meta.kiln_lazy, meta.skip_signature_inference = False, False
                    meta.__post_init__()
            return decomps

    reg = LazySignatures()
    reg._opset_version = version
    for meta in _torchlib_registry.get_torchlib_ops():
        reg._register(meta.fx_target, meta)
    for qualified_name, functions in registration.default_registry.items():
        if qualified_name.startswith("internal::"):
            continue
        target = _registration._get_overload(qualified_name)
        if target is None:
            continue
        for function, is_complex in [(f, False) for f in functions.overloads] + [(f, True) for f in functions.complex]:
            meta = _registration.OnnxDecompMeta(onnx_function=function, fx_target=target, signature=None,
                                                is_complex=is_complex, skip_signature_inference=True)
            meta.kiln_lazy = True
            reg._register(target, meta)
    reg._cleanup_registry_based_on_opset_version()
    return reg


@contextlib.contextmanager
def _registry_once():
    """torch.onnx.export builds its registry afresh each call: it gets the one kiln keeps."""
    try:
        from torch.onnx._internal.exporter import _registration
        original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    except (ImportError, KeyError):
        yield
        return
    _registration.ONNXRegistry.from_torchlib = classmethod(lambda cls, opset_version=None: registry_for(opset_version))
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = original


_SIGNATURES: dict = {}    # (domain, op, since_version) -> the ONNX op's OpSignature, made once


@contextlib.contextmanager
def _signatures_once():
    """The exporter works out an ONNX op's signature from its schema each time it emits the
    op (``OpSignature.from_op_schema``: 25,051 times, 5.5 of 21 s of exporting SmolLM2's
    three graphs, profiled); the signature depends on the schema alone and nobody changes
    it, so within an export each one is made once per process."""
    try:
        from onnx_ir import schemas
        original = schemas.OpSignature.__dict__["from_op_schema"]
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def once(cls, op_schema):
        key = (op_schema.domain, op_schema.name, op_schema.since_version)
        signature = _SIGNATURES.get(key)
        if signature is None:
            signature = _SIGNATURES[key] = original.__func__(cls, op_schema)
        return signature

    schemas.OpSignature.from_op_schema = classmethod(once)
    try:
        yield
    finally:
        schemas.OpSignature.from_op_schema = original


def _needs_decomposition(node, registry) -> bool:
    """Whether the exporter must decompose ``node`` before translating it: its registry lacks
    the operator, or kiln decomposes it first (:func:`kiln.engines.ort_decomps.decompose_first`)."""
    from kiln.engines.ort_decomps import decompose_first
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        (not registry.is_registered(node.target) or decompose_first(node))


def _translates_directly(partition, registry) -> bool:
    return not any(_needs_decomposition(node, registry) for node in partition.graph.nodes)


@contextlib.contextmanager
def _no_redecomposition(partition, registry):
    """For the length of an export: no decomposition pass where every operator translates
    as it is; else the exporter's own pass with kiln's few decompositions added
    (:data:`kiln.engines.ort_decomps.TABLE`)."""
    try:
        from torch.onnx._internal.exporter import _fx_passes
    except ImportError:
        _fx_passes = None
    original = getattr(_fx_passes, "decompose_with_registry", None)
    if original is None:
        yield
        return
    _fx_passes.decompose_with_registry = _as_is if _translates_directly(partition, registry) else _with_kilns
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original


def _as_is(exported_program, registry):
    return exported_program


def _with_kilns(exported_program, registry):
    return exported_program.run_decompositions(_friendly_table(registry))


_FRIENDLY: dict = {}      # id(registry) -> the exporter's decomposition table for it, and kiln's
_DECOMPOSES: dict = {}    # (op, argument signature) -> whether its decomposition translates


def _friendly_table(registry) -> dict:
    """The exporter's decomposition table for ``registry`` (torch's decompositions of the
    operators it lacks) with kiln's (:mod:`kiln.engines.ort_decomps`): for operators it lacks
    too, and for batch norm, which it translates to what ONNX Runtime computes otherwise in
    training mode."""
    table = _FRIENDLY.get(id(registry))
    if table is None:
        from torch.onnx._internal.exporter import _decomp

        from kiln.engines import ort_decomps
        table = _decomp.create_onnx_friendly_decomposition_table(set(_decomp.get_onnx_implemented_overloads(registry)))
        for op, fn in ort_decomps.TABLE.items():
            table.setdefault(op, fn)
        _FRIENDLY[id(registry)] = table
    return table


def translates_by_decomposition(node, registry) -> bool:
    """Whether the exporter translates ``node``'s operator through a decomposition although
    its registry has no translation for it: before translating, ``torch.onnx.export``
    decomposes every operator it lacks with torch's own decompositions
    (``decompose_with_registry``), so an operator whose decomposition is made of operators
    it translates exports fine. ``aten.squeeze.dims`` is one (a training step's loss
    gradient has it): the registry has ``squeeze.dim`` only, and a tiny MLP's training step
    went whole to Inductor (16-46 s a graph, mostly g++) for want of it, where ONNX Runtime
    builds it in 1.3-1.9 s. Found by tracing the decomposition on ``meta`` tensors of the node's
    recorded shapes; any doubt (no recorded value, symbolic shapes, a trace that fails)
    answers no."""
    table = _friendly_table(registry)
    if node.target not in table:
        return False
    try:
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _as_meta)
    except _NoValue:
        return False
    key = (node.target, repr(torch.utils._pytree.tree_map(_signature, (args, kwargs))))
    if key not in _DECOMPOSES:
        if len(_DECOMPOSES) > 1024:
            _DECOMPOSES.clear()
        _DECOMPOSES[key] = _decomposition_translates(node.target, args, kwargs, table, registry)
    return _DECOMPOSES[key]


class _NoValue(Exception):
    pass


def _as_meta(a):
    if not isinstance(a, torch.fx.Node):
        return a
    val = a.meta.get("val")
    if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    if isinstance(val, (int, float, bool)):
        return val
    raise _NoValue


def _signature(a):
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.stride(), a.dtype)
    return a


def _decomposition_translates(target, args, kwargs, table, registry) -> bool:
    from torch.fx.experimental.proxy_tensor import make_fx
    tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]

    def call(*flat):
        it = iter(flat)
        a, k = torch.utils._pytree.tree_map(lambda x: next(it) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        return target(*a, **k)
    try:
        gm = make_fx(call, decomposition_table=table)(*tensors)
    except Exception:      # noqa: BLE001 - a decomposition that cannot be traced here: no
        return False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            if not isinstance(n.target, torch._ops.OpOverload) or not registry.is_registered(n.target):
                return False
    return True
