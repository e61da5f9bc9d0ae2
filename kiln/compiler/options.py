"""Compile and runtime options, and the Neuron-style compiler flag parser.

Flags are parsed strictly: a flag kiln does not know, or knows but does not
implement yet, is an error that names it. Silently ignoring ``--auto-cast``
would hand a user fp32 numbers they believe are bf16.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field

from kiln.errors import CompilerArgsError


@dataclass(frozen=True)
class CompileOptions:
    """What to compile and how; parsed once per trace and never changed afterwards (a phase
    that resolves a setting returns a new instance with ``dataclasses.replace``)."""
    engine: str | None = None         # None: default rules (-O1/-O2) or measurement (-O3)
    optlevel: int = 2                 # 1: fastest compile, 2: best engine rules, 3: most optimisation
    target: str = "native"            # native: this CPU's ISA; generic: portable baseline
    device: str = "auto"              # cpu | cuda | auto: cuda when torch sees a GPU and the engine runs there
    auto_cast: str = "none"
    auto_cast_type: str = "bf16"
    fallback: bool = True             # unsupported ops run on the host
    min_partition_size: int = 1       # smaller device partitions run on the host
    ops_on_host: frozenset = field(default_factory=frozenset)
    validate: bool = True
    atol: float = 1e-3
    rtol: float = 1e-3
    quantize: str | None = None       # "int8" or "int4"
    quantize_mode: str = "dynamic"    # dynamic: int8 weights, activations per call; static: calibrated
                                      # activations too; weight_only: int8 per channel / int4 in groups
    min_cosine: float = 0.99          # accuracy gate for quantized / auto-cast models
    min_top1: float = 0.99            # top-1 agreement gate, for classifier-shaped outputs
    pipeline_cores: int = 1           # split the graph into this many stages, one per kiln core
    compile_budget: float | None = None   # seconds per graph for measuring builds; None: the level's default
    whole_graph: bool | str = False   # when the first engine would leave ops on the host, compile the whole
                                      # graph on an engine that takes every op (Inductor), if it is installed;
                                      # "later": where the partitions are few, build them now and name that
                                      # engine in the manifest (``whole_graph_later``), for a caller that
                                      # builds the whole graph afterwards; else as True
    engine_by: str = "user"           # who set ``engine``: the user, or the phase that chose it
                                      # ("whole_graph", "auto_cast"); only the user's choice is final:
                                      # another is held to eager's speed at -O2 (kiln's device asks
                                      # for Inductor this way where eager's kernels beat ONNX Runtime)

    def to_dict(self):
        d = asdict(self)
        d["ops_on_host"] = sorted(self.ops_on_host)
        return d


ENGINE_BY = ("user", "whole_graph", "auto_cast")

# The compile budget when none is given, per level (seconds per graph): once it is spent,
# -O2 shortens its timing against eager to a floor (it never skips it); -O3 skips the
# candidates it cannot afford (ISSUE 16's targets for
# BERT-base on 2 cores: -O2 <= 20 s, -O3 <= 60 s). -O1 measures nothing.
DEFAULT_BUDGET = {1: 0.0, 2: 20.0, 3: 60.0}

_OPTLEVELS = {"1": 1, "2": 2, "3": 3}
_AUTO_CAST = ("none", "matmult", "all")
_AUTO_CAST_TYPES = ("bf16", "fp16", "fp32", "tf32", "fp8_e4m3")
_TARGETS = ("native", "generic")
DEVICES = ("auto", "cpu", "cuda")
_NEURON_TARGETS = ("inf1", "inf2", "trn1", "trn2", "trn1n")
_NOT_YET = {
    "--model-type": "model-type specific optimisation is not implemented yet",
    "--enable-fast-loading-neuron-binaries": "not applicable: kiln artifacts always load fast",
}


def parse_compiler_args(args) -> dict:
    """Parse Neuron-style compiler flags into CompileOptions fields."""
    if args is None:
        return {}
    tokens = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    out: dict = {}
    i = 0

    def value(flag):
        nonlocal i
        if "=" in tokens[i]:
            return tokens[i].split("=", 1)[1]
        if i + 1 >= len(tokens):
            raise CompilerArgsError(f"compiler flag {flag} needs a value")
        i += 1
        return tokens[i]

    while i < len(tokens):
        tok = tokens[i]
        flag = tok.split("=", 1)[0]
        if flag in ("-O1", "-O2", "-O3"):
            out["optlevel"] = int(flag[2])
        elif flag in ("--optlevel", "-O"):
            v = value(flag)
            if v not in _OPTLEVELS:
                raise CompilerArgsError(f"{flag} {v}: expected 1, 2 or 3")
            out["optlevel"] = _OPTLEVELS[v]
        elif flag == "--auto-cast":
            v = value(flag)
            if v not in _AUTO_CAST:
                raise CompilerArgsError(f"--auto-cast {v}: expected one of {', '.join(_AUTO_CAST)}")
            out["auto_cast"] = v
        elif flag == "--auto-cast-type":
            v = value(flag)
            if v not in _AUTO_CAST_TYPES:
                raise CompilerArgsError(f"--auto-cast-type {v}: expected one of {', '.join(_AUTO_CAST_TYPES)}")
            out["auto_cast_type"] = v
        elif flag == "--target":
            v = value(flag)
            if v in _NEURON_TARGETS:
                raise CompilerArgsError(
                    f"--target {v} names a Neuron chip; kiln compiles for this host's CPU: "
                    "use --target native (this CPU's features) or --target generic (portable)")
            if v not in _TARGETS:
                raise CompilerArgsError(f"--target {v}: expected native or generic")
            out["target"] = v
        elif flag == "--neuroncore-pipeline-cores":
            v = value(flag)
            if not v.isdigit() or int(v) < 1:
                raise CompilerArgsError(f"{flag} {v}: expected a number of cores, at least 1")
            out["pipeline_cores"] = int(v)
        elif flag == "--compile-budget":
            out["compile_budget"] = _seconds(flag, value(flag))
        elif flag in _NOT_YET:
            raise CompilerArgsError(f"compiler flag {flag} is not supported yet: {_NOT_YET[flag]}")
        else:
            raise CompilerArgsError(
                f"unknown compiler flag {tok!r}; kiln understands -O1/-O2/-O3, --optlevel, "
                "--auto-cast, --auto-cast-type, --target, --neuroncore-pipeline-cores and --compile-budget")
        i += 1
    if "auto_cast_type" in out and "auto_cast" not in out:
        # a type named alone casts the matmuls, as neuronx-cc's default --auto-cast matmult does
        # (it computed in fp32 here, without a word; kiln's default with neither flag stays none)
        out["auto_cast"] = "matmult"
    return out


def _seconds(flag, text) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise CompilerArgsError(f"{flag} {text}: expected a number of seconds above 0")
    return v


def budget_seconds(opts: CompileOptions) -> float:
    """The compile budget in seconds: ``compile_budget``, or the level's default."""
    if opts.compile_budget is not None:
        return float(opts.compile_budget)
    return DEFAULT_BUDGET.get(opts.optlevel, DEFAULT_BUDGET[3])


def check_supported(opts: CompileOptions):
    """Reject option values that parse but are not implemented yet."""
    if opts.optlevel not in (1, 2, 3):
        raise CompilerArgsError(f"optlevel={opts.optlevel!r}: expected 1, 2 or 3 (-O1, -O2, -O3)")
    if opts.auto_cast != "none" and opts.auto_cast_type not in ("bf16", "fp16", "fp32", "tf32"):
        raise CompilerArgsError(
            f"--auto-cast-type {opts.auto_cast_type} is not supported on CPUs or by kiln's GPU engine: "
            "use bf16, fp16 or fp32 (tf32 on NVIDIA GPUs)")
    check_device_precision(opts)
    if opts.quantize not in (None, "int8", "int4"):
        raise CompilerArgsError(f"quantize={opts.quantize!r}: kiln supports quantize='int8' or 'int4'")
    if opts.quantize_mode not in ("dynamic", "static", "weight_only"):
        raise CompilerArgsError(f"quantize_mode={opts.quantize_mode!r}: expected 'dynamic', 'static' "
                                "or 'weight_only'")
    if opts.quantize == "int4" and opts.quantize_mode != "weight_only":
        raise CompilerArgsError("quantize='int4' is weight-only (int4 weights in groups of 32, "
                                "activations in float): use quantize_mode='weight_only'")
    if opts.device not in DEVICES:
        raise CompilerArgsError(f"device={opts.device!r}: expected one of {', '.join(DEVICES)}")
    if opts.whole_graph not in (True, False, "later"):
        raise CompilerArgsError(f"whole_graph={opts.whole_graph!r}: expected True, False or 'later'")
    if opts.engine_by not in ENGINE_BY:
        raise CompilerArgsError(f"engine_by={opts.engine_by!r}: expected one of {', '.join(ENGINE_BY)}")
    if opts.min_partition_size < 1:
        raise CompilerArgsError("min_partition_size must be at least 1")
    if opts.compile_budget is not None:
        _seconds("compile_budget=", opts.compile_budget)


def asks_tf32(opts: CompileOptions) -> bool:
    """``--auto-cast matmult|all --auto-cast-type tf32``: fp32 matmuls and convolutions may
    compute in TF32 (NVIDIA tensor cores; ``all`` is the same, no other op has a TF32 form)."""
    return opts.auto_cast != "none" and opts.auto_cast_type == "tf32"


def lossy(opts: CompileOptions) -> bool:
    """Whether the compile is meant to change answers (int8, --auto-cast to bf16/fp16): held
    to the accuracy gate, not to eager's answers. TF32 is held to eager at its precision."""
    return bool(opts.quantize) or (opts.auto_cast != "none" and opts.auto_cast_type != "tf32")


def tf32_ops(opts: CompileOptions) -> dict | None:
    """The ops a compile lets compute in TF32 (``kiln.host.tf32``'s kinds): all with
    --auto-cast-type tf32, else None: what torch's flags allow on the GPU (convolutions,
    by torch's default)."""
    return {"conv": True, "matmul": True} if asks_tf32(opts) else None


def check_device_precision(opts: CompileOptions):
    """TF32 exists on NVIDIA GPUs only: asked for on a CPU it is an error, never a silent
    fp32 compile (checked again once ``device="auto"`` is settled)."""
    if asks_tf32(opts) and opts.device == "cpu":
        raise CompilerArgsError(
            "--auto-cast-type tf32 is not supported on CPUs: TF32 is the fp32 format of NVIDIA "
            "tensor cores (Ampere on), which CPUs do not compute; use bf16, fp16 or fp32 on a CPU, "
            "or device='cuda'")
