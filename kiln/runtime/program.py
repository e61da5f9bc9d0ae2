"""The host program: how partitions and fallback ops are wired together.

After partitioning, the top-level graph is a short list of steps: run device
partition k, or run one host ATen op. It is stored as JSON (op names and value
slots, never code) plus a safetensors file for the host ops' constant tensors,
so loading an artifact cannot execute anything from the file. Ops are resolved
by name in ``torch.ops``; a custom op must be registered (its library
imported) before loading, and the error says so. Operators that touch files or
storages, or torch's internal namespaces, are refused at load (:mod:`kiln.engines.safe_ops`).
"""
from __future__ import annotations

import math
import operator

import torch

from kiln.errors import ArtifactError, KilnError
from kiln.engines import safe_ops
from kiln.artifact.specs import dtype_from_name, dtype_name


# ---- build (compile time) --------------------------------------------------

def build(fused: torch.fx.GraphModule):
    """Return (program dict, host constants dict, partition submodules in step order)."""
    slots: dict = {}
    constants: dict = {}
    steps, partitions = [], []
    num_inputs = 0

    def slot(node):
        if node not in slots:
            slots[node] = len(slots)
        return slots[node]

    def ref(a):
        if isinstance(a, torch.fx.Node):
            if a not in slots:
                raise KilnError(f"internal: value {a.name} used before it is produced")
            return {"slot": slots[a]}
        if isinstance(a, (list, tuple)):
            return {"list": [ref(v) for v in a]}
        return _encode_arg(a)

    # Inputs occupy the first slots, in order, whatever else the graph lists first.
    for node in fused.graph.nodes:
        if node.op == "placeholder":
            slot(node)
            num_inputs += 1
    outputs = None
    for node in fused.graph.nodes:
        if node.op == "placeholder":
            continue
        elif node.op == "get_attr":
            value = _fetch(fused, node.target)
            if not isinstance(value, torch.Tensor):
                raise KilnError(f"host constant {node.target} is a {type(value).__name__}, not a tensor")
            name = f"c{len(constants)}"
            constants[name] = value.detach().contiguous()
            steps.append({"const": name, "out": [slot(node)]})
        elif node.op == "call_module":
            sub = fused.get_submodule(node.target)
            out_node = next(n for n in sub.graph.nodes if n.op == "output")
            multi = isinstance(out_node.args[0], (tuple, list))
            n_out = len(out_node.args[0]) if multi else 1
            outs = [None] * n_out
            if multi:
                for user in node.users:
                    if user.op == "call_function" and user.target is operator.getitem:
                        outs[user.args[1]] = slot(user)
                    else:
                        raise KilnError(f"internal: partition output used without unpacking by {user}")
            else:
                outs[0] = slot(node)
            steps.append({"partition": len(partitions), "in": [ref(a) for a in node.args], "out": outs})
            partitions.append(sub)
        elif node.op == "call_function":
            if node.target is operator.getitem and node.args[0].op == "call_module":
                continue  # handled by the partition step
            if node.target is operator.getitem:
                steps.append({"getitem": node.args[1], "in": [ref(node.args[0])], "out": [slot(node)]})
                continue
            if not isinstance(node.target, torch._ops.OpOverload):
                raise _not_storable(node)
            steps.append({
                "op": f"{node.target._schema.name}.{node.target._overloadname}",
                "args": [ref(a) for a in node.args],
                "kwargs": {k: ref(v) for k, v in node.kwargs.items()},
                "out": [slot(node)],
            })
        elif node.op == "output":
            outputs = [ref(a) for a in _flat(node.args[0])]
    program = {"num_inputs": num_inputs, "num_slots": len(slots), "steps": steps, "outputs": outputs}
    return program, constants, partitions


def _not_storable(node) -> KilnError:
    """The error for a host step that is Python arithmetic on sizes (``sym_float`` of a
    data-dependent ``.shape[0]``, say), not a torch operator: a program stores operators
    only. Names the model's line and what to write instead."""
    name = getattr(node.target, "__name__", str(node.target))
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    where = f" at {trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else ""
    return KilnError(
        f"the model computes with a size that depends on the data in Python ({name}{where}); a compiled "
        "program stores torch operations only. Compute it as a tensor instead (e.g. (x > 0).sum() for "
        "torch.nonzero(x > 0).shape[0], and .float() of that tensor for float(...)), or keep that part "
        "of the model outside kiln.trace")


def _flat(x):
    if isinstance(x, (tuple, list)):
        for v in x:
            yield from _flat(v)
    else:
        yield x


def _fetch(module, target):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _encode_arg(a):
    if a is None or isinstance(a, (bool, int, str)):
        return {"v": a}
    if isinstance(a, float):
        return {"v": a} if math.isfinite(a) else {"float": repr(a)}
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    raise KilnError(f"cannot store an argument of type {type(a).__name__} for a host op")


# ---- run (load time) -------------------------------------------------------

def _decode_arg(a):
    """Decode a stored argument; value references become :class:`_Slot` markers."""
    if "slot" in a:
        return _Slot(a["slot"])
    if "list" in a:
        return [_decode_arg(v) for v in a["list"]]
    if "v" in a:
        return a["v"]
    if "float" in a:
        return float(a["float"])
    if "dtype" in a:
        return dtype_from_name(a["dtype"])
    if "device" in a:
        return torch.device(a["device"])
    if "layout" in a:
        return getattr(torch, a["layout"])
    if "memory_format" in a:
        return getattr(torch, a["memory_format"])
    raise ArtifactError(f"unknown argument encoding {sorted(a)} in artifact program")


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


def _resolve(x, env):
    if isinstance(x, _Slot):
        return env[x.i]
    if isinstance(x, list):
        return [_resolve(v, env) for v in x]
    return x


def resolve_op(qualified: str, registered: bool = True):
    """``aten::sort.default`` → torch.ops.aten.sort.default, by attribute lookup only."""
    name, _, overload = qualified.rpartition(".")
    ns, _, op = name.partition("::")
    if not (ns and op and overload):
        raise ArtifactError(f"the artifact's host program names {qualified!r}, which is not an "
                            "operator name (namespace::op.overload); the artifact is corrupt or "
                            "was edited")
    if ns == "kiln":
        import kiln.graph.dropout  # noqa: F401 - registers kiln's own host operators
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        fn = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        if not registered:          # verify(): a custom op not imported yet is said at build
            return None
        raise KilnError(
            f"the artifact runs operator {ns}::{op} on the host, but it is not registered in this "
            f"process; import the library that defines it (e.g. the module with its "
            f"torch.library definition) before loading") from None
    # a torch operator (attribute lookup alone reaches ``__class__::...``) that only computes:
    # aten::from_file read any file into an output before (kiln.engines.safe_ops)
    return safe_ops.check(fn, "the artifact's host program", qualified)


# ---- load-time check ---------------------------------------------------------

_ARGS = ("slot", "list", "v", "float", "dtype", "device", "layout", "memory_format")
_STEPS = ("partition", "const", "getitem", "op")


def verify(spec, constants: dict, input_specs: list, partitions: list, output_specs: list,
           source: str = "artifact"):
    """Refuse a host program that cannot run, with an ArtifactError naming the step.

    ``partitions`` holds (input specs, output specs) per device partition. Checked:
    every field's type; slots read only after a step (or the inputs) wrote them;
    steps that agree with the partitions' and the model's specs. Then the program
    runs once on fake tensors (shapes and dtypes only, no data, no allocation),
    partitions standing in by their specs, so host ops with the wrong arguments
    and partitions fed the wrong shapes fail here, not at a call.
    """
    from kiln.artifact import schema
    fail = schema.Fail(source)
    schema.need(fail, "program", spec, "object")
    check = _ProgramCheck(fail, spec, constants, input_specs, partitions)
    for i, step in enumerate(schema.field(fail, spec, "steps", "program", "list")):
        check.step(f"program.steps[{i}]", step)
    check.outputs(output_specs)
    if not any("op" in step for step in spec["steps"]):
        _dry_run(spec, constants, input_specs, partitions, output_specs, fail)


class _ProgramCheck:
    """The structural checks of :func:`verify`, one method per part of the program."""

    def __init__(self, fail, spec, constants, input_specs, partitions):
        from kiln.artifact import schema
        self.schema, self.fail, self.spec = schema, fail, spec
        self.constants, self.partitions = constants, partitions
        self.num_inputs = schema.field(fail, spec, "num_inputs", "program", "integer")
        if self.num_inputs != len(input_specs):
            fail("program.num_inputs", f"is {self.num_inputs}, but the model has {len(input_specs)} input tensors")
        self.num_slots = schema.field(fail, spec, "num_slots", "program", "integer")
        if self.num_slots < self.num_inputs:
            fail("program.num_slots", f"is {self.num_slots}, fewer than the {self.num_inputs} inputs")
        self.defined = set(range(self.num_inputs))
        self.written = 0

    def arg(self, a, path, depth=0):
        schema, fail = self.schema, self.fail
        if depth > schema.MAX_DEPTH:
            fail(path, f"nests deeper than {schema.MAX_DEPTH}")
        schema.need(fail, path, a, "object")
        if len(a) != 1 or next(iter(a)) not in _ARGS:
            fail(path, f"must be one argument encoding ({', '.join(_ARGS)}), has keys {sorted(a)}")
        key, v = next(iter(a.items()))
        p = f"{path}.{key}"
        if key == "slot":
            schema.index(fail, p, v, self.num_slots, "slots")
            if v not in self.defined:
                fail(p, f"reads slot {v} before any step writes it")
        elif key == "list":
            for i, item in enumerate(schema.need(fail, p, v, "list")):
                self.arg(item, f"{p}[{i}]", depth + 1)
        elif key == "v":
            schema.need(fail, p, v, "scalar")
        elif key == "dtype":
            schema.dtype(fail, p, v)
        else:
            schema.need(fail, p, v, "string")
            if not _names_a(key, v):
                fail(p, f"is not a {key.replace('_', ' ')} ({v!r})")

    def step(self, p, step):
        schema, fail = self.schema, self.fail
        schema.need(fail, p, step, "object")
        kinds = [k for k in _STEPS if k in step]
        if len(kinds) != 1:
            fail(p, f"must be one step ({', '.join(_STEPS)}), has keys {sorted(step)}")
        kind = kinds[0]
        outs = schema.field(fail, step, "out", p, "list")
        if kind == "partition":
            ins = self._partition_step(p, step, outs)
        else:
            if len(outs) != 1:
                fail(f"{p}.out", f"must name one slot, names {len(outs)}")
            ins = self._host_step(p, step, kind)
        for j, a in enumerate(ins):
            self.arg(a, f"{p}.{'in' if kind != 'op' else 'args'}[{j}]")
        for j, o in enumerate(outs):
            if o is None and kind == "partition":
                continue            # an output nothing uses
            self.defined.add(schema.index(fail, f"{p}.out[{j}]", o, self.num_slots, "slots"))
            self.written += 1

    def _partition_step(self, p, step, outs):
        schema, fail = self.schema, self.fail
        k = schema.index(fail, f"{p}.partition", step["partition"], len(self.partitions), "partitions")
        ins = schema.field(fail, step, "in", p, "list")
        p_in, p_out = self.partitions[k]
        if len(ins) != len(p_in) or len(outs) != len(p_out):
            fail(p, f"passes {len(ins)} input(s) and takes {len(outs)} output(s), but partition "
                 f"{k} has {len(p_in)} and {len(p_out)}")
        return ins

    def _host_step(self, p, step, kind):
        schema, fail = self.schema, self.fail
        if kind == "const":
            name = schema.need(fail, f"{p}.const", step["const"], "string")
            if name not in self.constants:
                fail(f"{p}.const", f"names {name!r}, which is not among the host constants")
            return []
        if kind == "getitem":
            schema.need(fail, f"{p}.getitem", step["getitem"], "integer")
            ins = schema.field(fail, step, "in", p, "list")
            if len(ins) != 1:
                fail(f"{p}.in", "must hold one argument")
            return ins
        schema.need(fail, f"{p}.op", step["op"], "string")
        resolve_op(step["op"], registered=False)     # a refused operator fails the load, named
        ins = schema.field(fail, step, "args", p, "list")
        for key, a in schema.field(fail, step, "kwargs", p, "object").items():
            self.arg(a, f"{p}.kwargs.{key}")
        return ins

    def outputs(self, output_specs):
        schema, fail = self.schema, self.fail
        if self.num_slots > self.num_inputs + self.written:
            fail("program.num_slots", f"is {self.num_slots}, more than the inputs and steps write "
                 f"({self.num_inputs + self.written})")
        outputs = schema.field(fail, self.spec, "outputs", "program", "list")
        if len(outputs) != len(output_specs):
            fail("program.outputs", f"has {len(outputs)} entries for {len(output_specs)} output tensors")
        for j, a in enumerate(outputs):
            self.arg(a, f"program.outputs[{j}]")


def _names_a(key, v) -> bool:
    """Whether the string ``v`` names a value of argument kind ``key`` (float, device, ...)."""
    try:
        return {"float": lambda: float(v) is not None,
                "device": lambda: torch.device(v) is not None,
                "layout": lambda: isinstance(getattr(torch, v, None), torch.layout),
                "memory_format": lambda: isinstance(getattr(torch, v, None), torch.memory_format),
                }[key]()
    except (ValueError, RuntimeError):
        return False


class _Mismatch(Exception):
    pass


def _dry_run(spec, constants, input_specs, partitions, output_specs, fail):
    """Run a program of partitions, constants and getitems on meta tensors; partitions
    answer with tensors of their output specs."""
    def stand_in(k, ins, outs):
        def run(inputs):
            for j, (t, s) in enumerate(zip(inputs, ins)):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
                    got = (f"{tuple(t.shape)} {dtype_name(t.dtype)}" if isinstance(t, torch.Tensor)
                           else type(t).__name__)
                    raise _Mismatch(f"partition {k} input {j} would be {got}, its spec says "
                                    f"{s.describe()}")
            return [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in outs]
        return run

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in constants.items()}
    program = Program(spec, meta, [stand_in(k, i, o) for k, (i, o) in enumerate(partitions)])
    try:
        results = program([torch.empty(s.shape, dtype=s.dtype, device="meta") for s in input_specs])
    except _Mismatch as e:
        fail("program", f"does not fit its specs: {e}")
    except KilnError:
        raise
    except (IndexError, TypeError, KeyError) as e:     # a getitem on the wrong thing
        fail("program", f"does not run on inputs of its specs: {type(e).__name__}: {e}")
    for j, (t, s) in enumerate(zip(results, output_specs)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(s.shape) or t.dtype != s.dtype:
            got = f"{tuple(t.shape)} {dtype_name(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(f"program.outputs[{j}]", f"gives {got}, but outputs.tensors[{j}] says {s.describe()}")


class Program:
    """Executes the wiring: inputs → steps (partitions, host ops) → outputs."""

    def __init__(self, spec: dict, constants: dict, partitions: list):
        self.num_inputs = spec["num_inputs"]
        self.num_slots = spec["num_slots"]
        self.partitions = partitions
        self.steps = []
        for step in spec["steps"]:
            outs = step["out"]
            if "partition" in step:
                ins = [_decode_arg(a) for a in step["in"]]
                self.steps.append(("partition", step["partition"], ins, outs))
            elif "const" in step:
                self.steps.append(("const", constants[step["const"]], None, outs))
            elif "getitem" in step:
                self.steps.append(("getitem", step["getitem"], [_decode_arg(step["in"][0])], outs))
            else:
                fn = resolve_op(step["op"])
                args = [_decode_arg(a) for a in step["args"]]
                kwargs = {k: _decode_arg(v) for k, v in step["kwargs"].items()}
                self.steps.append(("op", fn, (args, kwargs), outs))
        self.outputs = [_decode_arg(o) for o in spec["outputs"]]
        # A single partition fed by the inputs, in any order, is the common, fast case: no
        # slots to fill and resolve (an LLM decode step's graph takes its 63 inputs in
        # another order than the model's: 15 us a call through the slots, 3.4 directly)
        self.direct = None
        if (len(self.steps) == 1 and self.steps[0][0] == "partition"
                and all(isinstance(a, _Slot) for a in self.steps[0][2])
                and sorted(a.i for a in self.steps[0][2]) == list(range(self.num_inputs))
                and all(isinstance(o, _Slot) and o.i in self.steps[0][3] for o in self.outputs)):
            ins, outs = [a.i for a in self.steps[0][2]], self.steps[0][3]
            order = [outs.index(o.i) for o in self.outputs]
            self.direct = (partitions[self.steps[0][1]],
                           None if ins == list(range(len(ins))) else ins,
                           None if order == list(range(len(outs))) else order)

    def written_inputs(self) -> frozenset:
        """Indices of the inputs every call updates in place: those the single partition's
        runner writes (an ONNX Runtime decode step's cache, :class:`kiln.engines.onnxruntime.OrtRunner`)."""
        if self.direct is None:
            return frozenset()
        runner, ins, _ = self.direct
        return frozenset(i if ins is None else ins[i] for _, i in getattr(runner, "in_place", ()))

    def host_ops(self):
        return [s for s in self.steps if s[0] == "op"]

    def labels(self, engines):
        """A display name per step, for profiles: engine partitions and host ops."""
        out = []
        for kind, what, _, _ in self.steps:
            if kind == "partition":
                out.append(("device", f"partition {what} ({engines[what]})"))
            elif kind == "op":
                out.append(("host", f"host {getattr(what, '__name__', str(what))}"))
            else:
                out.append((None, None))
        return out

    def run_timed(self, inputs, labels, span, scope=None):
        """``__call__`` that reports each partition and host op to
        ``span(category, label, start, end)`` and runs it inside ``scope(label)`` when
        given (torch.profiler ranges); returns (outputs, device s, host s)."""
        import contextlib
        import time
        clock = time.perf_counter
        device = host = 0.0
        env = list(inputs) + [None] * (self.num_slots - len(inputs))
        for (kind, what, ins, outs), (cat, label) in zip(self.steps, labels):
            start = clock()
            with scope(label) if scope is not None and cat else contextlib.nullcontext():
                self._step(kind, what, ins, outs, env)
            if cat is None:
                continue
            end = clock()
            if cat == "device":
                device += end - start
            else:
                host += end - start
            if span is not None:
                span(cat, label, start, end)
        return [_resolve(o, env) for o in self.outputs], device, host

    def _step(self, kind, what, ins, outs, env):
        if kind == "partition":
            res = self.partitions[what]([_resolve(a, env) for a in ins])
            for o, r in zip(outs, res):
                if o is not None:
                    env[o] = r
        elif kind == "op":
            args, kwargs = ins
            try:
                env[outs[0]] = what(*_resolve(args, env), **{k: _resolve(v, env) for k, v in kwargs.items()})
            except KilnError:
                raise           # kiln's own operators (the collectives) say what went wrong themselves
            except Exception as e:  # noqa: BLE001 - eager's own error, raised as eager raises it
                # a host op runs eager's kernel: its error for these values (a division by zero,
                # an index out of range) is the caller's, of its type and in its words, as eager
                # raises it (a KilnError blaming the artifact before), with where it came from
                e.add_note(f"kiln: raised by host operation {getattr(what, '__name__', what)} of the "
                           "compiled model's program, on inputs that match the model's specs")
                raise
        elif kind == "getitem":
            env[outs[0]] = _resolve(ins[0], env)[what]
        else:
            env[outs[0]] = what

    def __call__(self, inputs):
        if self.direct is not None:
            fn, ins, order = self.direct
            res = fn(inputs if ins is None else [inputs[i] for i in ins])
            return res if order is None else [res[i] for i in order]
        env = list(inputs) + [None] * (self.num_slots - len(inputs))
        for kind, what, ins, outs in self.steps:
            self._step(kind, what, ins, outs, env)
        return [_resolve(o, env) for o in self.outputs]
