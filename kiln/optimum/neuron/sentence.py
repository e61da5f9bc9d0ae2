"""Optimum Neuron's ``NeuronSentenceTransformers`` (before 0.4.2 ``NeuronModelForSentenceTransformers``):
a sentence-transformers directory's encoder compiled at static shapes, the modules after it
(pooling, ``Dense``, ``Normalize``) applied on the host to the trimmed token embeddings as
sentence-transformers' own modules apply them (:mod:`kiln.optimum.neuron.st_modules`), read from
the directory at export and kept in the saved ``neuron`` section. Outputs ``token_embeddings``
and ``sentence_embedding``; ``encode``, ``similarity`` and ``similarity_pairwise`` as
sentence-transformers'.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import torch

from kiln.optimum.neuron import st_modules
from kiln.optimum.neuron.modeling import NeuronTracedModel

log = logging.getLogger("kiln.optimum")
PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


@functools.lru_cache(maxsize=1)
def _output_class():
    from transformers.utils import ModelOutput

    @dataclasses.dataclass
    class SentenceTransformersOutput(ModelOutput):
        token_embeddings: torch.Tensor | None = None
        sentence_embedding: torch.Tensor | None = None
    return SentenceTransformersOutput


class NeuronSentenceTransformers(NeuronTracedModel):
    task = "feature-extraction"
    library_name = "sentence_transformers"
    auto_class = "AutoModel"
    output_names = ("last_hidden_state",)

    def __init__(self, compiled, config, neuron: dict, preprocessors=None, st_weights=None):
        super().__init__(compiled, config, neuron, preprocessors)
        self.st = neuron.get("sentence_transformers") or st_modules.legacy_plan(neuron)
        self.st_weights = dict(st_weights or {})
        self.prompts = dict(self.st["prompts"])
        self.default_prompt_name = self.st["default_prompt_name"]
        self.similarity_fn_name = self.st["similarity_fn_name"]
        self.truncate_dim = None
        if self.st.get("do_lower_case"):      # at each load: a tokenizer may rebuild its normalizer from its config
            for p in self.preprocessors:
                if hasattr(p, "backend_tokenizer") or hasattr(p, "do_lower_case"):
                    st_modules.lowercase_tokenizer(p)

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        transformer, plan, weights = st_modules.read(path)
        model = super()._export(transformer, config, **kwargs)
        model.neuron.update(library_name=cls.library_name, sentence_transformers=plan,
                            max_seq_length=plan["max_seq_length"])
        return cls(model.model, model.config, model.neuron, model.preprocessors, weights)

    @classmethod
    def _load(cls, path, file_name):
        model = super()._load(path, file_name)
        if model.neuron.get("library_name") != cls.library_name:
            from kiln.errors import ArtifactError
            raise ArtifactError(f"{path} was exported as a plain feature-extraction model; load it with "
                                "NeuronModelForFeatureExtraction, or export the sentence-transformers "
                                "directory with this class")
        model.st_weights = st_modules.load_weights(model.st, path)
        return model

    def save_pretrained(self, save_directory) -> None:
        super().save_pretrained(save_directory)
        st_modules.save_weights(self.st_weights, save_directory)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, prompt_length=None, **kwargs):
        ids = torch.as_tensor(input_ids)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        hidden = super().forward(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids,
                                 **kwargs).last_hidden_state
        pooled = st_modules.apply(self.st, self.st_weights, hidden, mask, prompt_length)
        return _output_class()(token_embeddings=hidden, sentence_embedding=pooled)

    # -- sentence-transformers' encode ------------------------------------------------------

    def encode(self, inputs=None, prompt_name: str | None = None, prompt: str | None = None, batch_size: int = 32,
               show_progress_bar=None, output_value: str | None = "sentence_embedding", precision: str = "float32",
               convert_to_numpy: bool = True, convert_to_tensor: bool = False, device=None,
               normalize_embeddings: bool = False, truncate_dim: int | None = None, **kwargs):
        """sentence-transformers' ``encode``, with its keywords and its answers: one embedding per
        text (a 1-D one for a lone string), ``prompt``/``prompt_name`` (the saved ``prompts`` and
        ``default_prompt_name``), ``output_value`` (``"token_embeddings"``: each text's unpadded
        token vectors; ``None``: a dict per text), ``truncate_dim``, ``precision`` (quantized by
        sentence-transformers' own ``quantize_embeddings``, which must be installed). Texts are cut
        at the compiled sequence length and the model's ``max_seq_length``."""
        if "sentences" in kwargs:                       # its name before sentence-transformers 5
            inputs = kwargs.pop("sentences")
        self._check_encode_kwargs(kwargs, device)
        if not self.preprocessors:
            raise ValueError("this model has no tokenizer (none was saved beside it): tokenize the texts and "
                             "call the model")
        if output_value not in ("sentence_embedding", "token_embeddings", None):
            raise ValueError(f"output_value={output_value!r}: one of 'sentence_embedding', 'token_embeddings', None")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"Precision {precision!r} is not supported, must be one of {set(PRECISIONS)}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        if convert_to_tensor:
            convert_to_numpy = False
        if output_value != "sentence_embedding":
            convert_to_tensor = convert_to_numpy = False
        single = isinstance(inputs, str)
        texts = [inputs] if single else (inputs.tolist() if isinstance(inputs, np.ndarray) else list(inputs))
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("kiln's NeuronSentenceTransformers encodes texts (str) only")
        prompt = self._resolve_prompt(prompt, prompt_name)
        truncate_dim = self.truncate_dim if truncate_dim is None else truncate_dim
        order = np.argsort([-len(t) for t in texts])          # sentence-transformers' batches, by length
        results = []
        for start in range(0, len(texts), batch_size):
            features = self._features([texts[i] for i in order[start:start + batch_size]], prompt)
            if truncate_dim is not None:
                features["sentence_embedding"] = features["sentence_embedding"][..., :truncate_dim]
            results.extend(self._per_text(features, output_value, normalize_embeddings))
        results = [results[i] for i in np.argsort(order)]
        if output_value == "sentence_embedding":
            results = torch.stack(results) if results else torch.tensor([])
        if len(results) and precision and precision != "float32":
            results = _quantize(results, precision)
        if convert_to_tensor:
            results = torch.as_tensor(results) if isinstance(results, torch.Tensor) or len(results) else \
                torch.tensor([])
        elif convert_to_numpy:
            if not len(results):
                results = np.array([])
            elif isinstance(results, torch.Tensor):
                results = results.numpy()
        else:
            results = list(torch.from_numpy(results) if isinstance(results, np.ndarray) else results)
        return results[0] if single else results

    def _check_encode_kwargs(self, kwargs: dict, device) -> None:
        kwargs.pop("task", None)           # a plain Transformer module's answers do not depend on it
        if kwargs.get("pool") is not None or kwargs.get("chunk_size") is not None or isinstance(device, list):
            raise ValueError("multi-process encoding (pool=, chunk_size=, a list of devices) is not available in "
                             "kiln: the compiled model runs in this process")
        kwargs.pop("pool", None), kwargs.pop("chunk_size", None)
        if kwargs.get("processing_kwargs"):
            raise ValueError("processing_kwargs= is not applied by kiln: the texts are tokenized with the saved "
                             "tokenizer, cut at the compiled sequence_length")
        kwargs.pop("processing_kwargs", None)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"device={device!r}: this model was compiled for the CPU")
        if kwargs:
            raise ValueError(f"{type(self).__name__}.encode() has been called with additional keyword arguments "
                             f"that this model does not use: {list(kwargs)}. This model does not accept any "
                             "additional keyword arguments.")

    def _resolve_prompt(self, prompt, prompt_name):
        if prompt is None:
            if prompt_name is not None:
                if prompt_name not in self.prompts:
                    raise ValueError(f"Prompt name '{prompt_name}' not found in the configured prompts dictionary "
                                     f"with keys {list(self.prompts.keys())!r}.")
                prompt = self.prompts[prompt_name]
            elif self.default_prompt_name is not None:
                prompt = self.prompts.get(self.default_prompt_name)
        elif prompt_name is not None:
            log.warning("Provide either a `prompt`, a `prompt_name`, or neither, but not both. Ignoring the "
                        "`prompt_name` in favor of `prompt`.")
        return prompt

    def _tokenize(self, texts: list):
        limit = min(v for v in (self.static["sequence_length"], self.st.get("max_seq_length")) if v)
        return self.preprocessors[0](texts, padding=True, truncation="longest_first", max_length=limit,
                                     return_tensors="pt")

    def _features(self, texts: list, prompt) -> dict:
        """sentence-transformers' features of one batch: the tokenizer's tensors, ``modality``,
        ``prompt_length`` (with a prompt), ``token_embeddings`` and ``sentence_embedding``."""
        prompt_length = None
        if prompt:
            texts = [prompt + t for t in texts]
            ids = self._tokenize([prompt])["input_ids"]
            prompt_length = ids.shape[-1] - int(ids[0, -1].item() in self.preprocessors[0].all_special_ids)
        enc = dict(self._tokenize(texts))
        chunk = {k: v for k, v in enc.items() if k in self.input_names}
        rows, static = chunk["input_ids"].shape[0], self.static["batch_size"]
        outs = [self.forward(**{k: v[j:j + static] for k, v in chunk.items()}, prompt_length=prompt_length)
                for j in range(0, rows, static)]
        features = dict(enc, modality="text")
        if prompt_length is not None:
            features["prompt_length"] = prompt_length
        features["token_embeddings"] = torch.cat([o.token_embeddings for o in outs])
        features["sentence_embedding"] = torch.cat([o.sentence_embedding for o in outs])
        return features

    @staticmethod
    def _per_text(features: dict, output_value, normalize: bool) -> list:
        if output_value == "token_embeddings":
            out = []
            for emb, mask in zip(features["token_embeddings"], features["attention_mask"]):
                last = len(mask) - 1
                while last > 0 and mask[last].item() == 0:
                    last -= 1
                out.append(emb[:last + 1])
            return out
        if output_value is None:
            rows = len(features["input_ids"])
            return [{k: v[i] if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == rows else v
                     for k, v in features.items()} for i in range(rows)]
        emb = features["sentence_embedding"]
        return list(torch.nn.functional.normalize(emb, p=2, dim=1) if normalize else emb)

    # -- similarity ---------------------------------------------------------------------------

    def similarity(self, embeddings1, embeddings2) -> torch.Tensor:
        """Every row of ``embeddings1`` against every row of ``embeddings2`` with the model's
        ``similarity_fn_name`` (config_sentence_transformers.json; cosine by default): cosine,
        dot, or the negative euclidean or manhattan distance, as sentence-transformers'."""
        return st_modules.similarity(self.similarity_fn_name, embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2) -> torch.Tensor:
        """Row ``i`` of ``embeddings1`` against row ``i`` of ``embeddings2``, with the same function."""
        return st_modules.similarity(self.similarity_fn_name, embeddings1, embeddings2, pairwise=True)


def _quantize(embeddings, precision: str):
    try:
        from sentence_transformers.util import quantize_embeddings
    except ImportError:
        raise ValueError(f"precision={precision!r} quantizes with sentence-transformers' quantize_embeddings: "
                         "pip install sentence-transformers, or use precision='float32'") from None
    return quantize_embeddings(embeddings, precision=precision)


NeuronModelForSentenceTransformers = NeuronSentenceTransformers     # its name before Optimum Neuron 0.4.2
