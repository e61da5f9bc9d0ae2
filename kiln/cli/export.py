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
    for name in NEURON_ONLY:
        p.add_argument(*_both(name), default=None)
    for name in SHAPES:
        p.add_argument(*_both(name), type=int, default=None, dest=name)
    for level in ("1", "2", "3"):
        p.add_argument(f"-O{level}", dest="optlevel", action="store_const", const=level)
    p.set_defaults(fn=run, optlevel="2")


def run(args, console) -> int:
    from kiln.optimum.neuron import exporter
    kwargs = {k: getattr(args, k) for k in SHAPES if getattr(args, k) is not None}
    kwargs["optlevel"] = args.optlevel
    for k in ("auto_cast", "auto_cast_type", "torch_dtype", "tensor_parallel_size", *NEURON_ONLY[:2]):
        if getattr(args, k) is not None:
            kwargs[k] = getattr(args, k)
    for k in ("dynamic_batch_size", "disable_neuron_cache"):
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
