"""Optimum Neuron's export keywords, mapped onto ``kiln.trace`` options, and the ``neuron``
section of the saved ``config.json``.

Every keyword of Optimum's ``NeuronTracedModel._export`` is accepted. Those with a kiln meaning
are applied (``optlevel``, ``auto_cast``, ``auto_cast_type``, ``disable_fallback``,
``disable_neuron_cache``, ``dynamic_batch_size``, the static shapes); those that only make sense
on a Neuron device (``compiler_workdir``, ``instance_type``, ``inline_weights_to_neff``,
``disable_fast_relayout``) are accepted with a logged note saying what kiln does instead;
those kiln cannot honour (``tensor_parallel_size > 1``, ``output_attentions=True``, a
reduced ``torch_dtype``) are a ``CompilerArgsError``; anything else is an error naming it.
Nothing is silently ignored.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kiln._version import __version__
from kiln.errors import CompilerArgsError

log = logging.getLogger("kiln.optimum")

# Optimum's InputShapesArguments; the ones a text task here reads are in TEXT_SHAPES
SHAPES = ("batch_size", "text_batch_size", "image_batch_size", "sequence_length", "num_choices", "width",
          "height", "image_size", "num_images_per_prompt", "patch_size", "num_channels", "feature_size",
          "nb_max_frames", "audio_sequence_length", "visual_seq_length", "point_batch_size",
          "nb_points_per_image", "num_beams", "vae_scale_factor", "encoder_hidden_size", "rotary_axes_dim")

NOTES = {
    "compiler_workdir": "kiln keeps no compiler work directory; the build is in model.kiln",
    "instance_type": "kiln compiles for this machine's CPU (or GPU), not for an Inferentia/Trainium instance",
    "inline_weights_to_neff": "the weights are always inside model.kiln",
    "disable_fast_relayout": "kiln has no relayout pass to disable",
}


@dataclass
class ExportOptions:
    shapes: dict
    trace: dict = field(default_factory=dict)     # kiln.trace keywords
    dynamic_batch_size: bool = False
    cast: dict = field(default_factory=dict)      # auto_cast, auto_cast_type when asked
    neuron: dict = field(default_factory=dict)    # what config.json's "neuron" section records


def parse(task: str, needed: tuple, kwargs: dict) -> ExportOptions:
    """``kwargs``: ``from_pretrained(export=True, ...)``'s keywords after the loading ones."""
    kwargs = dict(kwargs)
    shapes = {k: v for k, v in ((k, kwargs.pop(k, None)) for k in SHAPES) if v is not None}
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise CompilerArgsError(f"exporting a {task} model needs the static input shapes {', '.join(needed)}: "
                                f"pass {', '.join(f'{k}=...' for k in missing)} (e.g. batch_size=1, "
                                "sequence_length=128)")
    for k in shapes:
        if k not in needed:
            raise CompilerArgsError(f"{k}={shapes[k]!r} is not an input shape of a {task} model "
                                    f"(its shapes: {', '.join(needed)})")
        if not isinstance(shapes[k], int) or shapes[k] < 1:
            raise CompilerArgsError(f"{k} must be a positive integer; got {shapes[k]!r}")
    out = ExportOptions(shapes=shapes)
    _compiler(kwargs, out)
    want_task = kwargs.pop("task", None)
    if want_task not in (None, task):
        raise CompilerArgsError(f"task={want_task!r} does not match this class's task {task!r}: use the "
                                "NeuronModelFor... class of that task")
    for name, why in NOTES.items():     # any value given, False too (inline_weights_to_neff defaults to True)
        if kwargs.pop(name, None) is not None:
            log.warning("kiln.optimum: %s is accepted and has no effect: %s", name, why)
    if kwargs:
        raise CompilerArgsError(f"unknown export argument(s) {', '.join(sorted(kwargs))}; kiln takes Optimum "
                                f"Neuron's names: the shapes ({', '.join(SHAPES[:5])}, ...), auto_cast, "
                                "auto_cast_type, optlevel, dynamic_batch_size, disable_fallback, "
                                "disable_neuron_cache, ...")
    out.neuron = neuron_section(task, out)
    return out


def _compiler(kwargs: dict, out: ExportOptions) -> None:
    optlevel = str(kwargs.pop("optlevel", "2"))
    if optlevel not in ("1", "2", "3"):
        raise CompilerArgsError(f"optlevel must be '1', '2' or '3'; got {optlevel!r}")
    out.trace["optlevel"] = int(optlevel)
    auto_cast = kwargs.pop("auto_cast", None)
    cast_type = kwargs.pop("auto_cast_type", None)
    if auto_cast not in (None, "none", "matmul", "all"):
        raise CompilerArgsError(f"auto_cast must be None, 'matmul' or 'all'; got {auto_cast!r}")
    if auto_cast not in (None, "none"):
        out.cast = {"auto_cast": auto_cast, "auto_cast_type": cast_type or "bf16"}
        # torch-neuronx's flag spells Optimum's "matmul" as "matmult"
        out.trace["compiler_args"] = ["--auto-cast", {"matmul": "matmult"}.get(auto_cast, auto_cast),
                                      "--auto-cast-type", out.cast["auto_cast_type"]]
    out.dynamic_batch_size = bool(kwargs.pop("dynamic_batch_size", False))
    if kwargs.pop("disable_fallback", False):
        out.trace["fallback"] = False
    if kwargs.pop("disable_neuron_cache", False):
        out.trace["cache"] = False
    tp = kwargs.pop("tensor_parallel_size", 1) or 1
    if tp != 1:
        raise CompilerArgsError(f"tensor_parallel_size={tp}: kiln compiles encoder models whole; spread "
                                "requests over cores with kiln's data parallelism (kiln serve --replicas) instead")
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(name, False):
            raise CompilerArgsError(f"{name}=True is not supported by kiln's exported models yet; export "
                                    "without it")
    dtype = kwargs.pop("torch_dtype", None)
    if dtype is not None and str(dtype).replace("torch.", "") not in ("float32", "fp32"):
        raise CompilerArgsError(f"torch_dtype={dtype}: kiln exports from float32 weights; ask for reduced "
                                "precision with auto_cast='matmul', auto_cast_type='bf16'")


def neuron_section(task: str, opts: ExportOptions) -> dict:
    """config.json's ``neuron`` dict, with Optimum Neuron's keys (``compiler_type`` says kiln)."""
    section = {"compiler_type": "kiln", "compiler_version": __version__, "inline_weights_to_neff": True,
               "dynamic_batch_size": opts.dynamic_batch_size, "tensor_parallel_size": 1,
               "optlevel": str(opts.trace["optlevel"]), "auto_cast": opts.cast.get("auto_cast"),
               "auto_cast_type": opts.cast.get("auto_cast_type"), "instance_type": None,
               "int_dtype": "int64", "float_dtype": "fp32", "output_attentions": False,
               "output_hidden_states": False, "task": task}
    section.update({f"static_{k}": v for k, v in opts.shapes.items()})
    return section


def static_shapes(section: dict) -> dict:
    """The shapes a saved model was compiled for, from its ``neuron`` section."""
    return {k[len("static_"):]: v for k, v in section.items() if k.startswith("static_")}
