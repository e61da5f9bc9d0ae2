"""The NxD Inference classes kiln implements (see the package docstring)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

from kiln.atomic import write_atomic
from kiln.compat.common import length_problem, shape_problems
from kiln.errors import ArtifactError, CompilerArgsError, InputError

ARTIFACT = "model.kiln"
SAVED_CONFIG = "neuron_config.json"     # what compile() used, for NeuronLlamaForCausalLM(compiled_dir)

# NeuronConfig options of NxD Inference's that choose Neuron kernels or layouts, accepted at
# their defaults (tutorials pass them so), an error at any other value: kiln cannot honour it
NEURON_ONLY = {"flash_decoding_enabled": False, "fused_qkv": False, "sequence_parallel_enabled": False,
               "attn_kernel_enabled": None, "qkv_kernel_enabled": False, "mlp_kernel_enabled": False,
               "logical_nc_config": 1}


# how NxD Inference's quantized=True quantizes: nothing without it (NxD stores them and reads none)
QUANTIZATION = ("quantization_type", "quantization_dtype", "quantized_checkpoints_path")


NAMES = {"batch_size": "batch_size", "seq_len": "seq_len", "max_context": "max_context_length",
         "context_buckets": "context_encoding_buckets", "token_buckets": "token_generation_buckets",
         "context_bucket": "context-encoding bucket",
         "context_fix": "compile with a larger max_context_length (or context_encoding_buckets), at most seq_len"}


class OnDeviceSamplingConfig:
    """NxD Inference's sampling defaults for the adapter's ``generate``. ``top_k_kernel_enabled``
    (a Neuron top-k kernel) and ``on_device_sampling_config`` are accepted at any value: on a
    CPU they choose nothing, and the tokens are the same. ``deterministic=True`` (NxD picks
    the token at a fixed point of the distribution instead of drawing one) and ``global_topk``
    (NxD samples among that many candidates first) are accepted where they change no token:
    greedy decoding, and for ``global_topk`` a ``top_k`` within it; elsewhere they are an
    error, kiln's sampler does neither."""

    def __init__(self, top_k: int = 1, top_p: float = 1.0, temperature: float = 1.0, do_sample: bool = False,
                 dynamic: bool = False, deterministic: bool = False, global_topk: int = 256,
                 top_k_kernel_enabled: bool = False, on_device_sampling_config: bool = True, **kwargs):
        if kwargs:
            raise CompilerArgsError(f"OnDeviceSamplingConfig options kiln does not know yet: {sorted(kwargs)}")
        self.top_k, self.top_p, self.temperature = top_k, top_p, temperature
        self.do_sample = do_sample or top_k > 1
        self.dynamic, self.deterministic, self.global_topk = dynamic, deterministic, global_topk
        self.top_k_kernel_enabled, self.on_device_sampling_config = top_k_kernel_enabled, on_device_sampling_config
        if self.do_sample and deterministic:
            raise CompilerArgsError("OnDeviceSamplingConfig(deterministic=True) with sampling: NxD Inference then "
                                    "takes the token at a fixed point of the distribution, which kiln's sampler "
                                    "does not; leave deterministic=False (seed generate for repeatable draws)")
        if self.do_sample and not 1 <= top_k <= global_topk:
            raise CompilerArgsError(f"OnDeviceSamplingConfig(top_k={top_k}, global_topk={global_topk}): NxD "
                                    "Inference samples among the global_topk best tokens first, which kiln's "
                                    "sampler does not; give a top_k between 1 and global_topk")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("top_k", "top_p", "temperature", "do_sample", "dynamic",
                                              "deterministic", "global_topk", "top_k_kernel_enabled")}


class NeuronConfig:
    def __init__(self, tp_degree: int = 1, batch_size: int = 1, max_context_length: int | None = None,
                 seq_len: int = 128, on_device_sampling_config: OnDeviceSamplingConfig | None = None,
                 enable_bucketing: bool = False, context_encoding_buckets=None, token_generation_buckets=None,
                 torch_dtype="float32", quantized: bool = False, max_batch_size: int | None = None,
                 max_length: int | None = None, padding_side: str = "right", **kwargs):
        problems = []
        if padding_side not in ("left", "right"):
            problems.append(f"padding_side={padding_side!r}: must be 'left' or 'right'")
        if not isinstance(tp_degree, int) or tp_degree < 1:
            problems.append(f"tp_degree={tp_degree!r}: must be a positive integer")
        if quantized:
            problems.append("quantized=True: NxD Inference's quantized checkpoints (quantized_checkpoints_path, "
                            "per-tensor or per-channel scales) are not mapped onto kiln, whose int8/int4 builds "
                            "are weight-only on grids of their own (int8: symmetric groups of 32) and must pass "
                            "an accuracy gate; build one with kiln.llm.build.compile_llm(model, quantize='int8' "
                            "or 'int4') or `kiln llm compile --quantize int8` (docs/llm.md, Quantized weights)")
        problems += shape_problems(NAMES, max_batch_size or batch_size, seq_len, max_context_length or seq_len,
                                   context_encoding_buckets if enable_bucketing else None,
                                   token_generation_buckets if enable_bucketing else None)
        if str(torch_dtype).replace("torch.", "") not in ("float32", "fp32"):
            problems.append(f"torch_dtype={torch_dtype}: kiln's LLM path compiles float32 today")
        honoured = {k: v for k, v in kwargs.items() if k in NEURON_ONLY and v == NEURON_ONLY[k]}
        unknown = sorted(k for k in kwargs if k not in NEURON_ONLY and k not in QUANTIZATION)
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
        # the adapter's generate reads each row's real tokens from attention_mask, so left- and
        # right-padded batches both give Hugging Face's tokens: the side changes no graph
        self.padding_side = padding_side

    def to_json(self) -> dict:
        """The options :meth:`from_json` makes this config again from."""
        sampling = self.on_device_sampling_config
        return {"tp_degree": self.tp_degree, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "max_context_length": self.max_context_length, "max_length": self.max_length,
                "enable_bucketing": self.enable_bucketing, "context_encoding_buckets": self.context_encoding_buckets,
                "token_generation_buckets": self.token_generation_buckets, "padding_side": self.padding_side,
                "on_device_sampling_config": None if sampling is None else sampling.to_json()}

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


def load_pretrained_config(model_path_or_name=None, hf_config=None):
    """NxD Inference's ``load_config`` hook: a callable that copies the Hugging Face config's
    fields (from ``model_path_or_name``, or the given ``hf_config``) onto the InferenceConfig
    it is called with. Its dtype is left out: kiln compiles float32. transformers 5 keeps
    ``rope_theta`` in ``rope_parameters``; it is copied up, where NxD's Llama config wants it."""
    def load_config(self):
        if (model_path_or_name is None) == (hf_config is None):
            raise InputError('give load_pretrained_config one of "model_path_or_name" or "hf_config"')
        if model_path_or_name is not None:
            from transformers import AutoConfig
            config = AutoConfig.from_pretrained(model_path_or_name)
        else:
            config = hf_config
        fields = config.to_dict()
        for key in ("torch_dtype", "dtype"):
            fields.pop(key, None)
        for key, value in fields.items():
            if isinstance(value, dict) and hasattr(getattr(config, key, None), "to_dict"):   # a nested config
                fields[key] = SimpleNamespace(**value)
        rope = fields.get("rope_parameters")
        if "rope_theta" not in fields and isinstance(rope, dict) and "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        self.__dict__.update(fields)
        if getattr(config, "attribute_map", None):
            self.attribute_map = dict(config.attribute_map)
    return load_config


class InferenceConfig:
    """NxD Inference's model config: ``load_config(self)`` (:func:`load_pretrained_config`, or
    the subclass's own ``load_config`` method) puts the checkpoint's fields on the config
    itself, keywords then set more, and :meth:`get_required_attributes` must all be there.
    :meth:`save` / :meth:`load` write and read them with the NeuronConfig as JSON."""
    attribute_map: dict = {}

    def __init__(self, neuron_config: NeuronConfig, fused_spec_config=None, load_config=None, metadata=None,
                 **kwargs):
        if fused_spec_config is not None:
            raise CompilerArgsError("fused_spec_config: kiln's NxD Inference layer has no fused speculation; "
                                    "kiln.llm.build.compile_llm(speculation_length=k) with a draft model does "
                                    "speculative decoding (docs/llm.md)")
        self.neuron_config = neuron_config
        self.fused_spec_config = None
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def __setattr__(self, key, value):
        super().__setattr__(self.attribute_map.get(key, key), value)

    def __getattr__(self, key):             # only for names not set: a Hugging Face alias
        mapped = type(self).__getattribute__(self, "attribute_map").get(key)
        if mapped is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")
        return getattr(self, mapped)

    def load_config(self):
        """Subclasses may set their attributes here (NxD Inference's hook)."""

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def get_required_attributes(self) -> list:
        return []

    def validate_config(self):
        missing = [name for name in self.get_required_attributes() if not hasattr(self, name)]
        if missing:
            raise CompilerArgsError(f"Config must define {missing}: give load_config=load_pretrained_config(path) "
                                    "or set them as keywords")

    def to_json(self) -> dict:
        return {k: (v.to_json() if k == "neuron_config" else _plain(v)) for k, v in vars(self).items()}

    def save(self, model_path):
        """Write ``neuron_config.json`` (the NeuronConfig and every other attribute) into the directory."""
        os.makedirs(model_path, exist_ok=True)
        text = json.dumps(self.to_json(), indent=2, sort_keys=True).encode()
        write_atomic(os.path.join(model_path, SAVED_CONFIG), lambda f: f.write(text))

    @classmethod
    def load(cls, model_path, **kwargs) -> "InferenceConfig":
        """The config :meth:`save` wrote (keywords override its fields). A directory compiled
        before the checkpoint's fields were saved there gets them from its ``config.json``."""
        saved = os.path.join(str(model_path), SAVED_CONFIG)
        if not os.path.exists(saved):
            raise InputError(f"{model_path} holds no {SAVED_CONFIG}: give NeuronLlamaForCausalLM a config, or the "
                             "directory compile() wrote")
        try:
            with open(saved) as f:
                fields = json.load(f)
            nc = NeuronConfig.from_json(fields.pop("neuron_config"))
        except (ValueError, KeyError, TypeError, AttributeError) as e:   # not JSON, or not the fields save() writes
            raise ArtifactError(f"{saved} is not the config compile() writes ({type(e).__name__}: {e}); compile "
                                "the model again") from None
        fields.pop("fused_spec_config", None)
        fields.pop("num_cores_per_group", None)
        older = not fields and os.path.exists(os.path.join(str(model_path), "config.json"))
        fields.update(kwargs)
        return cls(nc, load_config=load_pretrained_config(model_path) if older else None, **fields)


def _plain(value):
    """``value`` as JSON holds it (namespaces from nested Hugging Face configs as dicts)."""
    if isinstance(value, SimpleNamespace):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


class LlamaInferenceConfig(InferenceConfig):
    def get_required_attributes(self) -> list:
        return ["hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id",
                "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "hidden_act"]


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
        self.config.save(compiled_model_path)

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
        nc = self.model.config.neuron_config
        sampling = nc.on_device_sampling_config
        if sampling is not None and generation_config is None:
            settings = {"do_sample": sampling.do_sample, "top_k": sampling.top_k, "top_p": sampling.top_p,
                        "temperature": sampling.temperature, **settings}
        _check_lengths(self.model.llm, nc, input_ids, attention_mask, generation_config, settings)
        return self.model.llm.hf_generate(input_ids, attention_mask=attention_mask,
                                          generation_config=generation_config, **settings)


def _check_lengths(llm, nc, input_ids, attention_mask, generation_config, settings) -> None:
    """A prompt past the context buckets, or prompt and new tokens past the cache, as an
    InputError in NxD Inference's names; anything else is left to ``hf_generate``."""
    import torch
    from kiln.runtime import hf_settings
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2:
        return
    mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
    if mask.shape != ids.shape:
        return
    longest = int(mask.bool().sum(1).max())
    try:
        _, new = hf_settings.resolve(generation_config, dict(settings), ids.shape[1],
                                     llm.meta.get("generation_config"))
    except Exception:               # hf_generate says what is wrong with the settings
        new = 0
    problem = length_problem(llm, longest, new, NAMES)
    if problem:
        raise InputError(problem)


def _saved_config(path) -> LlamaInferenceConfig:
    """The config :meth:`NeuronLlamaForCausalLM.compile` saved beside its artifact."""
    return LlamaInferenceConfig.load(path)
