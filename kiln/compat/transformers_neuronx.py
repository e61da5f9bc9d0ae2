"""transformers-neuronx's spelling of LLM compilation, for scripts that swap
``transformers_neuronx`` for ``kiln.transformers_neuronx`` in their imports::

    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=1, n_positions=128,
                                                       context_length_estimate=64)
    model.to_neuron()                                   # compile (kiln.llm.build.compile_llm)
    ids = model.sample(input_ids, sequence_length=256, top_k=50)

``n_positions`` is the KV cache length, or a list of token-generation buckets: the cache
holds the largest, and decode graphs are compiled for each (kiln's sequence buckets);
``context_length_estimate`` the prompt buckets (default: ``n_positions``). Options kiln
cannot honour yet are errors that say so: ``amp`` other than fp32. ``tp_degree=N`` shards
the model over N ranks (processes on their own kiln cores; docs/distributed.md).
``neuron_config=NeuronConfig(...)`` is read as :mod:`kiln.compat.tnx_config` says (int8
weights, the rows decoded at once, ``sample()``'s sampling defaults; layouts accepted);
``save(dir)`` / ``load(dir)`` keep the compiled model between processes, as on Neuron.

The per-family classes of transformers-neuronx's tutorials (``LlamaForSampling``,
``MistralForSampling``, ``Qwen2ForSampling``, ``GPT2ForSampling``) are the same class held to
their family: a checkpoint of another family is an error naming the class to use, where
transformers-neuronx would build the wrong graph. ``save_pretrained_split`` saves the
checkpoint they load, and ``HuggingFaceGenerationModelAdapter(config, model).generate``
is transformers' ``generate`` over the compiled model.
"""
from __future__ import annotations

import os

from kiln.errors import CompilerArgsError, InputError

MODEL_FILE = "model.kiln"


class NeuronAutoModelForCausalLM:
    family = None       # a per-family class's ``config.model_type``; None takes any kiln supports

    def __init__(self, model, *, batch_size, n_positions, context_length_estimate, sequence_buckets=None,
                 tp_degree: int = 1, neuron_config=None):
        self.model = model
        self.tp_degree = tp_degree
        self.sequence_buckets = sequence_buckets
        self.neuron_config = neuron_config
        self.batch_size = neuron_config.batch_size(batch_size) if neuron_config is not None else batch_size
        self.n_positions = n_positions
        self.context_length_estimate = context_length_estimate
        self.compiled = None
        self._saved = None              # a directory load() named: to_neuron() reads it instead of compiling

    @classmethod
    def from_pretrained(cls, path, batch_size: int = 1, n_positions=2048, tp_degree: int = 1, amp: str = "f32",
                        context_length_estimate=None, neuron_config=None, **kwargs):
        if not isinstance(tp_degree, int) or tp_degree < 1:
            raise CompilerArgsError(f"tp_degree={tp_degree!r}: must be a positive integer")
        if amp not in ("f32", "fp32", "float32"):
            raise CompilerArgsError(f"amp={amp!r}: kiln's LLM path compiles fp32 today; use amp='f32'")
        if kwargs:
            raise CompilerArgsError(f"from_pretrained() options kiln does not know yet: {sorted(kwargs)}")
        from transformers import AutoConfig, AutoModelForCausalLM
        if cls.family is not None:
            kind = AutoConfig.from_pretrained(path).model_type
            if kind != cls.family:
                named = FAMILY_CLASSES.get(kind, "NeuronAutoModelForCausalLM")
                raise CompilerArgsError(f"{cls.__name__} loads {cls.family} checkpoints; {path} holds a {kind!r} "
                                        f"model: use {named}")
        windows = sorted(int(n) for n in n_positions) if isinstance(n_positions, (list, tuple)) else None
        positions = windows[-1] if windows else int(n_positions)
        context = context_length_estimate if context_length_estimate is not None else positions
        context = list(context) if isinstance(context, (list, tuple)) else [int(context)]
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        return cls(model, batch_size=batch_size, n_positions=positions, context_length_estimate=context,
                   sequence_buckets=windows, tp_degree=tp_degree, neuron_config=neuron_config)

    def to_neuron(self):
        """Compile the prefill and decode graphs (kiln's engines, chosen by measurement), or
        read them from the directory :meth:`load` named."""
        if self._saved is not None:
            from kiln.runtime.loader import load
            self.compiled = load(os.path.join(self._saved, MODEL_FILE))
            return self
        from kiln.llm.build import compile_llm
        options = self.neuron_config.compile_options() if self.neuron_config is not None else {}
        self.compiled = compile_llm(self.model, batch_size=self.batch_size,
                                    context_buckets=self.context_length_estimate, cache_length=self.n_positions,
                                    sequence_buckets=self.sequence_buckets, tp_degree=self.tp_degree, **options)
        return self

    def save(self, directory):
        """transformers-neuronx's ``save``: the compiled model, for :meth:`load` in another process."""
        if self.compiled is None:
            raise InputError("call to_neuron() before save(): there is nothing compiled to save")
        os.makedirs(directory, exist_ok=True)
        self.compiled.save(os.path.join(directory, MODEL_FILE))

    def load(self, directory):
        """transformers-neuronx's ``load``: the next :meth:`to_neuron` reads what :meth:`save`
        wrote instead of compiling."""
        if not os.path.exists(os.path.join(directory, MODEL_FILE)):
            raise InputError(f"{directory} holds no {MODEL_FILE}: save() a compiled model there first")
        self._saved = os.fspath(directory)
        return self

    def sample(self, input_ids, sequence_length: int = 128, top_k: int | None = None, temperature: float | None = None,
               top_p: float | None = None, start_ids=None, streamer=None):
        """Prompt plus new tokens up to ``sequence_length`` in all, top-k sampled
        (``top_k=1`` is greedy; defaults: ``on_device_generation``'s, else top_k 50), as
        ``[batch, tokens]``. A ``streamer`` (transformers' ``put``/``end`` protocol, one
        sequence) gets the prompt, then each token as it comes."""
        if self.compiled is None:
            raise InputError("call to_neuron() before sample(): the model is not compiled yet")
        if start_ids is not None:
            raise InputError("sample(start_ids=) is not supported by kiln yet")
        if getattr(input_ids, "dim", lambda: 0)() != 2:
            raise InputError(f"sample() takes input_ids of shape [batch, tokens]; got {tuple(getattr(input_ids, 'shape', ()))}"
                             " (one prompt is input_ids.unsqueeze(0))")
        longest = max(self.context_length_estimate)
        if input_ids.shape[1] > longest and not self.compiled.meta.get("prefill_chunk"):
            raise InputError(f"a {input_ids.shape[1]}-token prompt is longer than the largest context_length_estimate "
                             f"({longest}): compile with context_length_estimate={input_ids.shape[1]} or more")
        defaults = {"top_k": 50, "top_p": 1.0, "temperature": 1.0,
                    **(self.neuron_config.sampling() if self.neuron_config is not None else {})}
        top_k = defaults["top_k"] if top_k is None else top_k
        top_p = defaults["top_p"] if top_p is None else top_p
        temperature = defaults["temperature"] if temperature is None else temperature
        new = sequence_length - input_ids.shape[1]
        if new < 1:
            raise InputError(f"sequence_length={sequence_length} leaves no room after the "
                             f"{input_ids.shape[1]}-token prompt")
        greedy = top_k == 1
        return self.compiled.hf_generate(input_ids, max_new_tokens=new, do_sample=not greedy, top_k=top_k,
                                         temperature=temperature, top_p=top_p, streamer=streamer)


class LlamaForSampling(NeuronAutoModelForCausalLM):
    family = "llama"


class MistralForSampling(NeuronAutoModelForCausalLM):
    family = "mistral"


class Qwen2ForSampling(NeuronAutoModelForCausalLM):
    family = "qwen2"


class GPT2ForSampling(NeuronAutoModelForCausalLM):
    family = "gpt2"


FAMILY_CLASSES = {c.family: c.__name__ for c in (LlamaForSampling, MistralForSampling, Qwen2ForSampling,
                                                 GPT2ForSampling)}


def save_pretrained_split(model, save_directory):
    """transformers-neuronx's checkpoint for its ``from_pretrained``: here the model's own
    ``save_pretrained`` (safetensors), which the classes above load."""
    model.save_pretrained(save_directory)


class HuggingFaceGenerationModelAdapter:
    """``HuggingFaceGenerationModelAdapter(config, neuron_model).generate(input_ids,
    attention_mask=, **settings)``: transformers' ``generate`` over the compiled model
    (:meth:`kiln.runtime.llm.LLM.hf_generate`: its settings, and the errors for those kiln
    does not implement)."""

    def __init__(self, config, model: NeuronAutoModelForCausalLM):
        self.config, self.model = config, model

    def reset_generation(self):
        """A no-op: every ``generate`` starts from a fresh cache."""

    def generate(self, input_ids, attention_mask=None, generation_config=None, **settings):
        if self.model.compiled is None:
            raise InputError("call to_neuron() on the model before generate(): it is not compiled yet")
        return self.model.compiled.hf_generate(input_ids, attention_mask=attention_mask,
                                               generation_config=generation_config, **settings)
