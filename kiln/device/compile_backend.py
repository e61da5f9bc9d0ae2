"""``torch.compile(model, backend="kiln")``: Dynamo captures the Python, AOTAutograd
splits each captured graph into a forward and (when gradients are needed) a backward
graph of ATen operations, and kiln compiles each through its own compiler
(:func:`kiln.device.graphs.compile_graph`): engines chosen by measurement, host
fallback, the compile cache, the check against eager. Graph breaks are Dynamo's
business and are allowed; a graph kiln cannot compile runs eagerly with a warning.

Registered under ``"kiln"`` through the ``torch_dynamo_backends`` entry point, so
``torch.compile(backend="kiln")`` works without importing kiln first;
``"neuron"`` (TorchNeuron's spelling, :func:`neuron_backend`) is kiln's once the script opts
into TorchNeuron's names (``KILN_DEVICE_NAME=neuron``) or calls :func:`register_neuron_name`:
another package may own that name. Options: ``torch.compile(model, backend="kiln",
options={"optlevel": 1, "engine": "onnxruntime", ...})``, any ``kiln.trace`` option.
"""
from __future__ import annotations

import itertools

_graph_ids = itertools.count()


# torch.compile's ``mode``, in kiln's terms: max-autotune times every engine and variant
# (kiln's -O3); reduce-overhead (Inductor's CUDA graphs) asks nothing more of kiln's CPU builds
MODES = {"default": {}, "reduce-overhead": {}, "max-autotune": {"optlevel": 3},
         "max-autotune-no-cudagraphs": {"optlevel": 3}}


def backend(gm, example_inputs, options=None, mode=None):
    """The Dynamo backend: ``gm`` with AOTAutograd's forward and backward graphs compiled
    by kiln."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from kiln.device.graphs import compile_graph
    options = checked_options(options, mode)
    number = next(_graph_ids)

    def compiler(kind):
        def compile_one(graph, inputs):
            run = compile_graph(graph, inputs, name=f"torch.compile graph {number} {kind}", **options)
            return make_boxed_func(run)
        return compile_one

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        inference_compiler=compiler("inference"),
                        decompositions=_decompositions())(gm, example_inputs)


def checked_options(options, mode) -> dict:
    """``kiln.trace`` options from torch.compile's ``options`` or ``mode``, or a clear error
    at the first compile: a misspelt option used to make every graph run eagerly, each with
    a warning, and any ``mode`` failed with "backend() got an unexpected keyword argument"."""
    import inspect

    from kiln.compiler import api
    from kiln.compiler.driver import OPTION_FIELDS
    from kiln.errors import CompilerArgsError
    if mode is not None and mode not in MODES:
        raise CompilerArgsError(f"torch.compile(backend='kiln', mode={mode!r}): kiln knows the modes "
                                f"{', '.join(MODES)}")
    options = dict(options or {}, **MODES.get(mode, {}))
    named = [n for n, p in inspect.signature(api.trace).parameters.items() if p.kind is p.KEYWORD_ONLY]
    known = set(named) | set(OPTION_FIELDS) | {"threads", "name", "calibration_data"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise CompilerArgsError(f"torch.compile(backend='kiln', options=...): unknown option(s) "
                                f"{', '.join(map(repr, unknown))}; kiln takes kiln.trace's: "
                                f"{', '.join(sorted(known))}")
    _check_values(options)
    return options


def _check_values(options):
    """A clear error for an option value kiln refuses (``optlevel=7``, an engine it does not
    know), as ``kiln.trace`` raises it: before, each graph's compile failed on it and every
    graph ran eagerly, each with a warning."""
    from kiln import engines
    from kiln.compiler.driver import OPTION_FIELDS, make_options
    from kiln.errors import CompilerArgsError
    try:
        make_options(options.get("compiler_args"), **{k: v for k, v in options.items() if k in OPTION_FIELDS})
    except CompilerArgsError as e:
        raise CompilerArgsError(f"torch.compile(backend='kiln', options=...): {e}") from None
    except (TypeError, ValueError) as e:        # a value of the wrong type (optlevel="fast")
        raise CompilerArgsError(f"torch.compile(backend='kiln', options=...): {type(e).__name__}: {e}") from None
    engine = options.get("engine")
    if engine is not None and (not isinstance(engine, str) or engine not in engines.names()):
        raise CompilerArgsError(f"torch.compile(backend='kiln', options=...): unknown engine {engine!r}; "
                                f"kiln has: {', '.join(engines.names())}")


def _decompositions() -> dict:
    import torch
    # the functional form is what AOTAutograd's tracing meets (after functionalization)
    return {torch.ops.aten._native_batch_norm_legit_functional.default: _mixed_batch_norm,
            torch.ops.aten.native_layer_norm.default: _mixed_layer_norm}


def _mixed_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Batch norm of a bf16/fp16 input with fp32 parameters (a convolution's output under
    auto-cast), traced as CPU's kernel computes it: in fp32, the output rounded back.
    PyTorch's dtype rules give the saved statistics the input's dtype where CPU's
    kernel gives fp32; engines follow the rules, so the compiled forward handed the
    backward statistics of a dtype CPU's backward kernel refuses."""
    import torch
    if x.dtype not in (torch.bfloat16, torch.float16) or weight is None or weight.dtype != torch.float32:
        return NotImplemented
    out, mean, invstd, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional.default(
        x.float(), weight, bias, running_mean, running_var, training, momentum, eps)
    return out.to(x.dtype), mean, invstd, new_mean, new_var


def _mixed_layer_norm(x, normalized_shape, weight, bias, eps):
    """Layer norm of a bf16/fp16 input with fp32 parameters (a linear layer's output under
    auto-cast), traced as CPU's kernel computes it: in fp32, the output rounded back and
    the saved mean and 1/std in fp32. PyTorch's dtype rules say bf16 statistics, so the
    check against eager refused every such graph ("output 3 has dtype bfloat16, eager
    float32") and it ran uncompiled."""
    import torch
    if x.dtype not in (torch.bfloat16, torch.float16) or weight is None or weight.dtype != torch.float32:
        return NotImplemented
    if bias is not None and bias.dtype != torch.float32:
        return NotImplemented
    out, mean, rstd = torch.ops.aten.native_layer_norm.default(x.float(), normalized_shape, weight, bias, eps)
    return out.to(x.dtype), mean, rstd


_neuron_name: list = []


def neuron_backend(gm, example_inputs, options=None, mode=None):
    """``torch.compile(backend="neuron")``, TorchNeuron's spelling, through the
    ``torch_dynamo_backends`` entry point: kiln's backend once the script has opted into
    TorchNeuron's names (``KILN_DEVICE_NAME=neuron``, the device then being ``neuron``) or
    called :func:`register_neuron_name`; otherwise an error saying so, since another
    installed package may mean something else by that name."""
    from kiln.device import tensor as dt
    if dt.device_type() != "neuron" and not _neuron_name:
        raise RuntimeError("torch.compile(backend='neuron') is kiln's backend when kiln's device carries "
                           "TorchNeuron's name: run with KILN_DEVICE_NAME=neuron (or call "
                           "kiln.device.compile_backend.register_neuron_name()), or use backend='kiln'")
    return backend(gm, example_inputs, options, mode)


def register_neuron_name():
    """Make ``torch.compile(backend="neuron")`` mean kiln's backend (TorchNeuron's
    spelling) whatever kiln's device is called, unless another package registered a
    backend of that name."""
    from torch._dynamo.backends.registry import _BACKENDS, lookup_backend, register_backend
    _neuron_name.append(True)
    try:
        lookup_backend("neuron")       # loads an entry point of that name: kiln's, or another package's
    except Exception:                  # noqa: BLE001 - no backend of that name yet
        pass
    if "neuron" not in _BACKENDS:
        register_backend(name="neuron")(neuron_backend)
