"""transformers-neuronx's ``NeuronConfig`` and its parts, as kiln reads them.

A tutorial script builds ``NeuronConfig(quant=QuantizationConfig(quant_dtype="s8"),
continuous_batching=ContinuousBatchingConfig(max_num_seqs=8), on_device_generation=
GenerationConfig(top_k=1), fuse_qkv=True, group_query_attention=GQA.SHARD_OVER_HEADS)`` and
hands it to ``from_pretrained(..., neuron_config=)``. Each setting is one of three kinds:

* **applied**: int8 weights (``quant_dtype="s8"``: kiln's ``quantize="int8"``, with its
  accuracy gate), the rows decoded at once (``max_num_seqs``: the batch size), and the
  defaults of ``sample()`` (``on_device_generation``: sampling, ``eos_token_id``,
  ``max_length``; :meth:`NeuronConfig.sampling`);
* **no effect on the tokens**: device layouts and fusions that Neuron needs and a CPU does
  not (``fuse_qkv``, ``attention_layout``, ``group_query_attention`` ...): accepted;
* **refused**, with the reason: what would change the answer and kiln does not do.
"""
from __future__ import annotations

import dataclasses
import enum

from kiln.errors import CompilerArgsError


class GQA(enum.Enum):
    """How key/value heads are sharded over Neuron cores: a layout, the same tokens."""
    SHARD_OVER_HEADS = "shard-over-heads"
    SHARD_OVER_BATCH = "shard-over-batch"
    REPLICATED_HEADS = "replicated-heads"
    ALL_GATHER_HEADS = "all-gather-heads"


@dataclasses.dataclass
class QuantizationConfig:
    quant_dtype: str = "s8"
    dequant_dtype: str = "f16"          # the Neuron kernel's compute type; kiln computes in fp32
    quantize_method: str = "vector_dynamic"
    quantize_attn: bool = True
    no_quantize_list: list = dataclasses.field(default_factory=list)

    def quantize(self) -> str:
        if self.quant_dtype not in ("s8", "int8"):
            raise CompilerArgsError(f"QuantizationConfig(quant_dtype={self.quant_dtype!r}): kiln quantizes weights "
                                    "to int8 ('s8') here, or int4 through kiln.llm.build.compile_llm(quantize='int4')")
        if self.no_quantize_list or not self.quantize_attn:
            raise CompilerArgsError("QuantizationConfig(no_quantize_list=, quantize_attn=False): kiln quantizes "
                                    "every linear layer's weights; leave these at their defaults")
        return "int8"


@dataclasses.dataclass
class ContinuousBatchingConfig:
    max_num_seqs: int | None = None
    batch_size_for_shared_caches: int | None = None
    max_model_len: int | None = None


@dataclasses.dataclass
class GenerationConfig:
    """``on_device_generation``: the sampling ``sample()`` does by default (kiln samples on
    the host; the draws are the same distribution)."""
    max_length: int | None = None
    do_sample: bool = False
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 1.0
    eos_token_id: int | list | None = None
    dynamic: bool = False
    deterministic: bool = False
    global_top_k: int | None = None
    per_batch_line: bool = False


_NO_EFFECT = ("attention_layout", "collectives_layout", "cache_layout", "fuse_qkv", "fuse_mlp",
              "group_query_attention", "sequence_parallel_norm", "on_device_embedding", "shard_over_sequence",
              "lhs_aligned", "padding_side", "weight_tiling", "log_softmax_scores", "compiler_args")


class NeuronConfig:
    """transformers-neuronx's ``NeuronConfig``: what kiln applies of it (module doc)."""

    def __init__(self, *, quant=None, continuous_batching=None, on_device_generation=None, sparse_attn=None,
                 **layout):
        unknown = sorted(set(layout) - set(_NO_EFFECT))
        if unknown:
            raise CompilerArgsError(f"NeuronConfig options kiln does not know: {unknown}")
        if sparse_attn is not None:
            raise CompilerArgsError("NeuronConfig(sparse_attn=): sparse attention changes the answer and kiln "
                                    "computes dense attention; leave it unset")
        self.quant, self.continuous_batching, self.on_device_generation = quant, continuous_batching, on_device_generation
        self.layout = layout            # accepted, no effect on the tokens
        self.sampling()                 # its refusals now, not at the first sample()

    def compile_options(self) -> dict:
        """``compile_llm`` options this config sets."""
        return {"quantize": self.quant.quantize()} if self.quant is not None else {}

    def batch_size(self, given: int) -> int:
        """``max_num_seqs`` when continuous batching sets it (and ``batch_size`` was left at 1)."""
        rows = getattr(self.continuous_batching, "max_num_seqs", None)
        if rows and given not in (1, rows):
            raise CompilerArgsError(f"batch_size={given} and ContinuousBatchingConfig(max_num_seqs={rows}) "
                                    "disagree: give one")
        return int(rows or given)

    def sampling(self) -> dict:
        """``sample()``'s defaults from ``on_device_generation``: the sampling settings, the
        stop token (``eos_token_id``) and the cap on ``sequence_length`` (``max_length``).
        ``dynamic`` and ``per_batch_line`` (which settings a compiled Neuron graph takes per
        call or per row) change no token and are accepted. ``deterministic`` and
        ``global_top_k`` are accepted where they change no token (greedy decoding, and a
        ``top_k`` within ``global_top_k``); elsewhere they are refused, as NxD Inference's
        ``OnDeviceSamplingConfig`` refuses them: kiln's sampler does neither."""
        g = self.on_device_generation
        if g is None:
            return {}
        if g.do_sample and g.deterministic:
            raise CompilerArgsError("GenerationConfig(deterministic=True) with do_sample=True: transformers-neuronx "
                                    "then takes the token at a fixed point of the distribution, which kiln's sampler "
                                    "does not; leave deterministic=False")
        if g.do_sample and g.global_top_k is not None and not 1 <= g.top_k <= g.global_top_k:
            raise CompilerArgsError(f"GenerationConfig(top_k={g.top_k}, global_top_k={g.global_top_k}): "
                                    "transformers-neuronx samples among the global_top_k best tokens first, which "
                                    "kiln's sampler does not; give a top_k between 1 and global_top_k")
        out = {"top_k": 1 if not g.do_sample else g.top_k, "top_p": g.top_p, "temperature": g.temperature}
        if g.eos_token_id is not None:
            out["eos_token_id"] = g.eos_token_id
        if g.max_length is not None:
            out["max_length"] = g.max_length
        return out
