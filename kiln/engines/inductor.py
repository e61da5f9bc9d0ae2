"""TorchInductor engine, through AOTInductor: the engine of last resort.

Inductor lowers any ATen graph torch itself can run, so this engine supports
every ATen operator. A partition is re-exported, compiled ahead of time by
AOTInductor into C++ kernels and one shared library, and packaged as a ``.pt2``
file with the weights inside the library; that package is the blob. Loading
needs torch and no model code, and no C++ compiler: only compiling does.

Choices, and why:

* Calls go straight to the library's C interface
  (``AOTInductorModelContainerRun``) through ctypes, which drops the GIL;
  torch 2.13's Python bindings hold it for the whole run, so threads calling
  one model would take turns. The container runs one model instance per CPU
  behind its own locks: concurrent calls are safe and really concurrent.
  A package that needs torch's proxy executor (an op with no C shim) runs
  through torch's loader instead.
* Kernels read their thread count at run time (``cpp.dynamic_threads``), not
  the compiling process's, so ``RuntimeOptions.threads`` decides it. The
  runner sets it around each call with ``omp_set_num_threads``, which is per
  calling thread in OpenMP, and restores it afterwards; torch's process-wide
  ``torch.set_num_threads`` is never touched.
* Inductor specialises on the example inputs' strides, and kiln checks only shapes
  and dtypes, so every call hands the package its inputs in the layout it was compiled
  for. That layout is the example's own where the example is dense (a permutation of a
  contiguous layout: a linear layer's transposed weight, which a device program takes as
  an input), recorded in the package (``kiln_input_strides``), and contiguous otherwise; an
  input in another layout is copied into the compiled one. Compiling transposed weights
  contiguous instead cost a copy of each at every call: 26 a step, 12.8 MB, in the 4-layer
  BERT's lazy-mode training step.
* -O1/-O2 compile with inductor's defaults. -O3 also builds a ``frozen``
  variant (``freezing``: weights folded into the graph as constants and
  prepacked for oneDNN) and keeps whichever is faster here: frozen ran
  ResNet-50 1.56x and BERT-base 1.07x faster than the default, and tiny
  BERT and CNN partitions 2-3x slower. ``max_autotune`` builds and times C++
  GEMM candidates (about 25 s of g++ per matmul shape on 2 cores) and still
  picked ATen's kernel: not worth its compile time. On an H100 (11-28) a
  max-autotune variant spent over 90 s tuning ResNet-50's matmuls beside other
  work (41.6 s for one shape's 21 Triton choices) and its speed went unmeasured
  within the session's GPU time: not kept either.
* ``--target generic`` builds for the architecture's baseline (x86-64-v2,
  armv8-a) with a matching vector width instead of ``-march=native``.
* The library is tied to the torch that built it; loading under another
  torch minor version is refused with both versions named.
* The package is native code (``native_code``): it loads only from artifacts
  ``kiln.artifact.trust`` admits (compiled in this process, signed by a trusted key,
  or trusted by the caller); the check runs before this module sees the blob.
* On ``device="cuda"`` the package holds Triton kernels (cubin files beside
  the library) and cuBLAS calls, and loads through torch's package loader
  (creating a CUDA container through ctypes crashed). The runner takes inputs
  on the CPU or the GPU, and returns outputs on the device the inputs came
  from: CPU callers see a CPU model, GPU callers pay no copies. The package
  records its device (``kiln_device``); the artifact records the GPU's
  compute capability, checked at load. ``--auto-cast-type tf32`` compiles
  (and checks) with torch's TF32 flags on (``kiln.host.tf32.allowed``, set by
  the compiler's driver): Triton kernels are generated for TF32 there; the
  package's cuBLAS and cuDNN calls read the running process's flags at run
  time (torch's default: convolutions in TF32, matmuls in IEEE fp32).

* A kernel's failed index check (an index the graph computed, out of range) raises after
  the kernel's OpenMP region, where torch's check inside it ended the process: the run
  fails with a RuntimeError instead (:mod:`kiln.engines.inductor_bounds`).

Most of a compile is g++ building the C++ wrapper (8-10 s of CPU per
partition, whatever its size), so models that split into many partitions
compile slowly. The wrapper is built without AOTInductor's per-input check
functions, which only run under ``AOTI_RUNTIME_CHECK_INPUTS`` and which kiln's
own input checks make dead code (:mod:`kiln.engines.inductor_lean`).
"""
from __future__ import annotations

import copy
import ctypes
import functools
import importlib.util
import io
import json
import os
import platform
import shutil
import tempfile
import weakref
import zipfile

import torch

from kiln.errors import ArtifactError
from kiln.quiet import EXPORTER_LOGGERS, quiet
from kiln.engines.base import Engine
from kiln.engines.inductor_bounds import index_errors_raised
from kiln.engines.inductor_lean import package, without_input_checks, wrapper_beside_kernels
from kiln.engines.openmp import openmp_runtime
from kiln.host.cores import available_cpus

_LOGGERS = EXPORTER_LOGGERS + ("torch._inductor", "torch._dynamo", "torch.export", "torch._export",
                               "torch.fx.experimental.symbolic_shapes")
_TORCH_VERSION_KEY = "kiln_torch_version"
_DEVICE_KEY = "kiln_device"
_STRIDES_KEY = "kiln_input_strides"     # where inputs were compiled in a layout of their own


class InductorEngine(Engine):
    name = "inductor"
    title = "TorchInductor"
    # On an NVIDIA GPU only TorchInductor generates code (Triton kernels + cuBLAS). On
    # CPUs it compiles C++ and is slowest to build: last in the order, and the fallback
    # after an engine the user names, since it runs any ATen op.
    devices = ("cpu", "cuda")
    priority = {"cpu": 30, "cuda": 10}
    fallback = True
    package = "torch"
    blob_suffix = ".pt2"
    native_code = True      # the blob is a shared library that loading maps and runs
    draws_from_torch = True  # fallback_random: dropout calls PyTorch's kernel (below)
    checks_indices = True    # kiln.engines.inductor_bounds: a bad index is an error

    def missing(self) -> str | None:
        # Only compiling needs a C++ compiler (compile() says so when it is
        # missing): artifacts load on hosts without one. Importing
        # torch._inductor costs seconds (it pulls in dynamo), so only look.
        if hasattr(torch._C, "_aoti") and importlib.util.find_spec("torch._inductor") is not None:
            return None
        return f"torch {torch.__version__} has no AOTInductor"

    def version(self) -> str:
        return torch.__version__

    def native_types(self, device: str = "cpu") -> tuple:
        # On a GPU kiln lowers --auto-cast ops to the type: fp16 on tensor cores since
        # Volta, bf16 since Ampere. On CPUs kiln does not route reduced types here.
        if device != "cuda" or not torch.cuda.is_available():
            return ()
        return ("bf16", "fp16") if torch.cuda.is_bf16_supported() else ("fp16",)

    def supports(self, node) -> str | None:
        return self.not_aten(node)

    def variants(self, options) -> tuple:
        # Prepacked weights are laid out for this CPU's ISA: not for portable artifacts.
        return ("frozen",) if options.target != "generic" else ()

    def compile(self, partition, example_inputs, options, *, variant=None, calibration=None) -> bytes:
        _require_compiler()
        device = torch.device("cuda" if options.device == "cuda" else "cpu")
        configs = _inductor_configs(options, device.type)
        # No max-autotune variant (see the module's notes), and no cpp_wrapper one: an
        # AOTInductor build is always a C++ wrapper.
        if variant == "frozen":
            configs["freezing"] = True
        elif variant is not None:
            raise ValueError(f"unknown inductor variant {variant!r}")
        return _compile(partition, example_inputs, configs, device)

    def load(self, blob, runtime_options, origin=None, shared=None):
        return AotiRunner(blob, runtime_options.resolved_threads())


# ---- compile ------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def compiler() -> str | None:
    """The C++ compiler inductor will use (from its own search list), or None."""
    for name in _compiler_names():
        found = shutil.which(name)
        if found:
            return found
    return None


def _compiler_names() -> list:
    from torch._inductor import config
    cxx = config.cpp.cxx
    return [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]


def _require_compiler():
    # Not a KilnError on purpose: engine selection records an engine whose
    # compile() raises anything else as failed and moves on to the next one.
    if compiler() is None:
        raise RuntimeError(
            f"the inductor engine needs a C++ compiler to compile (looked for "
            f"{', '.join(_compiler_names()) or 'none: $CXX is empty'}); install g++ or point "
            "$CXX at one. Loading inductor artifacts needs no compiler.")


def _inductor_configs(options, device: str = "cpu") -> dict:
    configs = {
        "cpp.dynamic_threads": True,                    # thread count chosen at run time
        # what Inductor plans the kernels for: never one thread, since the run may have more
        # (Inductor 2.13 guards a parallel region's scalar stores with `omp single` only when
        # it plans for several threads: a build made with one thread and run with two stored
        # a training step's loss divided by its weight twice, found by probing 12-03)
        "cpp.threads": max(2, torch.get_num_threads()),
        "aot_inductor.package_constants_in_so": True,   # weights inside the blob
        "aot_inductor.metadata": {_TORCH_VERSION_KEY: torch.__version__, _DEVICE_KEY: device},
        # random ops (a training graph's dropout) call PyTorch's own kernels on its default
        # generator, in the graph's order, instead of Inductor's generator: the same seed
        # gives eager's masks (kiln.graph.randomness); graphs without them are unchanged
        "fallback_random": True,
    }
    if getattr(options, "auto_cast", "none") != "none":
        # an emulated auto-cast's roundings (a value cast to bf16 and back) are what the build is
        # for; Inductor fuses such a round trip away unless told to keep it: until 12-03 an
        # Inductor build said "bf16 is emulated" and computed in float32 (found by probing)
        configs["emulate_precision_casts"] = True
    if options.target == "generic":
        configs.update(_generic_isa())
    return configs


def _generic_isa() -> dict:
    """The architecture's baseline instead of -march=native (kiln.host.target's 'generic')."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return {"cpp.march": "x86-64-v2", "cpp.simdlen": 1}   # SSE4.2; inductor vectorises with AVX only
    if machine in ("aarch64", "arm64"):
        return {"cpp.march": "armv8-a", "cpp.simdlen": 128}    # NEON is baseline, SVE is not
    return {"cpp.march": ""}                                  # no architecture flag at all


def _compile(partition, example_inputs, configs, device) -> bytes:
    inputs = tuple(_layout(t).to(device) for t in example_inputs)
    if any(isinstance(t, torch.Tensor) and not t.is_contiguous() for t in inputs):
        strides = [list(t.stride()) if isinstance(t, torch.Tensor) else None for t in inputs]
        configs = {**configs, "aot_inductor.metadata": {**configs["aot_inductor.metadata"],
                                                        _STRIDES_KEY: json.dumps(strides)}}
    module = partition if device.type == "cpu" else _moved(partition, device)
    with torch.no_grad(), quiet(_LOGGERS), tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp, \
            without_input_checks(), wrapper_beside_kernels(device.type == "cpu"), index_errors_raised():
        path = package(module, inputs, configs, os.path.join(tmp, "partition.pt2"), device)
        with open(path, "rb") as f:
            return f.read()


def _moved(partition, device):
    """A copy of the partition on ``device``. ``Module.to`` moves parameters and buffers,
    but not plain tensor attributes, nor the ``device=cpu`` that capture wrote into
    factory ops (``scalar_tensor``, ``full``, ``arange``: attention masks are built
    from them); both are moved here. A copy, because ``Module.to`` moves parameters in
    place and they are the caller's model's own tensors."""
    module = copy.deepcopy(partition).to(device)
    for sub in module.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                setattr(sub, name, value.to(device))
    cpu = torch.device("cpu")
    for node in module.graph.nodes:
        where = node.kwargs.get("device")
        if where is not None and torch.device(where) == cpu:
            node.kwargs = {**node.kwargs, "device": device}
    module.recompile()
    return module


def _contiguous(t):
    return t.contiguous() if isinstance(t, torch.Tensor) and not t.is_contiguous() else t


def _layout(t):
    """An example input as Inductor compiles for it: as it is when dense, else contiguous."""
    if not isinstance(t, torch.Tensor) or t.is_contiguous() or _dense(t):
        return t
    return t.contiguous()


def _dense(t) -> bool:
    """Every element at an address of its own, with no gaps: a permutation of a contiguous
    layout (dims of size 1 have no say)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _as_compiled(t, stride):
    """``t`` in the layout the package was compiled for (``stride``): as it is, or copied."""
    if stride is None or not isinstance(t, torch.Tensor) or t.stride() == stride:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _input_strides(metadata: dict):
    """The compiled inputs' strides (tuples, None for a non-tensor), or None for a package
    compiled with every input contiguous."""
    recorded = metadata.get(_STRIDES_KEY)
    if not recorded:
        return None
    try:
        return [tuple(s) if s is not None else None for s in json.loads(recorded)]
    except (ValueError, TypeError) as e:
        raise ArtifactError(f"an inductor partition's recorded input strides are corrupt ({e})") from None


# ---- load and run -------------------------------------------------------------

class AotiRunner:
    """Calls a compiled partition with a list of tensors; safe from several threads."""

    def __init__(self, blob: bytes, threads: int):
        self.threads = threads
        library, metadata = _read_package(blob)
        _check_torch_version(metadata)
        self.device = torch.device(metadata.get(_DEVICE_KEY) or metadata.get("AOTI_DEVICE_KEY") or "cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ArtifactError("this inductor partition was compiled for CUDA and torch sees no "
                                "CUDA device here; recompile with device='cpu'")
        num_models = _num_models(self.device)
        # The ctypes path is for CPU partitions, where the GIL would serialise calls;
        # creating a CUDA container through it crashed (torch 2.11, H100), and GPU
        # kernels run asynchronously anyway: CUDA partitions use torch's loader.
        if library is not None and _c_interface_usable() and self.device.type == "cpu":
            self.model = ContainerModel(library, num_models)
        else:
            self.model = PackageModel(blob, num_models)
        self._run = self.model.run
        self._strides = _input_strides(metadata)
        self._omp = openmp_runtime() if self.device.type == "cpu" else None
        if self.device.type == "cuda":
            self._run = self._run_on_gpu

    def _run_on_gpu(self, inputs):
        """Inputs go to the GPU; outputs come back to where the inputs were (all on one device)."""
        home = inputs[0].device if inputs else torch.device("cpu")
        outputs = self.model.run([t.to(self.device, non_blocking=True) for t in inputs])
        if home.type == "cuda":
            return outputs
        return [t.to(home) for t in outputs]

    def __call__(self, inputs):
        strides = self._strides
        inputs = ([_contiguous(t) for t in inputs] if strides is None else
                  [_as_compiled(t, s) for t, s in zip(inputs, strides, strict=True)])
        omp = self._omp
        if omp is None:
            return self._run(inputs)
        torch.get_num_threads()              # let torch initialise this thread's OpenMP first
        previous = omp.omp_get_max_threads()
        omp.omp_set_num_threads(self.threads)
        try:
            return self._run(inputs)
        finally:
            omp.omp_set_num_threads(previous)


def _num_models(device) -> int:
    """Model instances per container: how many calls may run at once. They share the weights;
    on a GPU each holds its own activation buffers, and a few keep the GPU busy."""
    return max(1, min(available_cpus(), 16 if device.type == "cpu" else 4))


def _read_package(blob: bytes):
    """(the library's bytes if the package is just one library, else None; its metadata)."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            names = z.namelist()
            metadata: dict = {}
            for name in names:
                if name.endswith("_metadata.json"):
                    metadata.update(json.loads(z.read(name)))
            data = [n for n in names if "data" in n.split("/")[:2]]
            libraries = [n for n in data if n.endswith(".so")]
            plain = len(libraries) == 1 and all(n.endswith((".so", ".cpp", "_metadata.json")) for n in data)
            return (z.read(libraries[0]) if plain else None), metadata
    except (zipfile.BadZipFile, ValueError, KeyError) as e:
        raise ArtifactError(f"inductor partition is not a readable AOTInductor package: {e}") from e


def _check_torch_version(metadata: dict):
    built = metadata.get(_TORCH_VERSION_KEY)
    if built and built.split(".")[:2] != torch.__version__.split(".")[:2]:
        raise ArtifactError(
            f"this inductor partition was compiled with torch {built} and this process has torch "
            f"{torch.__version__}; AOTInductor libraries are tied to the torch that built them: "
            f"recompile with this torch, or load with torch {built}")


class ContainerModel:
    """The compiled library driven through AOTInductor's C interface by ctypes (GIL released)."""

    def __init__(self, library: bytes, num_models: int):
        with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
            path = os.path.join(tmp, "partition.so")
            with open(path, "wb") as f:
                f.write(library)
            lib = ctypes.CDLL(path)   # the mapping outlives the file
        _declare(lib)
        handle = ctypes.c_void_p()
        _check(lib, lib.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(handle), num_models, b"cpu", None))
        self._finalizer = weakref.finalize(self, _free, lib, handle)
        count = ctypes.c_size_t()
        _check(lib, lib.AOTInductorModelContainerGetNumInputs(handle, ctypes.byref(count)))
        self.num_inputs = count.value
        _check(lib, lib.AOTInductorModelContainerGetNumOutputs(handle, ctypes.byref(count)))
        self.num_outputs = count.value
        self._lib, self._handle = lib, handle

    def run(self, inputs):
        if len(inputs) != self.num_inputs:
            raise ValueError(f"compiled partition takes {self.num_inputs} tensors, got {len(inputs)}")
        aoti, capsule = torch._C._aoti, _capsules()
        # New at::Tensor handles for the inputs; the run steals (frees) them.
        handles = (ctypes.c_void_p * len(inputs))(
            *[capsule.pointer(c, None) for c in aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)])
        outputs = (ctypes.c_void_p * self.num_outputs)()
        _check(self._lib, self._lib.AOTInductorModelContainerRun(
            self._handle, handles, len(inputs), outputs, self.num_outputs, None, None))
        return aoti.alloc_tensors_by_stealing_from_void_ptrs([capsule.new(p, None, None) for p in outputs])


class PackageModel:
    """torch's own package loader (handles proxy-executor ops; holds the GIL while running)."""

    def __init__(self, blob: bytes, num_models: int):
        from torch._inductor.package import load_package
        # The loader unpacks the library into its own temp directory (removed
        # when the model is freed), so the package file can go right away.
        with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp, quiet(_LOGGERS):
            path = os.path.join(tmp, "partition.pt2")
            with open(path, "wb") as f:
                f.write(blob)
            self.model = load_package(path, num_runners=num_models, run_single_threaded=False)
        self._boxed_run = self.model.loader.boxed_run

    def run(self, inputs):
        return self._boxed_run(list(inputs))   # boxed_run empties the list it is given


def _declare(lib):
    c_size_p, handle_p = ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_void_p)
    for name, args in {
        "AOTInductorModelContainerCreateWithDevice": [handle_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p],
        "AOTInductorModelContainerDelete": [ctypes.c_void_p],
        "AOTInductorModelContainerGetNumInputs": [ctypes.c_void_p, c_size_p],
        "AOTInductorModelContainerGetNumOutputs": [ctypes.c_void_p, c_size_p],
        "AOTInductorModelContainerRun": [ctypes.c_void_p, handle_p, ctypes.c_size_t, handle_p,
                                         ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p],
    }.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int32


def _check(lib, code: int):
    if code == 0:
        return
    message = ctypes.c_char_p()
    last_error = getattr(lib, "AOTInductorGetLastError", None)
    if last_error is not None and last_error(ctypes.byref(message)) == 0 and message.value:
        raise RuntimeError(f"AOTInductor: {message.value.decode(errors='replace')}")
    raise RuntimeError(f"AOTInductor call failed with code {code}")


def _free(lib, handle):
    lib.AOTInductorModelContainerDelete(handle)
    try:
        import _ctypes
        _ctypes.dlclose(lib._handle)
    except (ImportError, AttributeError, OSError):
        pass


@functools.lru_cache(maxsize=1)
def _capsules():
    """PyCapsule_GetPointer / PyCapsule_New with their own prototypes (pythonapi's are shared)."""
    from types import SimpleNamespace
    api = ctypes.pythonapi
    pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", api))
    new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(("PyCapsule_New", api))
    return SimpleNamespace(pointer=pointer, new=new)


def _c_interface_usable() -> bool:
    aoti = getattr(torch._C, "_aoti", None)
    return (hasattr(ctypes, "pythonapi") and hasattr(aoti, "unsafe_alloc_void_ptrs_from_tensors")
            and hasattr(aoti, "alloc_tensors_by_stealing_from_void_ptrs"))
