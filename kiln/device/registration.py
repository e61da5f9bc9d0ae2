"""Registering kiln as a PyTorch device through PrivateUse1.

PyTorch has one PrivateUse1 backend per process, and one name for it. :func:`register`
names it ``"kiln"`` (or ``"neuron"``, for TorchNeuron scripts: ``KILN_DEVICE_NAME``, read
by :mod:`kiln.device.autoload` when ``import torch`` calls it) and sets up
what PyTorch asks of a backend: the device module (``torch.kiln``: device count, seeding,
``synchronize``, autocast dtypes), hooks and a device guard (PyTorch's Python-backend
helper, which is experimental: it is feature-tested here and its absence is a clear
error), and a fallback kernel that receives the operations with no device tensor
argument to dispatch on: factories such as ``torch.zeros(..., device="kiln")``.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from kiln import config
from kiln.device import memory as _memory
from kiln.device import tensor as dt

_LOCK = threading.Lock()
_registered: list = []
_broken: list = []          # why the registered device cannot train (raised on every use)


class DeviceUnavailable(RuntimeError):
    """This torch cannot host a Python PrivateUse1 backend, or the name is taken."""


def _helper():
    try:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    except ImportError:
        _setup_privateuseone_for_python_backend = None
    if _setup_privateuseone_for_python_backend is None or not hasattr(torch._C, "_acc"):
        raise DeviceUnavailable(
            f"kiln's device needs PyTorch's Python PrivateUse1 backend support "
            f"(torch.utils.backend_registration._setup_privateuseone_for_python_backend, "
            f"torch 2.13); this is torch {torch.__version__}. torch.compile(backend='kiln') and "
            f"kiln.trace work without it")
    return _setup_privateuseone_for_python_backend


class Event:
    """A device event: kiln's device runs in program order on the host, so an event has
    always happened by the time anyone can ask."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


class Stream:
    """A device stream: one, in program order (FSDP2 asks for several; they are all it)."""

    def __init__(self, device=None, priority=0, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or Event()

    def query(self) -> bool:
        return True

    def synchronize(self):
        from kiln.device.dispatch import materialize
        materialize()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_STREAM = Stream()


class DeviceModule:
    """``torch.kiln`` (or ``torch.neuron``): what PyTorch and scripts ask of a device."""

    Stream = Stream
    Event = Event

    @staticmethod
    def current_stream(device=None) -> Stream:
        return _STREAM

    default_stream = current_stream

    @staticmethod
    def stream(stream):
        return stream or _STREAM

    @staticmethod
    def set_stream(stream):
        pass

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        """kiln cores (``kiln.cores()``): the CPUs a model may own, as Neuron counts
        NeuronCores."""
        from kiln.host import cores
        return max(1, len(cores.visible()))

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(index) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        """Run everything queued (eager mode) or recorded (lazy mode) now."""
        from kiln.device.dispatch import materialize
        materialize()

    # the device's random numbers are the CPU generator's, drawn in program order
    # (torch.manual_seed calls manual_seed_all here too: the generator, not torch.manual_seed)
    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    manual_seed_all = manual_seed

    @staticmethod
    def seed() -> None:
        torch.default_generator.seed()

    seed_all = seed

    @staticmethod
    def initial_seed() -> int:
        return torch.default_generator.initial_seed()

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        torch.set_rng_state(state)

    # CUDA's memory calls and device queries (kiln/device/memory.py says what the figures are)
    memory_stats = staticmethod(_memory.memory_stats)
    memory_allocated = staticmethod(_memory.memory_allocated)
    max_memory_allocated = staticmethod(_memory.max_memory_allocated)
    memory_reserved = staticmethod(_memory.memory_reserved)
    max_memory_reserved = staticmethod(_memory.max_memory_reserved)
    reset_peak_memory_stats = staticmethod(_memory.reset_peak_memory_stats)
    mem_get_info = staticmethod(_memory.mem_get_info)
    empty_cache = staticmethod(_memory.empty_cache)

    @staticmethod
    def get_device_name(device=None) -> str:
        import platform
        return f"kiln ({platform.processor() or platform.machine()})"

    @staticmethod
    def get_device_properties(device=None):
        import types
        return types.SimpleNamespace(name=DeviceModule.get_device_name(), total_memory=_memory.mem_get_info()[1],
                                     multi_processor_count=DeviceModule.device_count(), type="kiln")

    @staticmethod
    @contextlib.contextmanager
    def device(index):
        """One device per process: selecting it changes nothing."""
        yield

    @staticmethod
    def get_rng_state_all():
        return [torch.get_rng_state()]

    @staticmethod
    def set_rng_state_all(states) -> None:
        torch.set_rng_state(states[0])

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def _is_compiled() -> bool:
        return True


def _factory(op, *args, **kwargs):
    from kiln.device.dispatch import dispatch
    return dispatch(op, args, kwargs)


def register(name: str = "kiln", *, probe: bool = True) -> str:
    """Make ``torch.device(name)`` kiln's device; returns the name. Idempotent; a second
    name in one process is an error (PrivateUse1 has one name per process). ``probe``
    checks that autograd can still serve the device (:func:`_probe_autograd`); the
    autoload hook skips it, since ``import torch`` has run no backward pass yet and the
    probe would start autograd's threads."""
    with _LOCK:
        if _broken:
            raise DeviceUnavailable(_broken[0])
        if _registered:
            if _registered[0] != name:
                raise DeviceUnavailable(
                    f"kiln's device is registered as '{_registered[0]}' in this process; PyTorch allows "
                    f"one PrivateUse1 name per process, so '{name}' cannot be added. import torch "
                    f"registers the name in KILN_DEVICE_NAME (default 'kiln'): set KILN_DEVICE_NAME="
                    f"{name} to get '{name}'")
            return name
        setup = _helper()
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", name):
            raise DeviceUnavailable(f"PyTorch's PrivateUse1 backend is already named '{current}' in this "
                                    f"process (another package registered it); kiln cannot register '{name}'")
        _warn_if_cuda()         # only for a registration that goes ahead
        setup(rename=name if current != name else None, backend_module=DeviceModule())
        dt.set_device_type(name)
        library = torch.library.Library("_", "IMPL")
        library.fallback(_factory, dispatch_key="PrivateUse1")
        from kiln.device import autocast, dispatch, index_checks
        assert dispatch.current() is not None        # its handlers are installed on the tensor class
        _registered.append(name)
        # kept alive: the registrations live as long as their libraries
        _registered.extend([library, _per_op(), autocast.register(name), index_checks.register()])
        _foreach_capable()
        _pinnable(name)
        from kiln.device import (accelerate_compat, data_parallel, default_backend, dynamo_skip, fsdp_mesh,
                                 generators, nn_fastpath, serialization, tied_parameters)
        serialization.install(name)
        generators.install(name)
        _memory.install()
        nn_fastpath.install()
        data_parallel.install()
        default_backend.install()
        fsdp_mesh.install()
        accelerate_compat.install()
        dynamo_skip.install()
        tied_parameters.install()
        if probe:
            _probe_autograd(name)
        return name


# Operators that reach PrivateUse1 with one of kiln's tensors among their arguments while
# the Python dispatch key is excluded: ``torch.tensor(data, device="kiln")`` (and
# ``as_tensor``, ``new_tensor``) builds the tensor on the device, then calls ``_to_copy``
# with the Python key excluded, and so lands on the PrivateUse1 kernel instead of
# ``__torch_dispatch__``. PyTorch (2.13) runs a Python kernel given such an argument through
# its per-operator registry, which holds no entry for a fallback: an INTERNAL ASSERT
# ("func != nullptr"), so every ``torch.tensor(..., device=device)`` in a training script
# failed. Registered per operator, the same kernel is found.
PER_OP = ("_to_copy",)


def _per_op():
    """The fallback's kernel registered for :data:`PER_OP` one by one; returns the library."""
    library = torch.library.Library("aten", "IMPL")
    for name in PER_OP:
        op = getattr(torch.ops.aten, name).default
        library.impl(name, lambda *args, _op=op, **kwargs: _factory(_op, *args, **kwargs), "PrivateUse1")
    return library


def _pinnable(name: str):
    """``Tensor.pin_memory()`` when the pinning is for kiln's device: a copy in ordinary
    host memory, which is what the device reads anyway.

    Why: once the device is registered it is PyTorch's current accelerator, and PyTorch pins
    memory through the accelerator's C++ hooks, which a Python backend cannot provide (2.13:
    ``getPinnedMemoryAllocator``, NotImplementedError). ``DataLoader(pin_memory=True)`` pins
    for the current accelerator, so every script using it failed in an environment where kiln
    is installed, CPU-only scripts that never touch the device included. A pin for any other
    device is PyTorch's own, unchanged."""
    tensor_class = torch.Tensor
    if getattr(tensor_class.pin_memory, "_kiln_pinnable", False):
        return
    original = tensor_class.pin_memory

    def pin_memory(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        kind = torch.device(device).type if device is not None else torch._C._get_privateuse1_backend_name()
        current = torch.accelerator.current_accelerator()
        if kind == name and (device is not None or (current is not None and current.type == name)):
            return self.clone()
        return original(self, *args, **kwargs)

    pin_memory._kiln_pinnable = True
    pin_memory.__doc__ = original.__doc__
    tensor_class.pin_memory = pin_memory


def _foreach_capable():
    """Let PyTorch's optimizers and ``clip_grad_norm_`` take their foreach path on kiln's
    tensors (as ``torch.distributed.tensor`` does for DTensor): a few ``_foreach_*``
    calls per step, each recorded as one operation, instead of a dozen operations per
    parameter (:mod:`kiln.device.foreach`)."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils
    for supported in (optimizer._foreach_supported_types, foreach_utils._foreach_supported_types):
        if dt.DeviceTensor not in supported:
            supported.append(dt.DeviceTensor)


def _probe_autograd(name: str):
    """PyTorch's autograd engine sizes its per-device worker queues once, at the first
    backward pass of the process, from the devices registered then. A device registered
    after that can never run a backward pass; say so now, not mid-training."""
    try:
        x = torch.ones((), device=name, requires_grad=True)
        (x * 2).backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        _broken.append(
            f"kiln's device was registered after this process's first backward pass; PyTorch's autograd "
            f"engine only serves devices registered before it starts, so '{name}' tensors cannot be "
            f"trained here. import torch registers it before any backward pass through kiln's "
            f"'torch.backends' entry point (PyTorch's device-backend autoload), which did not run here "
            f"(TORCH_DEVICE_BACKEND_AUTOLOAD={config.get('TORCH_DEVICE_BACKEND_AUTOLOAD')!r}, "
            f"KILN_DEVICE_NAME={config.get('KILN_DEVICE_NAME')!r}; or a warning at import said why). "
            f"Turn autoload on (unset TORCH_DEVICE_BACKEND_AUTOLOAD or set it to 1; KILN_DEVICE_NAME "
            f"kiln or neuron), or register the device first: call kiln.device.modes.device() (or "
            f"xm.xla_device()) at the top of the script, before any .backward()")
        raise DeviceUnavailable(_broken[0]) from None


def spares_cuda() -> bool:
    """Whether ``import torch`` should leave the device out: this torch is a CUDA build and
    ``KILN_DEVICE_NAME`` does not ask for the device. Once a PrivateUse1 backend is
    registered, PyTorch takes it for the process's accelerator (``at::getAccelerator``),
    its autograd engine finds no stream for CUDA tensors, and every CUDA backward pass
    fails an internal assert (``opt_ready_stream && opt_parent_stream``; PyTorch issue
    161129). Registering by default would break GPU training in every program of the
    environment; the torch version is read, not the GPU, so ``import torch`` starts no
    CUDA driver."""
    return bool(torch.version.cuda or torch.version.hip) and not config.is_set("KILN_DEVICE_NAME")


def _warn_if_cuda():
    if torch.cuda.is_available():
        import warnings
        warnings.warn("kiln's device is registered in a process that sees a CUDA GPU: PyTorch now takes "
                      "PrivateUse1 for its accelerator, and CUDA backward passes in this process fail "
                      "('opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED', PyTorch issue "
                      "161129). Train on CUDA in a process that does not use kiln's device "
                      "(torch.compile(backend='kiln') and kiln.trace do not need it)",
                      RuntimeWarning, stacklevel=3)


def registered_name():
    return _registered[0] if _registered else None


def configured_name():
    """The name in ``KILN_DEVICE_NAME``, or None when it says ``off`` (or is empty)."""
    name = (config.get("KILN_DEVICE_NAME") or "").strip()
    return None if name.lower() in ("", "off", "0", "none") else name
