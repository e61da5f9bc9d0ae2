"""What a quantized build quantized, over its partitions: the manifest's ``quantized``, and a
note for weighted products a build asked to quantize left in float.

Each partition's engine counts the products in the graph it built
(:meth:`kiln.engines.base.Engine.quantized_products`). A build asked for int8 or int4 that
quantized nothing passes the accuracy gate (float is accurate) and runs at float's speed:
without the count it was seen only as slow (an emulated-bf16 int4 build, 12-02), and a
CNN compiled with ``quantize="int4"`` came back in float with nothing but ONNX Runtime's
log lines (weight-only kernels have no convolution)."""
from __future__ import annotations


def summary(partitions: list) -> dict | None:
    """The partitions' counts summed (``quantized``, ``float``, ``ops``, ``float_ops``), or
    None where no partition's engine says."""
    said = [p["quantized"] for p in partitions if p.get("quantized")]
    if not said:
        return None
    total = {"quantized": sum(q["quantized"] for q in said), "float": sum(q["float"] for q in said)}
    for key in ("ops", "float_ops", "blocks"):
        merged: dict = {}
        for q in said:
            for k, v in q.get(key, {}).items():
                merged[k] = merged.get(k, 0) + v
        if merged or key != "blocks":
            total[key] = dict(sorted(merged.items()))
    return total


def describe(products: dict | None) -> str | None:
    """One line for a report: ``"211 of 211 weighted products (MatMulNBits 211)"``."""
    if not products:
        return None
    total = products["quantized"] + products["float"]
    kinds = ", ".join(f"{k} {v}" for k, v in products.get("ops", {}).items())
    left = ", ".join(f"{k} {v}" for k, v in products.get("float_ops", {}).items())
    blocks = ", ".join(f"{k} {v}" for k, v in products.get("blocks", {}).items())
    return (f"{products['quantized']} of {total} weighted products" + (f" ({kinds})" if kinds else "")
            + (f"; GGUF block types: {blocks}" if blocks else "") + (f"; in float: {left}" if left else ""))


def label(products: dict | None, quantize) -> str:
    """What a build's products were quantized as, for a report: ``quantize`` (its compile
    option), or ``"gguf"`` where every quantized product is on a GGUF file's own blocks (such a
    build's option reads int8: its quantizer's, for the weights the file does not hold)."""
    blocks = sum((products or {}).get("blocks", {}).values())
    return "gguf" if blocks and blocks == products["quantized"] else str(quantize)


def notes(total: dict | None, quantize: str, mode: str) -> list:
    """Notes on what a build asked for ``quantize`` (``mode``) left in float: convolutions
    under a weight-only mode, and a build that quantized nothing at all."""
    if total is not None and not total["float"] and not total["quantized"]:
        # until 12-03 such a build said nothing: "0 of 0" in kiln inspect (found by probing)
        return [f"quantize={quantize!r} found no weighted product it quantizes (matrix products and "
                "convolutions with a constant float32 weight; ConvTranspose and other layers are not among them, "
                "nor layers in float16 or bfloat16): this build computes in float, no faster than an "
                "unquantized one"]
    if total is None:
        return [f"quantize={quantize!r} quantized nothing: no part of the model was compiled by an engine that "
                "quantizes (it runs on the host, or on engines without quantization)"]
    if not total["float"]:
        return []
    out = []
    convolutions = total.get("float_ops", {}).get("Conv", 0)
    if convolutions and mode == "weight_only":
        out.append(f"{convolutions} convolution(s) left in float: weight-only quantization (quantize='int4', "
                   "or quantize_mode='weight_only') has kernels for matrix products only; quantize='int8' "
                   "(dynamic) quantizes convolutions")
    if not total["quantized"]:
        out.append(f"quantize={quantize!r} quantized none of the {total['float']} weighted products (matrix "
                   "products and convolutions with a constant weight): this build computes in float, no faster "
                   "than an unquantized one (kiln inspect shows each partition's count)")
    return out


def check_float32_weights(captured, opts) -> None:
    """A quantized build takes float32 weights: a model in float16 or bfloat16 was refused by an
    engine's type error ("Type parameter (T1) of Optype (MatMulNBits) bound to different types"),
    blamed on an engine the user never chose, or compiled unquantized on the host without a word
    (until 12-03, found by probing)."""
    if not opts.quantize:
        return
    import torch
    narrow = sorted({str(t.dtype).replace("torch.", "") for t in captured.graph_module.state_dict().values()
                     if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32})
    if narrow:
        from kiln.errors import CompilerArgsError
        raise CompilerArgsError(f"quantize={opts.quantize!r} quantizes float32 weights, and {captured.model_name}'s "
                                f"are {', '.join(narrow)}: trace model.float() to quantize it, or compile it in its "
                                "own precision without quantize=")
