"""NxD's trainer API (``neuronx_distributed.trainer``): ``neuronx_distributed_config``,
``initialize_parallel_model``, ``initialize_parallel_optimizer``.

The config is NxD's plain dict with NxD's defaults; building it sets up the parallel
state when ``torch.distributed`` is initialized. ``initialize_parallel_model`` builds the
model after the parallel state exists (the parallel layers need it), optionally on the
meta device, wraps it in ``NxDPPModel`` when PP > 1, moves it to the training device
(keeping the parallel layers' attributes and tied weights), and applies activation
checkpointing. ``initialize_parallel_optimizer`` wraps the optimizer as NxD does
(``NeuronZero1Optimizer`` when ZeRO-1 is on).

What is not supported is a clear error naming the option: LoRA, expert and context
parallelism, DCP ZeRO-1 checkpoints. Unknown keys in the option dicts are errors too.

Which device: NxD moves the model to ``xm.xla_device()``, or leaves it on the CPU when
``NXD_CPU_MODE=1``. This layer cannot import the device, so the module tree
``kiln.neuronx_distributed.trainer`` installs that choice with :func:`set_device_resolver`;
called directly from here, the model stays on the device its ``model_fn`` built it on.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
import torch.distributed as dist

from kiln.distributed.nxd_wrappers import NxDModel, NxDOptimizer
from kiln.errors import KilnError

log = logging.getLogger("kiln.neuronx_distributed")

_OPTIMIZER_KEYS = ("zero_one_enabled", "grad_clipping", "max_grad_norm")
_PRECISION_KEYS = ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt")
_INIT_KEYS = ("sequential_move_factor", "meta_device_init", "param_init_fn")
_device_resolver = [None]


class TrainerConfigError(KilnError, ValueError):
    """An NxD trainer option kiln does not know or does not support (the message names it)."""


def _state():
    from kiln.distributed import state
    return state


def set_device_resolver(fn) -> None:
    """``fn()`` -> the device ``initialize_parallel_model`` moves the model to (None: stay)."""
    _device_resolver[0] = fn


def _check_keys(name, given, known):
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TrainerConfigError(f"{name} has unknown key(s) {unknown}: kiln knows {list(known)}")


def _filled(name, given, defaults):
    if not isinstance(given, dict):
        raise TrainerConfigError(f"{name} must be a dict, got {type(given).__name__}")
    for key, value in defaults.items():
        if key not in given:
            if _state().is_global_rank_zero():
                log.warning("%s is not set, automatically set it to %r.", key, value)
            given[key] = value
    return given


def neuronx_distributed_config(tensor_parallel_size=1, pipeline_parallel_size=1, expert_parallel_size=1,
                               context_parallel_size=1, pipeline_config=None, optimizer_config=None,
                               activation_checkpoint_config=None, pad_model=False, sequence_parallel=False,
                               model_init_config=None, lora_config=None, mixed_precision_config=None,
                               sequential_move_factor=11, lnc_size=1) -> dict:
    """NxD's config dict (same keys and defaults). Calls ``initialize_model_parallel`` when
    ``torch.distributed`` is initialized (a state already initialized at the same degrees
    is kept; other degrees are an error)."""
    if optimizer_config is None:
        optimizer_config = {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    else:
        _check_keys("optimizer_config", optimizer_config, _OPTIMIZER_KEYS)
        _filled("optimizer_config", optimizer_config, {"zero_one_enabled": False, "grad_clipping": True})
        if optimizer_config["grad_clipping"]:
            _filled("optimizer_config", optimizer_config, {"max_grad_norm": 1.0})
    zero1 = optimizer_config["zero_one_enabled"]
    precision = {"use_master_weights": zero1, "use_fp32_grad_acc": zero1, "use_master_weights_in_ckpt": False}
    if mixed_precision_config is None:
        mixed_precision_config = precision
    else:
        _check_keys("mixed_precision_config", mixed_precision_config, _PRECISION_KEYS)
        _filled("mixed_precision_config", mixed_precision_config, precision)
    init = {"sequential_move_factor": sequential_move_factor, "meta_device_init": False, "param_init_fn": None}
    if model_init_config is None:
        model_init_config = init
    else:
        _check_keys("model_init_config", model_init_config, _INIT_KEYS)
        if model_init_config.get("meta_device_init") and model_init_config.get("param_init_fn") is None:
            raise TrainerConfigError("model_init_config: param_init_fn must be provided when meta_device_init "
                                     "is True (it fills each module's parameters after the model is moved)")
        _filled("model_init_config", model_init_config, init)
    _check_unsupported(expert_parallel_size, context_parallel_size, lora_config, pipeline_parallel_size,
                       pipeline_config)
    config = {"tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
              "expert_parallel_size": expert_parallel_size, "context_parallel_size": context_parallel_size,
              "pipeline_config": pipeline_config, "optimizer_config": optimizer_config,
              "activation_checkpoint_config": activation_checkpoint_config, "pad_model": pad_model,
              "sequence_parallel": sequence_parallel, "model_init_config": model_init_config,
              "lora_config": lora_config, "mixed_precision_config": mixed_precision_config,
              "sequential_move_factor": sequential_move_factor, "lnc_size": lnc_size}
    if dist.is_initialized():
        _initialize_state(config)
        if _state().is_global_rank_zero():
            log.info("NxD config: %s", config)
    return config


def _check_unsupported(ep, cp, lora_config, pp, pipeline_config):
    if ep != 1:
        raise TrainerConfigError(f"expert_parallel_size={ep}: kiln's trainer has no expert parallelism (MoE); "
                                 "use expert_parallel_size=1")
    if cp != 1:
        raise TrainerConfigError(f"context_parallel_size={cp}: kiln's trainer has no context parallelism; "
                                 "use context_parallel_size=1")
    if lora_config is not None and getattr(lora_config, "enable_lora", True):
        raise TrainerConfigError("lora_config: kiln's trainer does not support LoRA (NxD's LoraModel); "
                                 "pass lora_config=None")
    if pp > 1 and not isinstance(pipeline_config, dict):
        raise TrainerConfigError(f"pipeline_parallel_size={pp} needs pipeline_config, the dict of NxDPPModel's "
                                 "arguments (e.g. {'transformer_layer_cls': LlamaDecoderLayer, "
                                 "'num_microbatches': 4})")


def _initialize_state(config):
    state = _state()
    want = (config["tensor_parallel_size"], config["pipeline_parallel_size"])
    if state.model_parallel_is_initialized():
        have = (state.get_tensor_model_parallel_size(), state.get_pipeline_model_parallel_size())
        world = dist.get_world_size() if dist.is_initialized() else 1
        if have != tuple(min(w, world) for w in want):
            raise TrainerConfigError(f"the parallel state is already initialized with TP={have[0]}, PP={have[1]}; "
                                     f"this config asks for TP={want[0]}, PP={want[1]}")
        return
    state.initialize_model_parallel(tensor_model_parallel_size=want[0], pipeline_model_parallel_size=want[1],
                                    lnc_size=config.get("lnc_size", 1))


# -- the model --------------------------------------------------------------------------------
def initialize_parallel_model(nxd_config, model_fn, include_buffers=False, *model_args, **model_kwargs):
    """Build ``model_fn(*model_args, **model_kwargs)`` for this rank and return an
    :class:`NxDModel`. NB (NxD's signature): the third positional argument is
    ``include_buffers`` (meta-device init of buffers too), not a model argument."""
    if not _state().model_parallel_is_initialized():
        _initialize_state(nxd_config)
    init = nxd_config["model_init_config"]
    if init["meta_device_init"]:
        with init_on_meta(include_buffers):
            model = model_fn(*model_args, **model_kwargs)
    else:
        model = model_fn(*model_args, **model_kwargs)
    base = model
    pp = nxd_config["pipeline_parallel_size"] > 1
    if pp:
        model = _pipeline_model(model, nxd_config, init.get("param_init_fn"))
    device = _device_resolver[0]() if _device_resolver[0] is not None else None
    if pp and hasattr(model, "move_model_to_device"):
        model.move_model_to_device()
    elif init["meta_device_init"]:
        materialize(model, device or torch.device("cpu"), init["param_init_fn"])
    elif device is not None:
        move_model_to_device(model, device)
    if nxd_config["pad_model"]:
        model = _pad(model, base)
    nxd_model = NxDModel(model, nxd_config)
    if nxd_config["activation_checkpoint_config"] is not None:
        classes = _checkpoint_classes(nxd_config["activation_checkpoint_config"], model, base, pp)
        apply_activation_checkpointing(nxd_model, lambda m: isinstance(m, classes))
    return nxd_model


def _pipeline_model(model, nxd_config, param_init_fn):
    try:
        from kiln.distributed.pipeline import NxDPPModel
    except ImportError as e:
        raise TrainerConfigError(f"pipeline_parallel_size={nxd_config['pipeline_parallel_size']} needs "
                                 f"kiln.distributed.pipeline.NxDPPModel, which could not be imported: {e}") from e
    cfg = nxd_config["pipeline_config"]
    cfg.update({"param_init_fn": param_init_fn, "use_model_wrapper": True})
    # the trainer's optimizer (NxDOptimizer) averages gradients over DP itself: the pipeline must not too
    cfg.setdefault("use_optimizer_wrapper", True)
    cfg.setdefault("use_zero1_optimizer", bool(nxd_config["optimizer_config"].get("zero_one_enabled")))
    return NxDPPModel(model, **cfg)


def _pad(model, base):
    if not hasattr(base, "config") or not hasattr(base.config, "num_attention_heads"):
        raise TrainerConfigError("pad_model=True pads attention heads of a Hugging Face model "
                                 "(model.config.num_attention_heads); this model has no such config")
    from kiln.distributed.pad import pad_model
    return pad_model(model, _state().get_tensor_model_parallel_size(), base.config.num_attention_heads)


def _checkpoint_classes(option, model, base, pp):
    if option == "full":
        if pp:
            return (model.transformer_layer_cls,)
        names = getattr(base, "_no_split_modules", None)
        if not names:
            raise TrainerConfigError('activation_checkpoint_config="full" is only supported for Hugging Face '
                                     "models (their _no_split_modules) or with pipeline parallelism; pass the "
                                     "layer class(es) instead")
        found = {type(m) for m in base.modules() if type(m).__name__ in names}
        return tuple(found)
    classes = tuple(option) if isinstance(option, (list, tuple)) else (option,)
    if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise TrainerConfigError(f"activation_checkpoint_config={option!r}: pass 'full', an nn.Module class, "
                                 "or a list of them")
    return classes


def apply_activation_checkpointing(model, check_fn=lambda _: True, include_root: bool = False):
    """Recompute the forward of each submodule ``check_fn`` accepts during backward
    (``torch.utils.checkpoint``, non-reentrant; torch's RNG state and the model-parallel RNG
    tracker's streams are restored for the recomputation, so dropout draws the same masks).
    The module's forward is wrapped in place, so parameter and state-dict names do not
    change. ``include_root``: ``model`` itself may be wrapped too."""
    for module in list(model.modules()):
        if (module is model and not include_root) or not check_fn(module) or getattr(module, "_kiln_checkpointed",
                                                                                     False):
            continue
        original = module.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            if not torch.is_grad_enabled():
                return _original(*args, **kwargs)
            from kiln.distributed.rng import checkpoint_context_fn
            return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False,
                                                     context_fn=checkpoint_context_fn, **kwargs)
        module.forward = forward
        module._kiln_checkpointed = True
    return model


@contextlib.contextmanager
def init_on_meta(include_buffers=False):
    """Parameters (and buffers, with ``include_buffers``) created inside go to the meta
    device: a model larger than host memory is described without being allocated."""
    register_parameter = torch.nn.Module.register_parameter
    register_buffer = torch.nn.Module.register_buffer

    def meta_parameter(module, name, param):
        register_parameter(module, name, param)
        if param is not None and param.device.type != "meta":
            old = module._parameters[name]
            new = torch.nn.Parameter(old.detach().to("meta"), requires_grad=old.requires_grad)
            new.__dict__.update(old.__dict__)
            module._parameters[name] = new

    def meta_buffer(module, name, buffer, persistent=True):
        register_buffer(module, name, buffer if buffer is None else buffer.to("meta"), persistent=persistent)
    torch.nn.Module.register_parameter = meta_parameter
    if include_buffers:
        torch.nn.Module.register_buffer = meta_buffer
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter
        torch.nn.Module.register_buffer = register_buffer


def materialize(model, device, param_init_fn):
    """Give a meta-initialized model real storage on ``device`` and let ``param_init_fn(module)``
    fill each module that owns parameters or buffers (NxD's ``meta_device_init``)."""
    attrs = _param_attrs(model)
    model.to_empty(device=device)
    _restore_attrs(model, attrs)
    with torch.no_grad():
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
                param_init_fn(module)


def _param_attrs(model):
    return {name: dict(p.__dict__) for name, p in model.named_parameters(remove_duplicate=False)}


def _restore_attrs(model, attrs):
    for name, p in model.named_parameters(remove_duplicate=False):
        for key, value in attrs.get(name, {}).items():
            if not hasattr(p, key):
                setattr(p, key, value)


def move_model_to_device(model, device):
    """``model.to(device)`` that keeps what NxD's ``move_model_to_device`` keeps: the
    parallel layers' attributes on each parameter (``tensor_model_parallel``,
    ``partition_dim`` ...) and weights tied between modules (one parameter, not two)."""
    attrs = _param_attrs(model)
    owners: dict = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    model.to(device)
    for places in owners.values():
        first_module, first_name = places[0]
        shared = first_module._parameters[first_name]
        for module, name in places[1:]:
            module._parameters[name] = shared
    _restore_attrs(model, attrs)
    return model


# -- the optimizer ----------------------------------------------------------------------------
def initialize_parallel_optimizer(nxd_config, optimizer_class, parameters, **defaults):
    """``optimizer_class(parameters, **defaults)`` wrapped as NxD does: in a
    ``NeuronZero1Optimizer`` when ``optimizer_config['zero_one_enabled']`` (sharded over
    the DP groups; NB as in NxD, ZeRO-1 clips at its own default ``max_norm`` of 1.0, not
    at ``max_grad_norm``: kiln warns when they differ), then in an ``NxDOptimizer``."""
    config, precision = nxd_config["optimizer_config"], nxd_config["mixed_precision_config"]
    if config["zero_one_enabled"]:
        from kiln.distributed.zero1 import NeuronZero1Optimizer
        state = _state()
        zero1 = {"grad_clipping": config["grad_clipping"], "pin_layout": False,
                 "sharding_groups": state.get_data_parallel_group(as_list=True),
                 "grad_norm_groups": state.get_tensor_model_parallel_group(as_list=True), "coalesce_cc": True}
        if precision["use_fp32_grad_acc"]:
            zero1.update(use_grad_acc_hook=True, higher_cc_precision=True)
        zero1["save_master_weights"] = bool(precision["use_master_weights_in_ckpt"])
        if config["grad_clipping"] and config.get("max_grad_norm", 1.0) != 1.0 and "max_norm" not in defaults:
            warnings.warn(f"optimizer_config max_grad_norm={config['max_grad_norm']} is not used with ZeRO-1: NxD's "
                          "initialize_parallel_optimizer does not pass it, so NeuronZero1Optimizer clips at 1.0; "
                          "pass max_norm=... to initialize_parallel_optimizer to choose it", UserWarning, stacklevel=2)
        optimizer = NeuronZero1Optimizer(parameters, optimizer_class, **zero1, **defaults)
    else:
        if precision["use_master_weights"]:
            raise RuntimeError("ZeRO-1 optimizer is not enabled, while `use_master_weights` is True.")
        if precision["use_fp32_grad_acc"] or precision["use_master_weights_in_ckpt"]:
            raise RuntimeError("Non Zero-1 optimizer does not support `use_fp32_grad_acc` of "
                               "`use_master_weights_in_ckpt`.")
        optimizer = optimizer_class(parameters, **defaults)
    return NxDOptimizer(optimizer, nxd_config)
