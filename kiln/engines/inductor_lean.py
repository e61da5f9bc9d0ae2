"""AOTInductor's build made leaner: the partition's own graph compiled (no second export),
no input checks kiln never runs, and the wrapper compiled beside the kernels.

:func:`package` is the first (its docstring says why).

AOTInductor writes one C++ function per graph input that checks its dtype, sizes, strides
and device (``check_input_N``, about 55 lines each), and calls them only in a process that
sets ``AOTI_RUNTIME_CHECK_INPUTS``. kiln checks every call's inputs itself before an engine
sees them (:meth:`kiln.runtime.model.Model.check`: shapes and dtypes; a device program is
found by the shapes and dtypes it was recorded with; the Inductor runner hands inputs over
in the layout they were compiled in, kiln.engines.inductor), so for kiln they are dead code, and yet the
wrapper is compiled with them: a BERT-4L training step's 260 inputs made 14,000 of its
wrapper's 19,700 lines, and the wrapper's g++ build (at -O1) took 27 s of that step's 67 s
Inductor build (11-29, 2 cores).

While kiln compiles, the wrapper is generated without them: ``__check_inputs_outputs``
(which the generated ``run_impl`` calls) is left empty, and the switch other generated
code tests, ``_check_aoti_runtime_check_inputs_env``, is kept as torch writes it. This
swaps a method of torch 2.13's code generator (``CppWrapperCpu``, whose GPU wrapper
inherits it) for the length of the compile; a torch without that method compiles as is.
The swap is process-wide: an AOTInductor build another thread makes meanwhile (a user's
own) is generated without the checks too.

AOTInductor then compiles the wrapper (``*wrapper.cpp``, at -O1) and the kernels
(``*kernel.cpp``, at -O3) into two object files one after the other, and links them. The
two compiles are independent, so while kiln compiles, with two CPUs or more, the wrapper's
runs on a thread of its own beside the kernels' (``g++`` is a subprocess: the thread
only waits), and the link waits for both. A bf16 BERT-4L training step's wrapper took
11.3 s and its kernels 5.4 s, one after the other (11-29). Only builds made by the thread
that entered :func:`wrapper_beside_kernels` are moved; every other build runs as torch
wrote it.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.host.cores import available_cpus
from kiln.swap import Swap


def package(module, inputs, configs, path, device) -> str:
    """AOTInductor's package of an ATen graph, built from the graph itself.

    ``aoti_compile_and_package`` takes an ``ExportedProgram``, and exporting a partition
    again only re-traces what capture already made: a functional ATen graph whose weights
    are attributes. Inductor's own lowering (AOTAutograd's trace, decompositions) runs
    either way (a bf16 BERT-4L training step's export took 5.8 s of its 47 s build). So a
    graph module of tensors in and graph values out goes straight to
    ``torch._inductor.aot_compile``, with the calling convention an exported program's
    module would have (positional inputs; the outputs flat, then as the graph returns
    them). Anything else, and every CUDA build (the GPU path was checked on a GPU through
    the export; this one has not been), is exported first."""
    from torch._inductor.package import package_aoti
    flat = flat_graph(module, inputs) if device.type == "cpu" else None
    if flat is None:
        program = torch.export.export(module, inputs, strict=False)
        return torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
    files = torch._inductor.aot_compile(flat, inputs, options={**configs, "aot_inductor.package": True})
    return package_aoti(path, files)


def flat_graph(module, inputs):
    """A graph module over the same graph and weights, with positional-inputs/tuple-output
    specs, or None where ``module`` is not such a graph."""
    from torch.utils import _pytree as pytree
    if not isinstance(module, torch.fx.GraphModule) or type(module.graph._codegen) is not torch.fx.graph.CodeGen:
        return None
    if any(not isinstance(t, torch.Tensor) for t in inputs):
        return None
    graph = copy.deepcopy(module.graph)                # the output is rewritten below
    _layouts_as_given(graph, inputs)
    output = graph.find_nodes(op="output")[0]
    results, spec = pytree.tree_flatten(output.args[0])
    if not all(isinstance(r, torch.fx.Node) for r in results):
        return None
    output.args = (tuple(results),)                    # AOTInductor wants a flat tuple out
    flat = torch.fx.GraphModule(module, graph)
    flat._in_spec = pytree.tree_flatten((tuple(inputs), {}))[1]
    flat._out_spec = spec                              # what the partition itself returns
    return flat


def _layouts_as_given(graph, inputs):
    """Capture's record of each input's layout made the layout of the input given, where they
    differ. Inductor plans a placeholder's reads from its recorded value (``meta["val"]``), not from
    the input it is handed: capture traced a sliced example in its own layout (a ``(2, 7)``
    slice of a ``(2, 8)`` tensor, strides ``(8, 1)``), kiln compiles it contiguous
    (:func:`kiln.engines.inductor._layout`), and until 12-03 the kernels read the second row
    one element early (a T5 step's shifted labels; found by probing). The record becomes
    the input as given (a fake tensor of its layout, in the record's own fake mode)."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    for node, given in zip(graph.find_nodes(op="placeholder"), inputs):
        val = node.meta.get("val")
        mode = getattr(val, "fake_mode", None)
        if mode is None or _same_layout(val, given):
            continue
        node.meta["val"] = fake = mode.from_tensor(given, static_shapes=True)
        if "tensor_meta" in node.meta:
            node.meta["tensor_meta"] = _extract_tensor_metadata(fake)


def _same_layout(val, given) -> bool:
    try:
        return (tuple(int(s) for s in val.stride()) == tuple(given.stride())
                and int(val.storage_offset()) == given.storage_offset())
    except (TypeError, RuntimeError):     # symbolic: left as recorded
        return True


_CHECKS_OFF = """
    static bool _check_aoti_runtime_check_inputs_env() {
        const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
        const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
        return result;
    }

    AOTI_NOINLINE static void __check_inputs_outputs(
        AtenTensorHandle* input_handles,
        AtenTensorHandle* output_handles) {
        // kiln checks the inputs before every call (kiln.engines.inductor_lean)
    }
"""


def _without_checks(self):
    self.prefix.splice_aot(_CHECKS_OFF)


_SWAP = Swap(lambda original: _without_checks)


def without_input_checks():
    """Generate AOTInductor wrappers without per-input check functions inside."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    except ImportError:
        return contextlib.nullcontext()
    if "generate_input_output_runtime_checks" not in CppWrapperCpu.__dict__:
        return contextlib.nullcontext()
    return _SWAP.held(CppWrapperCpu, "generate_input_output_runtime_checks")


# ---- the wrapper's compile beside the kernels' ------------------------------

_here = threading.local()       # .pending: the wrapper compiles this thread has started


def _build_beside(original):
    def build(self):
        pending = getattr(_here, "pending", None)
        if pending is None:                          # not a build kiln is making
            return original(self)
        if getattr(self, "_compile_only", False) and \
                str(getattr(self, "_sources_args", "")).endswith("wrapper.cpp"):
            pending.append(pending.pool.submit(original, self))
            return None
        if getattr(self, "_do_link", False):         # the link needs every object file
            _finish(pending)
        return original(self)
    return build


class _Pending(list):
    def __init__(self, pool):
        super().__init__()
        self.pool = pool


def _finish(pending):
    """Wait for every started compile; raise the first one's error."""
    futures, pending[:] = list(pending), []
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


_BESIDE = Swap(_build_beside)


@contextlib.contextmanager
def wrapper_beside_kernels(enabled: bool = True):
    """Compile AOTInductor's wrapper on a thread beside its kernels, in this thread's builds
    (CPU builds: kiln passes ``enabled=False`` for CUDA ones, whose build was checked on a
    GPU as torch makes it and this one has not been)."""
    try:
        from torch._inductor.cpp_builder import CppBuilder
    except ImportError:
        CppBuilder = None
    if not enabled or CppBuilder is None or "build" not in CppBuilder.__dict__ or available_cpus() < 2 \
            or getattr(_here, "pending", None) is not None:
        yield
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-aoti-wrapper") as pool, \
            _BESIDE.held(CppBuilder, "build"):
        _here.pending = _Pending(pool)
        try:
            yield
        except BaseException:
            for f in _here.pending:                  # the build's directory is about to go
                f.exception()
            raise
        else:
            _finish(_here.pending)
        finally:
            _here.pending = None
