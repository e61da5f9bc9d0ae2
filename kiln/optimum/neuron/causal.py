"""Optimum Neuron's ``NeuronModelForCausalLM`` over kiln's LLM path (:func:`kiln.llm.build.compile_llm`,
:class:`kiln.runtime.llm.LLM`), in both of its spellings:

* Optimum Neuron 0.4 and later: ``get_neuron_config(path, batch_size=, sequence_length=,
  tensor_parallel_size=, prefill_chunk_size=)``, then ``export(path, neuron_config)``;
  ``from_pretrained`` only loads an exported directory.
* up to 0.3: ``from_pretrained(path, export=True, batch_size=, sequence_length=, num_cores=,
  auto_cast_type=)``.

``sequence_length`` is the KV cache (prompt plus new tokens); prompts may take up to all of
it less one new token: they are prefilled in chunks of ``prefill_chunk_size`` (default: half
the sequence, at most 1024) between decode steps. ``generate`` is Hugging Face's for
decoder-only models: ``[B, T]`` ids in, ``[B, T + N]`` out, greedy or sampled.
``save_pretrained`` writes ``model.kiln``, ``config.json``, ``neuron_config.json`` (NxD's keys)
and the tokenizer; loading needs neither the model's code nor transformers' weights.
"""
from __future__ import annotations

import json
import logging
import os

import torch

from kiln.atomic import write_atomic
from kiln.errors import ArtifactError, CompilerArgsError
from kiln.optimum.neuron.exported import local_directory
from kiln.optimum.neuron.modeling import MODEL_FILE, CpuModel, preprocessors_of, require_transformers
from kiln.runtime.loader import load

NEURON_CONFIG = "neuron_config.json"
log = logging.getLogger("kiln.optimum")


class NeuronModelForCausalLM(CpuModel):
    task = "text-generation"
    main_input_name = "input_ids"

    device = torch.device("cpu")

    def __init__(self, llm, config, neuron_config: dict, preprocessors=None, generation_config=None):
        self.llm, self.config, self.neuron_config = llm, config, dict(neuron_config)
        self.preprocessors = list(preprocessors or [])
        self.generation_config = generation_config or _generation_config(config)

    @property
    def static(self) -> dict:
        """The compiled shapes, as the encoders' ``static``: rows per step and tokens in all."""
        return {"batch_size": self.neuron_config["batch_size"], "sequence_length": self.neuron_config["sequence_length"]}

    # -- Optimum >= 0.4 -------------------------------------------------------------------

    @classmethod
    def get_neuron_config(cls, model_name_or_path, config=None, token=None, revision=None, instance_type=None,
                          batch_size=None, sequence_length=None, tensor_parallel_size=None,
                          prefill_chunk_size=None) -> dict:
        """NxD's neuron config for ``model_name_or_path`` (a local checkpoint directory), with
        Optimum's defaults: batch 1, the model's positions up to 4096, one core."""
        config = config or require_transformers().AutoConfig.from_pretrained(os.fspath(model_name_or_path),
                                                                      local_files_only=True)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 4096
        seq = int(sequence_length or min(positions, 4096))
        chunk = prefill_chunk_size or (1024 if seq > 1024 else max(1, seq // 2))
        if not 1 <= chunk < seq:
            raise CompilerArgsError(f"prefill_chunk_size={chunk} must be in [1, sequence_length={seq})")
        return {"_serialized_key": "NxDNeuronConfig", "checkpoint_id": os.fspath(model_name_or_path),
                "checkpoint_revision": revision, "batch_size": int(batch_size or 1),
                "max_batch_size": int(batch_size or 1), "continuous_batching": True, "speculation_length": 0,
                "sequence_length": seq, "max_context_length": seq, "prefill_chunk_size": int(chunk),
                "tp_degree": int(tensor_parallel_size or 1), "ep_degree": 1, "pp_degree": 1,
                "torch_dtype": "float32", "target": instance_type, "on_device_sampling": False,
                "output_logits": False, "fused_qkv": False, "compiler": "kiln"}

    @classmethod
    def export(cls, model_id, neuron_config: dict, config=None, token=None, revision=None, load_weights=False,
               **compile_options):
        """``compile_options``: kiln's own (``optlevel``, ``cache``, ``quantize``...), passed
        to ``compile_llm``."""
        from kiln.llm.build import compile_llm
        from kiln.llm.source import load_pretrained
        path = os.fspath(model_id)
        model, tokenizer = load_pretrained(path)
        nc = neuron_config
        seq = nc["sequence_length"]
        llm = compile_llm(model, batch_size=nc["batch_size"], context_buckets=(min(nc["prefill_chunk_size"], seq - 1),),
                          cache_length=seq, prefill_chunk=min(nc["prefill_chunk_size"], seq - 1),
                          tp_degree=nc.get("tp_degree", 1), tokenizer=tokenizer, **compile_options)
        return cls(llm, model.config, nc, [tokenizer] if tokenizer is not None else preprocessors_of(path),
                   _generation_config(model.config, path))

    # -- both -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_id, export: bool = False, batch_size=None, sequence_length=None, num_cores=None,
                        auto_cast_type=None, **kwargs):
        path = local_directory(model_id, kwargs)
        if export:      # Optimum Neuron <= 0.3
            if auto_cast_type not in (None, "fp32", "float32"):
                raise CompilerArgsError(f"auto_cast_type={auto_cast_type!r}: kiln's LLM path runs float32 weights "
                                        "or quantizes them (kiln llm compile --quantize int8/int4)")
            for name in ("task", "instance_type"):
                kwargs.pop(name, None)
            if kwargs:
                raise CompilerArgsError(f"unknown export argument(s) {', '.join(sorted(kwargs))}")
            nc = cls.get_neuron_config(path, batch_size=batch_size, sequence_length=sequence_length,
                                       tensor_parallel_size=num_cores)
            return cls.export(path, nc)
        if any(v is not None for v in (batch_size, sequence_length, num_cores, auto_cast_type)) or kwargs:
            raise CompilerArgsError("shapes and compiler arguments apply with export=True, or to "
                                    "get_neuron_config(...) + export(...); this loads an exported model")
        file = os.path.join(path, MODEL_FILE)
        if not os.path.exists(os.path.join(path, NEURON_CONFIG)) or not os.path.exists(file):
            raise FileNotFoundError(f"{path} holds no model kiln exported ({NEURON_CONFIG} and {MODEL_FILE}): "
                                    "use get_neuron_config(...) + export(...), or from_pretrained(export=True)")
        try:
            with open(os.path.join(path, NEURON_CONFIG)) as f:
                nc = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path}/{NEURON_CONFIG} is not valid JSON ({e}): the directory is damaged; "
                                "save_pretrained the model again, or export it again") from None
        if not isinstance(nc, dict) or nc.get("compiler") != "kiln":
            raise ArtifactError(f"{path}/{NEURON_CONFIG} was not written by kiln")
        config = require_transformers().AutoConfig.from_pretrained(path, local_files_only=True)
        return cls(load(file), config, nc, preprocessors_of(path), _generation_config(config, path))

    def save_pretrained(self, save_directory) -> None:
        os.makedirs(save_directory, exist_ok=True)
        self.llm.save(os.path.join(save_directory, MODEL_FILE))
        self.config.save_pretrained(save_directory)
        if self.generation_config is not None:    # its stop tokens and lengths are generate()'s defaults
            self.generation_config.save_pretrained(save_directory)
        text = json.dumps(self.neuron_config, indent=2, sort_keys=True).encode()
        write_atomic(os.path.join(save_directory, NEURON_CONFIG), lambda f: f.write(text))
        for p in self.preprocessors:
            p.save_pretrained(save_directory)

    def generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
        """Hugging Face's ``generate``: the prompt rows followed by their new tokens. Limits as on
        Neuron: at most ``batch_size`` rows (more run ``batch_size`` at a time here) and
        ``sequence_length`` tokens in all."""
        seq = self.neuron_config["sequence_length"]
        input_ids = torch.as_tensor(input_ids)
        if not input_ids.is_floating_point():     # transformers' output is int64 whatever the input's width
            input_ids = input_ids.to(torch.int64)
        if input_ids.shape[-1] >= seq:
            raise ValueError(f"a prompt of {input_ids.shape[-1]} tokens leaves no room in the compiled "
                             f"sequence_length {seq}")
        config = generation_config or self.generation_config
        if "max_new_tokens" not in kwargs and "max_length" not in kwargs:
            # the config's length when it sets one (a default max_length of 20 is no setting), else
            # up to the compiled sequence_length, as Optimum Neuron does
            if config is not None and config.max_new_tokens is not None:
                kwargs["max_new_tokens"] = config.max_new_tokens
            elif config is not None and "max_length" in config.to_diff_dict():
                kwargs["max_length"] = config.max_length
            else:
                kwargs["max_length"] = seq
        if "max_length" in kwargs:
            asked = kwargs.pop("max_length")
            asked = seq if asked is None else asked
            if asked <= input_ids.shape[-1]:       # transformers' own check and words
                raise ValueError(f"Input length of input_ids is {input_ids.shape[-1]}, but `max_length` is set to "
                                 f"{asked}. This can lead to unexpected behavior. You should consider increasing "
                                 "`max_length` or, better yet, setting `max_new_tokens`.")
            kwargs["max_new_tokens"] = min(asked, seq) - input_ids.shape[-1]
        else:
            asked = input_ids.shape[-1] + kwargs["max_new_tokens"]
        if asked > seq:     # capped, as on Neuron; said, so a short answer is not a mystery
            log.warning("kiln.optimum: %d tokens asked for in all, but this model was exported with "
                        "sequence_length=%d: generating at most %d new tokens", asked, seq, seq - input_ids.shape[-1])
        kwargs["max_new_tokens"] = min(kwargs["max_new_tokens"], seq - input_ids.shape[-1])
        return self.llm.hf_generate(input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)

    def can_generate(self) -> bool:
        return True


def _generation_config(config, path=None):
    """The directory's ``generation_config.json`` (its stop tokens, such as Llama 3's list, and
    lengths are what ``generate`` defaults to, as in transformers), else one made from the
    model's config."""
    try:
        from transformers import GenerationConfig
        if path is not None and os.path.exists(os.path.join(path, "generation_config.json")):
            return GenerationConfig.from_pretrained(path, local_files_only=True)
        return GenerationConfig.from_model_config(config)
    except Exception:  # noqa: BLE001 - defaults then come from hf_generate's own
        return None
