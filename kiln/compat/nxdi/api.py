"""The NxD Inference classes kiln implements (see the package docstring)."""
from __future__ import annotations

import json
import os

from kiln.atomic import write_atomic
from kiln.errors import ArtifactError, CompilerArgsError, InputError

ARTIFACT = "model.kiln"
SAVED_CONFIG = "neuron_config.json"     # what compile() used, for NeuronLlamaForCausalLM(compiled_dir)

# NeuronConfig options of NxD Inference's that choose Neuron kernels or layouts, accepted at
# their defaults (tutorials pass them so), an error at any other value: kiln cannot honour it
NEURON_ONLY = {"flash_decoding_enabled": False, "fused_qkv": False, "sequence_parallel_enabled": False,
               "attn_kernel_enabled": None, "qkv_kernel_enabled": False, "mlp_kernel_enabled": False,
               "logical_nc_config": 1, "padding_side": "right"}


class OnDeviceSamplingConfig:
    def __init__(self, top_k: int = 1, top_p: float = 1.0, temperature: float = 1.0, do_sample: bool = False,
                 dynamic: bool = False, **kwargs):
        if kwargs:
            raise CompilerArgsError(f"OnDeviceSamplingConfig options kiln does not know yet: {sorted(kwargs)}")
        self.top_k, self.top_p, self.temperature = top_k, top_p, temperature
        self.do_sample = do_sample or top_k > 1
        self.dynamic = dynamic


class NeuronConfig:
    def __init__(self, tp_degree: int = 1, batch_size: int = 1, max_context_length: int | None = None,
                 seq_len: int = 128, on_device_sampling_config: OnDeviceSamplingConfig | None = None,
                 enable_bucketing: bool = False, context_encoding_buckets=None, token_generation_buckets=None,
                 torch_dtype="float32", quantized: bool = False, max_batch_size: int | None = None,
                 max_length: int | None = None, **kwargs):
        problems = []
        if not isinstance(tp_degree, int) or tp_degree < 1:
            problems.append(f"tp_degree={tp_degree!r}: must be a positive integer")
        if quantized:
            problems.append("quantized=True: kiln's LLM path has no quantized weights yet")
        if str(torch_dtype).replace("torch.", "") not in ("float32", "fp32"):
            problems.append(f"torch_dtype={torch_dtype}: kiln's LLM path compiles float32 today")
        honoured = {k: v for k, v in kwargs.items() if k in NEURON_ONLY and v == NEURON_ONLY[k]}
        unknown = sorted(k for k in kwargs if k not in NEURON_ONLY)
        if unknown:
            problems.append(f"options kiln does not know yet: {unknown}")
        problems += [f"{k}={v!r}: a Neuron kernel or layout kiln does not have (leave it at {NEURON_ONLY[k]!r})"
                     for k, v in sorted(kwargs.items()) if k in NEURON_ONLY and k not in honoured]
        if problems:
            raise CompilerArgsError("NeuronConfig: " + "; ".join(problems))
        self.tp_degree, self.batch_size, self.seq_len = tp_degree, max_batch_size or batch_size, seq_len
        self.max_context_length = max_context_length or seq_len
        self.max_length = max_length or seq_len      # NxD Inference's generate examples pass it as max_length
        self.on_device_sampling_config = on_device_sampling_config
        self.enable_bucketing = enable_bucketing
        self.context_encoding_buckets = context_encoding_buckets
        self.token_generation_buckets = token_generation_buckets
        self.torch_dtype = "float32"

    def to_json(self) -> dict:
        """The options :meth:`from_json` makes this config again from."""
        sampling = self.on_device_sampling_config
        return {"tp_degree": self.tp_degree, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "max_context_length": self.max_context_length, "max_length": self.max_length,
                "enable_bucketing": self.enable_bucketing, "context_encoding_buckets": self.context_encoding_buckets,
                "token_generation_buckets": self.token_generation_buckets,
                "on_device_sampling_config": None if sampling is None else {
                    "top_k": sampling.top_k, "top_p": sampling.top_p, "temperature": sampling.temperature,
                    "do_sample": sampling.do_sample, "dynamic": sampling.dynamic}}

    @classmethod
    def from_json(cls, data: dict) -> "NeuronConfig":
        data = dict(data)
        sampling = data.pop("on_device_sampling_config", None)
        return cls(**data, on_device_sampling_config=None if sampling is None else OnDeviceSamplingConfig(**sampling))

    def context_buckets(self) -> list:
        if self.enable_bucketing and self.context_encoding_buckets:
            return sorted(int(b) for b in self.context_encoding_buckets)
        return [int(self.max_context_length)]

    def sequence_buckets(self) -> list | None:
        """Token-generation buckets, as NxD Inference makes them: the given ones, or with
        bucketing on, powers of two from 128 below ``seq_len`` (the cache holds seq_len)."""
        if not self.enable_bucketing:
            return None
        if self.token_generation_buckets:
            return sorted(int(b) for b in self.token_generation_buckets)
        return [1 << k for k in range(7, 32) if 1 << k < self.seq_len]


def load_pretrained_config(model_path):
    """A loader of the checkpoint's Hugging Face config (NxD Inference's ``load_config``)."""
    def load():
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(model_path)
    return load


class InferenceConfig:
    def __init__(self, neuron_config: NeuronConfig, load_config=None, **kwargs):
        self.neuron_config = neuron_config
        self.hf_config = load_config() if load_config is not None else None
        for key, value in kwargs.items():
            setattr(self, key, value)


class LlamaInferenceConfig(InferenceConfig):
    pass


class NeuronLlamaForCausalLM:
    def __init__(self, model_path, config: InferenceConfig | None = None):
        """``config=None``: ``model_path`` is a directory :meth:`compile` wrote, whose saved
        config (the NeuronConfig and the checkpoint's) is read back, as NxD Inference's
        examples reload a compiled model."""
        if config is None:
            config = _saved_config(model_path)
        self.model_path, self.config = model_path, config
        self.llm = None

    def compile(self, compiled_model_path):
        """Compile the prefill and decode graphs and write ``model.kiln`` into the directory."""
        from transformers import AutoModelForCausalLM
        from kiln.llm.build import compile_llm
        nc = self.config.neuron_config
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype="float32").eval()
        llm = compile_llm(model, batch_size=nc.batch_size, context_buckets=nc.context_buckets(),
                          cache_length=nc.seq_len, sequence_buckets=nc.sequence_buckets(), tp_degree=nc.tp_degree)
        os.makedirs(compiled_model_path, exist_ok=True)
        llm.save(os.path.join(compiled_model_path, ARTIFACT))
        model.config.save_pretrained(compiled_model_path)
        text = json.dumps({"neuron_config": nc.to_json()}, indent=2, sort_keys=True).encode()
        write_atomic(os.path.join(compiled_model_path, SAVED_CONFIG), lambda f: f.write(text))

    def load(self, compiled_model_path):
        from kiln.runtime.loader import load
        path = os.path.join(compiled_model_path, ARTIFACT)
        if not os.path.exists(path):
            raise InputError(f"{path} does not exist: call compile({compiled_model_path!r}) first")
        self.llm = load(path)


class HuggingFaceGenerationAdapter:
    """``generate(input_ids, attention_mask=, generation_config=, **settings)`` as transformers
    has it, over a loaded NeuronLlamaForCausalLM; its OnDeviceSamplingConfig gives the
    defaults (``top_k=1``: greedy)."""

    def __init__(self, model: NeuronLlamaForCausalLM):
        self.model = model

    def generate(self, input_ids, attention_mask=None, generation_config=None, **settings):
        if self.model.llm is None:
            raise InputError("load() the compiled model before generate()")
        sampling = self.model.config.neuron_config.on_device_sampling_config
        if sampling is not None and generation_config is None:
            settings = {"do_sample": sampling.do_sample, "top_k": sampling.top_k, "top_p": sampling.top_p,
                        "temperature": sampling.temperature, **settings}
        return self.model.llm.hf_generate(input_ids, attention_mask=attention_mask,
                                          generation_config=generation_config, **settings)


def _saved_config(path) -> LlamaInferenceConfig:
    """The config :meth:`NeuronLlamaForCausalLM.compile` saved beside its artifact."""
    saved = os.path.join(str(path), SAVED_CONFIG)
    if not os.path.exists(saved):
        raise InputError(f"{path} holds no {SAVED_CONFIG}: give NeuronLlamaForCausalLM a config, or the directory "
                         "compile() wrote")
    try:
        with open(saved) as f:
            nc = NeuronConfig.from_json(json.load(f)["neuron_config"])
    except (ValueError, KeyError, TypeError) as e:        # not JSON, or not the fields compile() writes
        raise ArtifactError(f"{saved} is not the config compile() writes ({type(e).__name__}: {e}); compile "
                            "the model again") from None
    return LlamaInferenceConfig(nc, load_config=load_pretrained_config(path))
