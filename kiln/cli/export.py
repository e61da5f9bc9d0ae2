"""``kiln export``: ``optimum-cli export neuron``'s command on kiln (kiln.optimum.neuron.exporter).

Its flags keep Optimum's names, which mix underscores and hyphens; each is taken in both
spellings (``--batch_size`` and ``--batch-size``).
"""
from __future__ import annotations

import json
import os

SHAPES = ("batch_size", "text_batch_size", "image_batch_size", "sequence_length", "num_beams", "num_choices",
          "num_channels", "width", "height", "image_size", "patch_size", "num_images_per_prompt",
          "audio_sequence_length", "decoder_sequence_length")
NEURON_ONLY = ("instance_type", "compiler_workdir", "subfolder", "cache_dir")
# Optimum's diffusion flags: taken, so that they get kiln's answer, not argparse's "unrecognized"
DIFFUSION = ("unet", "lora_model_ids", "lora_weight_names", "lora_adapter_names", "lora_scales", "controlnet_ids",
             "ip_adapter_id", "ip_adapter_subfolder", "ip_adapter_weight_name", "ip_adapter_scale")


def _both(name: str) -> list:
    return sorted({f"--{name}", f"--{name.replace('_', '-')}"})


def add_parser(sub):
    p = sub.add_parser("export", help="export a Hugging Face checkpoint directory (optimum-cli export neuron)")
    p.add_argument("-m", "--model", required=True, help="the checkpoint directory (nothing is downloaded)")
    p.add_argument("output", help="the directory to write (model.kiln, config.json, the tokenizer)")
    p.add_argument(*_both("task"), default="auto", help="default: from the checkpoint's architecture")
    p.add_argument("--atol", type=float, default=None, help="validation tolerance (default 1e-4; 1e-2 auto-cast)")
    p.add_argument(*_both("disable_validation"), action="store_true")
    p.add_argument(*_both("auto_cast"), choices=("none", "matmul", "all"), default=None)
    p.add_argument(*_both("auto_cast_type"), choices=("bf16", "fp16", "tf32", "fp32"), default=None)
    p.add_argument(*_both("torch_dtype"), default=None)
    p.add_argument(*_both("tensor_parallel_size"), *_both("num_cores"), type=int, default=None,
                   dest="tensor_parallel_size")
    p.add_argument(*_both("dynamic_batch_size"), action="store_true")
    p.add_argument(*_both("disable_neuron_cache"), action="store_true")
    p.add_argument(*_both("inline_weights_neff"), action="store_true", help="accepted: the weights are always inline")
    p.add_argument(*_both("trust_remote_code"), action="store_true", help="accepted: kiln runs no hub code")
    for name in ("output_hidden_states", "output_attentions"):
        p.add_argument(*_both(name), action="store_true", help="refused with the reason: not supported yet")
    for name in DIFFUSION:
        p.add_argument(*_both(name), default=None, help="refused: kiln exports no diffusion pipelines")
    for name in NEURON_ONLY:
        p.add_argument(*_both(name), default=None)
    for name in SHAPES:
        p.add_argument(*_both(name), type=int, default=None, dest=name)
    for level in ("1", "2", "3"):
        p.add_argument(f"-O{level}", dest="optlevel", action="store_const", const=level)
    p.set_defaults(fn=run, optlevel="2")


def run(args, console) -> int:
    from kiln.errors import CompilerArgsError
    from kiln.optimum.neuron import exporter
    diffusion = [f"--{k}" for k in DIFFUSION if getattr(args, k) is not None]
    if diffusion:
        raise CompilerArgsError(f"{', '.join(diffusion)}: these configure a diffusion pipeline (Stable Diffusion, "
                                "Flux, ...), which kiln export does not export; export its parts' checkpoints "
                                "one by one, or trace them with kiln.trace")
    kwargs = {k: getattr(args, k) for k in SHAPES if getattr(args, k) is not None}
    kwargs["optlevel"] = args.optlevel
    for k in ("auto_cast", "auto_cast_type", "torch_dtype", "tensor_parallel_size", *NEURON_ONLY[:2]):
        if getattr(args, k) is not None:
            kwargs[k] = getattr(args, k)
    for k in ("dynamic_batch_size", "disable_neuron_cache", "output_hidden_states", "output_attentions"):
        if getattr(args, k):
            kwargs[k] = True
    if kwargs.get("auto_cast") == "none":
        kwargs.pop("auto_cast")
    model = os.path.join(args.model, args.subfolder) if args.subfolder else args.model
    report = exporter.export(model, args.output, task=args.task, atol=args.atol,
                             validate=not args.disable_validation, **kwargs)
    hit = report.get("cache_hit")
    # plain lines (not rich's, which wraps): paths and numbers a script greps for
    print(f"{report['class']} ({report['task']}) written to {report['output']}"
          + (" (compile cache hit: nothing was recompiled)" if hit else ""))
    validation = report.get("validation")
    if validation and "max_abs_difference" in validation:
        worst = max(validation["max_abs_difference"].values())
        print(f"validated against the source model: max abs difference {worst:.3g} "
              f"(atol {validation['atol']:g}) {json.dumps(validation['max_abs_difference'])}")
    elif validation:
        print(f"validated: {validation['note']}")
    return 0
