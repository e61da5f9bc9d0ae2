"""Hugging Face ``generate`` settings as :meth:`kiln.runtime.llm.LLM.hf_generate` reads them.

Scripts ported from transformers, Optimum Neuron or NxD Inference call ``generate`` with a
``GenerationConfig`` and keyword overrides. What kiln does with each setting:

* **honoured**, with transformers' own defaults and precedence (an override over the
  config, the config over the checkpoint's generation config where the artifact recorded
  it (:func:`recorded`), ``max_new_tokens`` over ``max_length``, ``max_length`` counting
  the prompt's padded width, 20 new tokens when neither is set; an override given as None
  counts: ``eos_token_id=None`` is no stop token);
* **ignored when greedy**, as transformers ignores them: ``temperature``, ``top_k``,
  ``top_p`` (and kiln's ``seed``) with ``do_sample=False``, so ``temperature=0.0`` with
  ``do_sample=False`` is greedy decoding, not an error;
* **refused** when set to anything but its default: beam search, several sequences per
  prompt, minimum lengths, n-gram bans, other logits processors, dict outputs. Those change
  the answer, and ignoring one would hand back tokens transformers would not, with no word
  about it. The error names the setting. A value that does nothing is a default too:
  ``min_new_tokens=0``, ``min_p=0``, ``guidance_scale=1``, an empty list of token ids
  (``suppress_tokens=[]``);
* ``use_cache`` is accepted (it changes no token), ``streamer`` is
  :meth:`~kiln.runtime.llm.LLM.hf_generate`'s own; anything else passed as an override is
  an unknown setting (also an error). Settings of a config that change no token
  (``use_cache``, ``bos_token_id``, the cache's and compile's settings: :data:`HARMLESS`)
  are not read;
* **any other setting** a config (or the checkpoint's generation config) holds, one this
  module does not name (``exponential_decay_length_penalty``, ``dola_layers``,
  ``watermarking_config``, one a later transformers adds), is refused by name when set: until
  12-03 such settings were not read at all, so ``exponential_decay_length_penalty`` gave other
  tokens than transformers, without a word.
"""
from __future__ import annotations

import functools

from kiln.errors import InputError
from kiln.runtime import value_checks

# transformers.GenerationConfig's settings kiln honours, with that class's defaults
# (``seed`` is kiln's: a sampled request's generator).
HONOURED = {"max_new_tokens": None, "max_length": None, "do_sample": False, "temperature": 1.0, "top_k": 50,
            "top_p": 1.0, "repetition_penalty": 1.0, "eos_token_id": None, "pad_token_id": None, "seed": None}

# transformers' generate when no length is set: 20 new tokens (its "model-agnostic default")
DEFAULT_NEW_TOKENS = 20

# Settings that change the tokens or the return type, which kiln does not implement, with
# GenerationConfig's defaults: at its default a setting is harmless and accepted.
REFUSED = {"num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "min_length": 0,
           "min_new_tokens": None, "no_repeat_ngram_size": 0, "typical_p": 1.0, "min_p": None,
           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "penalty_alpha": None, "diversity_penalty": 0.0,
           "encoder_repetition_penalty": 1.0, "bad_words_ids": None, "suppress_tokens": None,
           "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
           "sequence_bias": None, "guidance_scale": None, "stop_strings": None, "output_scores": False,
           "output_logits": False, "return_dict_in_generate": False}

# Values of refused settings that do nothing (transformers adds no processor, or one that
# keeps every token), accepted as their defaults are; an empty collection is one too.
NO_OP = {"min_new_tokens": 0, "min_p": 0.0, "guidance_scale": 1.0}

# Settings that change no token: accepted as overrides, not read.
ACCEPTED = {"use_cache"}

# GenerationConfig's settings that change no token of kiln's decoding: the cache's and
# compile's, token ids a decoder-only generate does not read, beam search's (num_beams is
# refused), the assisted and prompt-lookup decoding's (the same greedy tokens), what
# dict outputs hold (return_dict_in_generate is refused), renormalising after the processors
# kiln has (the same distribution), and bookkeeping. A setting neither here nor in HONOURED
# or REFUSED is refused when set (module doc).
HARMLESS = {"transformers_version", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_config",
            "cache_implementation", "compile_config", "disable_compile", "continuous_batching_config",
            "prefill_chunk_size", "max_cache_len", "low_memory", "is_assistant", "output_attentions",
            "output_hidden_states", "early_stopping", "length_penalty", "assistant_confidence_threshold",
            "assistant_early_exit", "assistant_ensemble_weight", "assistant_lookbehind", "target_lookbehind",
            "num_assistant_tokens", "num_assistant_tokens_schedule", "speculation_type", "use_mtp",
            "max_matching_ngram_size", "prompt_lookup_num_tokens", "renormalize_logits", "remove_invalid_values",
            "trust_remote_code", "generation_kwargs", "return_legacy_cache"}


def _settings_of(generation_config) -> dict:
    """Every setting ``generation_config`` holds (not None), except the harmless ones."""
    if generation_config is None:
        return {}
    values = generation_config.to_dict() if hasattr(generation_config, "to_dict") else vars(generation_config)
    return {k: v for k, v in values.items()
            if not k.startswith("_") and k not in HARMLESS and v is not None}


def _is_default(name, value) -> bool:
    """``value`` of the refused setting ``name`` does what its default does."""
    if value is None or value is False:         # a switch left off (token_healing=False) does nothing
        return True
    if isinstance(value, (list, tuple, dict, set, frozenset)) and not value:
        return True
    for harmless in (REFUSED.get(name), NO_OP.get(name), _config_defaults().get(name)):
        try:
            if harmless is not None and bool(value == harmless):
                return True
        except (TypeError, ValueError, RuntimeError):     # a tensor or an array of several values
            pass
    return False


def recorded(generation_config) -> dict:
    """The settings of a checkpoint's ``generation_config`` (its ``generation_config.json``,
    or what transformers derives from ``config.json``) that :func:`resolve` reads, as JSON
    values, for the LLM artifact's meta: generate's defaults where the call leaves a
    setting unset, as transformers' generate fills them from ``model.generation_config``."""
    import json
    out = {}
    for k, value in _settings_of(generation_config).items():
        try:
            out[k] = json.loads(json.dumps(value))
        except (TypeError, ValueError):         # not JSON (a dict with tuple keys): kept as text, refused by name
            out[k] = repr(value)
    return out


def resolve(generation_config, overrides: dict, width: int, model_defaults: dict | None = None) -> tuple:
    """``(settings, max_new_tokens)`` for prompts padded to ``width`` tokens, or InputError.
    Precedence as transformers' generate: an override (even None: ``eos_token_id=None`` is
    no stop token, ``settings["eos_given"]`` says it was given) over the config's settings
    that are not None, over ``model_defaults`` (the checkpoint's, :func:`recorded`), over
    GenerationConfig's defaults."""
    overrides = {k: v for k, v in overrides.items() if k not in ACCEPTED and k not in HARMLESS}
    unknown = set(overrides) - set(HONOURED) - set(REFUSED) - _config_names()
    if unknown:
        raise InputError(f"generate() got settings kiln does not know: {sorted(unknown)}")
    given = {k: v for k, v in (model_defaults or {}).items() if k not in HARMLESS}
    given.update(_settings_of(generation_config))
    given.update(overrides)          # an override of None too, as transformers' generate(**kwargs)
    refused = {k: v for k, v in given.items() if k not in HONOURED and not _is_default(k, v)}
    if refused:
        named = ", ".join(f"{k}={v!r}" for k, v in sorted(refused.items()))
        raise InputError(f"kiln's generate does not do {named}: it decodes greedily or samples one sequence per "
                         "prompt (temperature, top_k, top_p, repetition_penalty). Leave these at their "
                         "defaults; transformers' own generate would give other tokens")
    cfg = {**HONOURED, **{k: v for k, v in given.items() if k in HONOURED and v is not None}}   # None: the default
    cfg["eos_given"] = "eos_token_id" in given      # given as None: no stop token (transformers' kwargs)
    if cfg["max_new_tokens"] is not None:
        new = value_checks.count(cfg["max_new_tokens"], "max_new_tokens")
    elif cfg["max_length"] is None:
        new = DEFAULT_NEW_TOKENS
    else:
        new = value_checks.count(cfg["max_length"], "max_length") - width
        if new < 1:
            raise InputError(f"the input is {width} tokens wide, but max_length is {cfg['max_length']}: nothing "
                             "is left to generate. Set max_new_tokens (the new tokens alone), or a larger "
                             "max_length (prompt and new tokens together)")
    if new < 1:
        raise InputError(f"max_new_tokens must be at least 1; got {new}")
    return cfg, new


def _config_names() -> set:
    """The settings transformers' ``GenerationConfig`` has (an override naming one that kiln
    does not do is refused as such, not called unknown)."""
    return set(_config_defaults())


@functools.lru_cache(maxsize=1)
def _config_defaults() -> dict:
    """A fresh ``GenerationConfig``'s settings: a setting at its own default is harmless in
    any transformers version (4.x's defaults are values, ``token_healing=False``; 5.x's None)."""
    try:
        from transformers import GenerationConfig
    except ImportError:
        return {}
    return {k: v for k, v in vars(GenerationConfig()).items() if not k.startswith("_")}


def sampling_params(cfg: dict):
    """The scheduler's :class:`kiln.runtime.sampling.SamplingParams` for settings
    :func:`resolve` gave. Greedy decoding reads the repetition penalty alone: transformers
    applies ``temperature``, ``top_k`` and ``top_p`` only when sampling, so their values
    (``temperature=0.0``) are neither used nor checked then, as there."""
    from kiln.runtime.sampling import SamplingParams
    if not cfg["do_sample"]:
        return SamplingParams(repetition_penalty=cfg["repetition_penalty"])
    return SamplingParams(do_sample=True, temperature=cfg["temperature"], top_k=cfg["top_k"], top_p=cfg["top_p"],
                          repetition_penalty=cfg["repetition_penalty"], seed=cfg["seed"])
