"""transformers-neuronx's spelling of LLM compilation, for scripts that swap
``transformers_neuronx`` for ``kiln.transformers_neuronx`` in their imports::

    model = NeuronAutoModelForCausalLM.from_pretrained(path, batch_size=1, n_positions=128,
                                                       context_length_estimate=64)
    model.to_neuron()                                   # compile (kiln.llm.build.compile_llm)
    ids = model.sample(input_ids, sequence_length=256, top_k=50)

``n_positions`` is the KV cache length, or a list of token-generation buckets: the cache
holds the largest, and decode graphs are compiled for each (kiln's sequence buckets);
``context_length_estimate`` the prompt buckets (default: ``n_positions``). Options kiln
cannot honour yet are errors that say so: ``amp`` other than fp32. Shape errors use these
names (:mod:`kiln.compat.common`'s checks, as the NxD Inference layer's use its own), not
kiln's ``cache_length`` and context buckets. ``tp_degree=N`` shards the model over N ranks
(processes on their own kiln cores, checked before compiling; docs/distributed.md).
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

from kiln.compat.common import length_problem, shape_problems
from kiln.errors import CompilerArgsError, InputError, PlacementError

MODEL_FILE = "model.kiln"
# transformers-neuronx's names for kiln's shapes, in errors (kiln.compat.common)
NAMES = {"batch_size": "batch_size", "seq_len": "n_positions", "context_buckets": "context_length_estimate",
         "token_buckets": "n_positions", "context_bucket": "context_length_estimate",
         "context_fix": "compile with a larger context_length_estimate, at most n_positions"}


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
        if isinstance(n_positions, (list, tuple)) and not n_positions:
            raise CompilerArgsError("n_positions=[]: give the KV cache's length, or a non-empty list of "
                                    "token-generation buckets (the cache holds the largest)")
        windows = sorted(int(n) for n in n_positions) if isinstance(n_positions, (list, tuple)) else None
        positions = windows[-1] if windows else int(n_positions)
        context = context_length_estimate if context_length_estimate is not None else positions
        context = list(context) if isinstance(context, (list, tuple)) else [int(context)]
        given = neuron_config.batch_size(batch_size) if neuron_config is not None else batch_size
        problems = shape_problems(NAMES, given, positions, None, context or [0], windows)
        if problems:
            raise CompilerArgsError("; ".join(problems))
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        from kiln.llm.decoder import max_positions
        limit = max_positions(model.config)
        if limit is not None and positions > limit:
            raise CompilerArgsError(f"n_positions={positions} exceeds the {limit} positions {type(model).__name__} "
                                    f"has learned position embeddings for; use n_positions <= {limit}")
        return cls(model, batch_size=batch_size, n_positions=positions, context_length_estimate=context,
                   sequence_buckets=windows, tp_degree=tp_degree, neuron_config=neuron_config)

    def to_neuron(self):
        """Compile the prefill and decode graphs (kiln's engines, chosen by measurement), or
        read them from the directory :meth:`load` named."""
        if self.tp_degree > 1:      # more ranks than cores: said now, not after the compile, at the first sample()
            from kiln.host import cores
            try:
                cores.share(0, self.tp_degree)
            except PlacementError as e:
                raise PlacementError(f"tp_degree={self.tp_degree}: {e}") from None
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

    def sample(self, input_ids, sequence_length: int = 128, start_ids=None, top_k: int | None = None,
               top_p: float | None = None, eos_token_override: int | None = None, temperature: float | None = None,
               streamer=None, stopping_criteria_list=None, no_repeat_ngram_size: int | None = None):
        """Prompt plus new tokens up to ``sequence_length`` in all, top-k sampled
        (``top_k=1`` is greedy; defaults: ``on_device_generation``'s, else top_k 50), as
        ``[batch, tokens]``, each row stopping at the model's end-of-sequence token
        (``eos_token_override``, else ``on_device_generation``'s ``eos_token_id``, for this
        call), at most ``on_device_generation``'s ``max_length`` tokens. A ``streamer``
        (transformers' ``put``/``end`` protocol, one sequence) gets the prompt, then each
        token as it comes. ``no_repeat_ngram_size`` and ``stopping_criteria_list`` are
        refused: kiln does not apply them, and ignoring them would change the tokens."""
        import torch
        if self.compiled is None:
            raise InputError("call to_neuron() before sample(): the model is not compiled yet")
        if start_ids is not None:
            raise InputError("sample(start_ids=) is not supported by kiln yet")
        if no_repeat_ngram_size:
            raise InputError(f"sample(no_repeat_ngram_size={no_repeat_ngram_size}): kiln does not ban repeated "
                             "n-grams, and ignoring it would give other tokens; leave it unset")
        if stopping_criteria_list:
            raise InputError("sample(stopping_criteria_list=) is not supported by kiln: stop on "
                             "eos_token_override, or cut the output afterwards")
        if isinstance(input_ids, (list, tuple)):
            input_ids = torch.as_tensor(input_ids)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise InputError(f"sample() takes input_ids of shape [batch, tokens] (a tensor); got {got}"
                             " (one prompt is input_ids.unsqueeze(0))")
        if input_ids.shape[1] == 0:
            raise InputError(f"sample() got input_ids of shape {tuple(input_ids.shape)}: each row needs a prompt "
                             "of at least one token")
        defaults = {"top_k": 50, "top_p": 1.0, "temperature": 1.0,
                    **(self.neuron_config.sampling() if self.neuron_config is not None else {})}
        top_k = defaults["top_k"] if top_k is None else top_k
        top_p = defaults["top_p"] if top_p is None else top_p
        temperature = defaults["temperature"] if temperature is None else temperature
        if defaults.get("max_length"):
            sequence_length = min(sequence_length, defaults["max_length"])
        new = sequence_length - input_ids.shape[1]
        if new < 1:
            raise InputError(f"sequence_length={sequence_length} leaves no room after the "
                             f"{input_ids.shape[1]}-token prompt")
        problem = length_problem(self.compiled, input_ids.shape[1], new, NAMES)
        if problem:
            raise InputError(problem)
        eos = eos_token_override if eos_token_override is not None else defaults.get("eos_token_id")
        stop = {} if eos is None else {"eos_token_id": eos}
        greedy = top_k == 1
        return self.compiled.hf_generate(input_ids, max_new_tokens=new, do_sample=not greedy, top_k=top_k,
                                         temperature=temperature, top_p=top_p, streamer=streamer,
                                         checkpoint_defaults=False, **stop)   # sample() reads no generation_config.json


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
