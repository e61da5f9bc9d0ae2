"""``compile_llm(..., device="cuda")``: what an LLM compiled for an NVIDIA GPU may ask for.

Every graph goes through ``kiln.trace(device="cuda")`` as any model does (TorchInductor,
packaged by AOTInductor); the runtime side (KV cache on the GPU, decode replayed as CUDA
graphs) is :mod:`kiln.runtime.cuda_llm`. What is refused here, with the reason, rather than
half-done: weight quantization (kiln's int8/int4 and GGUF blocks are CPU kernels; on the
GPU the weights are float32, or the ``auto_cast`` types ``kiln.trace`` takes) and tensor
parallelism (its ranks are CPU processes on kiln cores).
"""
from __future__ import annotations

from kiln.errors import CompilerArgsError


def check_options(trace_options: dict, tp_degree: int) -> None:
    """Raise CompilerArgsError for what ``device="cuda"`` does not do (module doc)."""
    if trace_options.get("device") != "cuda":
        return
    if tp_degree != 1:
        raise CompilerArgsError(f"tp_degree={tp_degree} with device='cuda': tensor-parallel LLMs run on CPU "
                                "ranks only; compile for one GPU with tp_degree=1, or drop device='cuda'")
    quantize = trace_options.get("quantize")
    if quantize:
        raise CompilerArgsError(f"quantize={quantize!r} with device='cuda': kiln's quantized LLM weights "
                                "(int8, int4, GGUF blocks) run on CPU kernels only; on the GPU compile the "
                                "float weights (no quantize), or drop device='cuda'")
