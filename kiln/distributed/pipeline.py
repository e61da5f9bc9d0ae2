"""NxD's pipeline-parallel model (``neuronx_distributed.pipeline.NxDPPModel``) on
``torch.distributed``.

The model is traced with torch.fx (transformer layers and ``leaf_module_cls`` stay whole),
cut after the modules named in ``pipeline_cuts`` (or evenly by ``auto_partition``), and
stage ``s`` runs on pipeline rank ``s % pp``. ``run_train(**batch)`` splits the batch
into ``num_microbatches`` on dim 0 and runs NxD's non-interleaved 1F1B schedule; the
activations go forward and their gradients back by point-to-point send/recv over the
pipeline group. It returns the mean microbatch loss on the last pipeline rank (None
elsewhere) unless ``broadcast_and_average_loss``. Weights used by stages on different
ranks (tied embeddings) are made equal when the model moves to its device and get the
sum of their gradients after every batch, over a group of exactly those ranks
(``create_pg_with_ranks``).

Differences from NxD (each a clear error, never silently ignored): interleaved schedules
(``virtual_pipeline_size > 1``), ``deallocate_pipeline_outputs``, manual partitioning and
``autowrap_obj_methods`` are not implemented; ``tracer_cls="hf"`` needs HF's fx tracer,
which transformers 5 removed. ``fuse_microbatches`` (no step boundary between tasks) keeps
``return_loss_on_cpu`` as given, where NxD turns it off: on kiln's lazy device the
returned loss, kept on the device, read different values after later steps. ``trace_file_path`` is accepted and unused, as in NxD
(whose constructor resets it to None). The device is the default process group's: kiln's
device under the ``"xla"``/``"kiln"`` backend, CUDA under NCCL, else the CPU.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from kiln.distributed import state
from kiln.distributed import schedule as sched
from kiln.distributed.pipeline_comm import PeerLink
from kiln.distributed.pipeline_cut import (PipelineError, PipelineInputError, auto_cuts, cut_stages,
                                           model_layers, trace_model)
from kiln.distributed.pipeline_run import PipelineRunner

__all__ = ["NxDPPModel", "PipelineError", "PipelineInputError"]

# NxD's private constructor flags: the value that matches what kiln does is accepted
_PRIVATE_DEFAULTS = {
    "_delay_tracing": None, "_turn_off_odd_even_scheduler": None, "_mark_step_before_pp_runtime": None,
    "_mark_step_after_pp_runtime": None, "_deallocate_send_tensors": None,
    "_use_gloo_for_metadata_comm": None,            # kiln sends metadata over the pipeline group
    "_all_reduce_send_recv": False, "_fused_send_recv": False, "_fused_fwd_bwd": False, "_debug_mode": False,
}


_device_resolver = [None]


def set_device_resolver(fn) -> None:
    """``fn()`` -> the device the stages move to (``kiln.neuronx_distributed`` installs NxD's
    choice, which this layer cannot import); None restores :func:`default_device`."""
    _device_resolver[0] = fn


def default_device() -> torch.device:
    """Where the stages run: kiln's device under its process-group backend, a GPU under NCCL,
    else the CPU."""
    if _device_resolver[0] is not None:
        return _device_resolver[0]()
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend in ("xla", "kiln"):
        return torch.device(torch._C._get_privateuse1_backend_name(), 0)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_options(o: dict, private: dict):
    unsupported = {
        "deallocate_pipeline_outputs": o["deallocate_pipeline_outputs"],
        "manual_pp_partition": o["manual_pp_partition"],
        "manual_pp_stage_partition_fn": o["manual_pp_stage_partition_fn"] is not None,
        "manual_pp_loss_fn": o["manual_pp_loss_fn"] is not None,
    }
    for name, given in unsupported.items():
        if given:
            raise PipelineError(f"NxDPPModel option {name} is not supported by kiln")
    if o["virtual_pipeline_size"] != 1:
        sched.TrainInterleavedSchedule(o["num_microbatches"], o["virtual_pipeline_size"], 0, 0)
    for name, value in private.items():
        if name not in _PRIVATE_DEFAULTS:
            raise TypeError(f"NxDPPModel got an unexpected keyword argument {name!r}")
        wanted = _PRIVATE_DEFAULTS[name]
        if wanted is not None and value != wanted:
            raise PipelineError(f"NxDPPModel option {name}={value!r} is not supported by kiln")
    if o["transformer_layer_cls"] is None:
        raise PipelineError("NxDPPModel requires transformer_layer_cls (the decoder layer class)")
    if o["broadcast_and_average_loss"] and o["return_mb_loss"]:
        raise PipelineError("broadcast_and_average_loss=True needs return_mb_loss=False")
    if o["auto_partition"] and o["pipeline_cuts"]:
        raise PipelineError("auto_partition=True and pipeline_cuts are both given: with auto_partition the "
                            "cuts are computed; pass one or the other")


class NxDPPModel(PipelineRunner, nn.Module):
    """NxD's ``NxDPPModel``: see the module docstring; the arguments are NxD's."""

    def __init__(self, module: nn.Module, transformer_layer_cls=None, num_microbatches: int = 1,
                 virtual_pipeline_size: int = 1, output_loss_value_spec=None, return_mb_loss: bool = False,
                 broadcast_and_average_loss: bool = False, use_zero1_optimizer: bool = False,
                 use_model_wrapper: bool = False, use_optimizer_wrapper: bool = False, pipeline_cuts=None,
                 input_names=None, leaf_module_cls=None, autowrap_functions=None, autowrap_modules=None,
                 autowrap_obj_methods=None, tracer_cls=None, param_init_fn=None, trace_file_path=None,
                 return_loss_on_cpu: bool = True, deallocate_pipeline_outputs: bool = False,
                 auto_partition: bool = False, fuse_microbatches: bool = False, manual_pp_partition: bool = False,
                 manual_pp_stage_partition_fn=None, manual_pp_loss_fn=None, **private):
        super().__init__()
        options = dict(locals())
        _check_options(options, private)
        if not state.model_parallel_is_initialized():
            raise PipelineError(
                "Model parallelism needs to be initialized before applying NxDPPModel: call "
                "neuronx_distributed.parallel_layers.initialize_model_parallel(tensor_model_parallel_size, "
                "pipeline_model_parallel_size) after torch.distributed.init_process_group")
        self.original_torch_module = module
        for name in ("transformer_layer_cls", "num_microbatches", "virtual_pipeline_size", "output_loss_value_spec",
                     "return_mb_loss", "broadcast_and_average_loss", "use_zero1_optimizer", "use_model_wrapper",
                     "use_optimizer_wrapper", "leaf_module_cls", "autowrap_functions", "autowrap_modules",
                     "autowrap_obj_methods", "tracer_cls", "param_init_fn", "return_loss_on_cpu",
                     "deallocate_pipeline_outputs", "fuse_microbatches"):
            object.__setattr__(self, name, options[name])
        self._mark_before = private.get("_mark_step_before_pp_runtime", True)
        self._mark_after = private.get("_mark_step_after_pp_runtime", True)
        self.pipeline_parallel_size = state.get_pipeline_model_parallel_size()
        self.pipeline_parallel_rank = state.get_pipeline_model_parallel_rank()
        self.traced_model = None
        self.pipeline_cuts: list = []
        self.partitioned = False
        self.model_moved_to_device = False
        self.input_names = None
        self.partitions: list = []
        self.local_stage_modules: list = []
        self._shared_groups: list = []
        self._device = torch.device("cpu")
        if auto_partition and self.pipeline_parallel_size > 1:
            layers = model_layers(module, transformer_layer_cls)
            if not layers:
                raise PipelineError(f"auto_partition: no modules of type {transformer_layer_cls} in the model")
            pipeline_cuts = auto_cuts(self.pipeline_parallel_size * virtual_pipeline_size, layers)
        if pipeline_cuts and not private.get("_delay_tracing", False):
            if input_names is None:
                raise PipelineError("input_names are required to trace the model when pipeline_cuts or "
                                    "auto_partition are given (the names of run_train's keyword arguments)")
            self.trace(input_names=input_names)
            for cut in pipeline_cuts:
                self.cut_pipeline_stage(cut)
            self.partition()

    def __getattr__(self, name):
        """Attributes the wrapper lacks come from the wrapped module (``.config``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "original_torch_module":
                raise
            return getattr(self.original_torch_module, name)

    # -- building the pipeline ------------------------------------------------------------
    def trace(self, args=None, kwargs=None, input_names=None, leaf_modules=None, autowrap_functions=None,
              autowrap_modules=None, autowrap_obj_methods=None, tracer_cls=None):
        """Trace the wrapped module into one fx graph (``input_names``: the traced inputs;
        without them, the names of ``kwargs`` and the forward parameters ``args`` fill)."""
        if self.traced_model is not None:
            warnings.warn("NxDPPModel.trace() is called while the model is already traced; skipping")
            return
        if input_names is None:
            import inspect
            params = list(inspect.signature(self.original_torch_module.forward).parameters)
            input_names = params[:len(args or ())] + list(kwargs or {})
        self.input_names = list(input_names)
        leaves = [*self._as_list(leaf_modules if leaf_modules is not None else self.leaf_module_cls),
                  *self._as_list(self.transformer_layer_cls)]
        self.traced_model = trace_model(
            self.original_torch_module, self.input_names, leaves,
            tracer_cls=tracer_cls if tracer_cls is not None else self.tracer_cls,
            autowrap_functions=autowrap_functions if autowrap_functions is not None else self.autowrap_functions,
            autowrap_modules=autowrap_modules if autowrap_modules is not None else self.autowrap_modules,
            autowrap_obj_methods=autowrap_obj_methods if autowrap_obj_methods is not None
            else self.autowrap_obj_methods)

    @staticmethod
    def _as_list(value) -> list:
        if value is None:
            return []
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def cut_pipeline_stage(self, cut_point: str):
        """End a stage after the call of module ``cut_point`` (a qualified name)."""
        if self.traced_model is None:
            raise PipelineError("cut_pipeline_stage must be called after trace")
        if self.partitioned:
            raise PipelineError(f"cut_pipeline_stage({cut_point!r}) is called after the model is partitioned")
        if cut_point in self.pipeline_cuts:
            raise PipelineError(f"each cut point can be marked once, but {cut_point!r} is marked twice")
        if not any(n.op == "call_module" and n.target == cut_point for n in self.traced_model.graph.nodes):
            raise PipelineError(f"cut_point {cut_point!r} does not exist in the traced graph")
        self.pipeline_cuts.append(cut_point)

    def partition(self):
        """Cut the traced graph into stages and keep this rank's."""
        if self.partitioned:
            warnings.warn("NxDPPModel.partition() is called while the model is already partitioned; skipping")
            return
        if self.traced_model is None:
            raise PipelineError("NxDPPModel.trace() should be called before NxDPPModel.partition()")
        stages = len(self.pipeline_cuts) + 1
        if stages != self.pipeline_parallel_size * self.virtual_pipeline_size:
            raise PipelineError(f"{len(self.pipeline_cuts)} pipeline cuts make {stages} stages, but the pipeline "
                                f"parallel size is {self.pipeline_parallel_size}: pass {self.pipeline_parallel_size - 1} "
                                "cuts")
        self.partitions = cut_stages(self.traced_model, self.pipeline_cuts, self.input_names)
        self.local_stage_modules = [s.module for s in self.partitions
                                    if s.index % self.pipeline_parallel_size == self.pipeline_parallel_rank]
        self._stage = self.partitions[self.pipeline_parallel_rank]
        self._is_last_stage = self.pipeline_parallel_rank == self.pipeline_parallel_size - 1
        self.partitioned = True
        self._register_shared_weights()
        self._set_distributed()
        self.eval_scheduler = sched.InferenceSchedule(
            self.num_microbatches, self.pipeline_parallel_size, self.pipeline_parallel_rank)
        self.train_scheduler = sched.Train1F1BSchedule(
            self.num_microbatches, self.pipeline_parallel_size, self.pipeline_parallel_rank)
        local = {id(p) for p in self.local_parameters()}
        for param in self.original_torch_module.parameters():
            if id(param) not in local:           # gradients only for this rank's parameters
                param.requires_grad_(False)
                param.grad = None

    def _register_shared_weights(self):
        """Parameters used by stages on different pipeline ranks get a group of those ranks
        (kept by this rank's name for the parameter: moving to the device may replace it)."""
        owners: dict = {}
        for stage in self.partitions:
            rank = stage.index % self.pipeline_parallel_size
            for name, param in stage.module.named_parameters():
                names = owners.setdefault(id(param), {})
                names.setdefault(rank, name)
        for names in owners.values():
            if len(names) > 1:
                group = state.create_pg_with_ranks(sorted(names))
                if self.pipeline_parallel_rank in names:
                    first = self.pipeline_parallel_rank == min(names)
                    self._shared_groups.append((names[self.pipeline_parallel_rank], group, first))

    def shared_parameters(self):
        """(parameter, group) for each local weight shared with other pipeline ranks."""
        module = self.local_stage_modules[0]
        for name, group, _ in self._shared_groups:
            yield module.get_parameter(name), group

    def _set_distributed(self):
        pp = self.pipeline_parallel_size
        self._pp_group = state.get_pipeline_model_parallel_group() if pp > 1 else None
        self._pp_ranks = next(r for r in state.get_pipeline_model_parallel_group(as_list=True)
                              if state.global_rank() in r)
        self._dp_size = state.get_data_parallel_size()
        self._dp_group = state.get_data_parallel_group() if self._dp_size > 1 else None
        rank = self.pipeline_parallel_rank
        self._device = default_device()
        self._link = PeerLink(self._pp_group, self._pp_ranks[rank - 1] if rank > 0 else None,
                              self._pp_ranks[rank + 1] if rank < pp - 1 else None, self._device)

    def _validate_partitioned(self):
        if not self.partitioned:
            raise PipelineError("the model is not partitioned yet: pass pipeline_cuts (or auto_partition) and "
                                "input_names, or call trace/cut_pipeline_stage/partition, or run_train once")

    # -- device --------------------------------------------------------------------------
    def move_model_to_device(self):
        """Move this rank's stages to the device (materialising meta parameters first with
        ``param_init_fn``) and make weights shared with other ranks equal to the first's."""
        self._validate_partitioned()
        if self.model_moved_to_device:
            return
        for module in self.local_stage_modules:
            self._materialize(module)
            ties = {}
            for name, param in module.named_parameters(remove_duplicate=False):
                ties.setdefault(id(param), []).append(name)
            module.to(self._device)
            for names in ties.values():         # .to() may make a new Parameter per owner
                first = module.get_parameter(names[0])
                for name in names[1:]:
                    owner, _, leaf = name.rpartition(".")
                    setattr(module.get_submodule(owner), leaf, first)
        with torch.no_grad():
            for (param, group), (_, _, first) in zip(self.shared_parameters(), self._shared_groups):
                param.shared = not first         # NxD: counted once in the grad norm, by its first rank
                dist.broadcast(param.data, dist.get_global_rank(group, 0), group=group)
        self._mark_step()
        self.model_moved_to_device = True

    def _materialize(self, module):
        if any(p.is_meta for p in module.parameters()):
            module.to_empty(device="cpu")
            if self.param_init_fn is None:
                raise PipelineError("the model has parameters on the meta device: pass param_init_fn to "
                                    "initialise them")
        if self.param_init_fn is not None:
            for sub in module.modules():
                self.param_init_fn(sub)

    def _mark_step(self):
        """Run what the device recorded (lazy mode's step boundary); nothing on CPU or CUDA."""
        name = torch._C._get_privateuse1_backend_name()
        if self._device.type == name:
            getattr(torch, name).synchronize()

    # -- running -------------------------------------------------------------------------
    def _prepare(self, args, kwargs):
        if args:
            raise PipelineInputError("run_train/run_eval take keyword arguments only (the traced input_names)")
        if not self.partitioned:
            self._delayed_partition(kwargs)
        if set(kwargs) != set(self.input_names):
            raise PipelineInputError(
                f"train/eval inputs {sorted(kwargs)} must be the traced input names {sorted(self.input_names)} "
                f"(missing {sorted(set(self.input_names) - set(kwargs))}, "
                f"unexpected {sorted(set(kwargs) - set(self.input_names))})")
        self.move_model_to_device()

    def _delayed_partition(self, kwargs):
        cuts = []
        if self.pipeline_parallel_size > 1:
            cuts = auto_cuts(self.pipeline_parallel_size * self.virtual_pipeline_size,
                             model_layers(self.original_torch_module, self.transformer_layer_cls))
        self.trace(kwargs=kwargs)
        for cut in cuts:
            self.cut_pipeline_stage(cut)
        self.partition()

    def run_train(self, *args, **kwargs):
        """Forward and backward of one batch; the mean microbatch loss on the last pipeline rank."""
        self._prepare(args, kwargs)
        if self._mark_before:
            self._mark_step()
        for module in self.local_stage_modules:
            nn.Module.train(module, True)
        loss = self._execute(kwargs, training=True)
        if self._mark_after:
            self._mark_step()
        return loss

    def run_eval(self, *args, **kwargs):
        """Forward only (no gradients); the mean microbatch loss on the last pipeline rank."""
        self._prepare(args, kwargs)
        for module in self.local_stage_modules:
            nn.Module.train(module, False)
        with torch.no_grad():
            loss = self._execute(kwargs, training=False)
        if self._mark_after:
            self._mark_step()
        return loss

    def forward(self, *args, **kwargs):
        raise PipelineError("model.forward() is not supported in pipeline mode: use model.run_train() and "
                            "model.run_eval()")

    def train(self, mode: bool = True):
        raise PipelineError("model.train() is not supported in pipeline mode: run_train() and run_eval() "
                            "set the stages' mode")

    def state_dict(self, *args, **kwargs):
        raise PipelineError("model.state_dict() is not supported in pipeline mode: use model.local_state_dict()")

    # -- the whole model's and this rank's parameters ----------------------------------------
    def named_parameters(self, *args, **kwargs):
        return self.original_torch_module.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        return self.original_torch_module.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.original_torch_module.named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        return self.original_torch_module.buffers(*args, **kwargs)

    def local_named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        self._validate_partitioned()
        for module in self.local_stage_modules:
            yield from module.named_modules(memo=memo, prefix=prefix, remove_duplicate=remove_duplicate)

    def local_modules(self):
        for _, module in self.local_named_modules():
            yield module

    def local_named_children(self):
        self._validate_partitioned()
        for module in self.local_stage_modules:
            yield from module.named_children()

    def local_children(self):
        for _, child in self.local_named_children():
            yield child

    def local_named_parameters(self, recurse: bool = True):
        """This rank's parameters under their names in the original model."""
        self._validate_partitioned()
        seen = set()
        for module in self.local_stage_modules:
            for name, param in module.named_parameters(recurse=recurse):
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def local_parameters(self, recurse: bool = True):
        for _, param in self.local_named_parameters(recurse=recurse):
            yield param

    def local_named_buffers(self, prefix: str = "", recurse: bool = True):
        self._validate_partitioned()
        originals = set(self._original_keys())
        for module in self.local_stage_modules:
            for name, buf in module.named_buffers(prefix=prefix, recurse=recurse):
                if name[len(prefix):] in originals:
                    yield name, buf

    def local_buffers(self, recurse: bool = True):
        for _, buf in self.local_named_buffers(recurse=recurse):
            yield buf

    def _original_keys(self):
        return self.original_torch_module.state_dict(keep_vars=True).keys()

    def local_state_dict(self, *args, **kwargs):
        """This rank's part of the original model's state_dict, under the original names."""
        self._validate_partitioned()
        prefix = kwargs.get("prefix", "")
        originals = set(self._original_keys())
        out = {}
        for module in self.local_stage_modules:
            for name, value in module.state_dict(*args, **kwargs).items():
                if name[len(prefix):] in originals:
                    out[name] = value
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load this rank's entries of ``state_dict`` (original names; others are skipped)."""
        self._validate_partitioned()
        missing, unexpected = [], []
        for module in self.local_stage_modules:
            own = set(module.state_dict().keys()) & set(self._original_keys())
            part = {k: v for k, v in state_dict.items() if k in own}
            missing.extend(sorted(own - set(part)))
            result = module.load_state_dict(part, strict=False)
            unexpected.extend(result.unexpected_keys)
        if strict and missing:
            raise PipelineError(f"load_state_dict: this pipeline rank's parameters {missing} are missing from "
                                "the state dict")
        return nn.modules.module._IncompatibleKeys(missing, unexpected)
