"""Optimum Neuron's ``NeuronTrainer`` and ``NeuronTrainingArguments`` on kiln's device:
Hugging Face's ``Trainer`` training on the device in lazy mode (torch-neuronx's), so a
fine-tuning script written for Trainium runs with its import swapped.

What it takes beside ``Trainer``, and why:

* **The device.** ``args.device`` is kiln's device in lazy mode (``xm.xla_device()``'s,
  compiling with ``NEURON_CC_FLAGS``' options: ``--auto-cast``, ``-O``, ``--cache_dir``): the
  Trainer moves the model and every batch there. accelerate, which the Trainer builds on,
  knows no PrivateUse1 device and keeps its own on the CPU; its placement is switched off
  (``device_placement=False``), or it would move the model back to the CPU at ``train()``.
* **Step boundaries.** ``mark_step()`` after every micro-batch and every optimizer step
  (a callback), as torch_xla's ``MpDeviceLoader`` and Optimum's trainer do: each is then one
  compiled program, the same every step.
* **bf16.** ``bf16=True`` trains under ``torch.autocast`` on kiln's device, as Optimum's
  does on Neuron's. accelerate's own autocast is for its device, the CPU, so it would reach
  no kiln tensor and the script would train in float32 without a word. ``fp16=True`` is
  refused as the Trainer refuses it on a CPU.
* **Saving.** Weights go to ``save_pretrained`` as CPU tensors (safetensors reads a
  tensor's storage, which a device tensor does not have in host terms).
* **Neuron's parallelism options** (``tensor_parallel_size``, ``pipeline_parallel_size``,
  ``zero_1``) are accepted at their defaults; other values are an error naming what to use
  (kiln's NxD API, :mod:`kiln.neuronx_distributed`), not a silently single-core run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import transformers

from kiln.errors import CompilerArgsError


def _device() -> torch.device:
    """kiln's device in lazy mode, compiling with ``NEURON_CC_FLAGS``' options as
    ``xm.xla_device()``'s does (:mod:`kiln.compiler.neuron_env`)."""
    from kiln.compiler import neuron_env
    from kiln.device import modes
    if modes.mode() != "lazy" or not _configured:
        modes.set_mode("lazy", **neuron_env.device_options(stacklevel=3))
        _configured.append(True)
    return modes.device()


_configured: list = []


def _mark_step():
    from kiln.device import modes
    modes.mark_step()


@dataclass
class NeuronTrainingArguments(transformers.TrainingArguments):
    """``TrainingArguments`` whose device is kiln's (see the module doc)."""

    tensor_parallel_size: int = field(default=1, metadata={"help": "Neuron: tensor-parallel degree (1 on kiln)"})
    pipeline_parallel_size: int = field(default=1, metadata={"help": "Neuron: pipeline stages (1 on kiln)"})
    zero_1: bool = field(default=False, metadata={"help": "Neuron: ZeRO-1 optimizer sharding (off on kiln)"})

    def __post_init__(self):
        defaults = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "zero_1": False}
        asked = {k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v or
                 type(getattr(self, k)) is not type(v)}
        if asked:
            raise CompilerArgsError(
                f"NeuronTrainingArguments({', '.join(f'{k}={v!r}' for k, v in asked.items())}): kiln's NeuronTrainer "
                "trains on one device per process; for tensor/pipeline parallelism and ZeRO-1 use kiln's NxD API "
                "(kiln.neuronx_distributed: neuronx_distributed_config, initialize_parallel_model) under torchrun")
        if self.fp16:
            raise CompilerArgsError("NeuronTrainingArguments(fp16=True): kiln's device trains in float32 or, with "
                                    "bf16=True, under bf16 autocast, as Neuron does; use bf16=True")
        self.use_cpu = True             # accelerate's own device (see the module doc)
        super().__post_init__()

    @property
    def device(self) -> torch.device:
        self._setup_devices             # the Trainer's process state, which other properties read
        return _device()

    @property
    def n_gpu(self) -> int:
        return 0


class _MarkStep(transformers.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        _mark_step()

    def on_step_end(self, args, state, control, **kwargs):
        _mark_step()


class NeuronTrainer(transformers.Trainer):
    """``transformers.Trainer`` on kiln's device; ``args`` must be
    :class:`NeuronTrainingArguments` (see the module doc)."""

    def __init__(self, model=None, args=None, *rest, **kwargs):
        if args is None:
            args = NeuronTrainingArguments(output_dir="trainer_output")
        if not isinstance(args, NeuronTrainingArguments):
            raise TypeError(f"NeuronTrainer needs NeuronTrainingArguments, got {type(args).__name__}: with plain "
                            "TrainingArguments the model would train on the CPU")
        super().__init__(model, args, *rest, **kwargs)
        self.add_callback(_MarkStep())

    def _build_accelerator_args(self, **kwargs):
        out = super()._build_accelerator_args(**kwargs)
        out["device_placement"] = False
        return out

    def autocast_smart_context_manager(self, cache_enabled=True):
        if self.args.bf16:
            return torch.autocast(self.args.device.type, dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return contextlib.nullcontext()

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None:
            state_dict = self.model.state_dict()
        state_dict = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}
        return super()._save(output_dir, state_dict=state_dict)
