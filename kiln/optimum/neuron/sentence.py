"""Optimum Neuron's ``NeuronSentenceTransformers`` (before 0.4.2 ``NeuronModelForSentenceTransformers``):
a sentence-transformers directory's encoder compiled at static shapes, its pooling (and
normalization) applied to the trimmed token embeddings as sentence-transformers' own modules
apply them (:mod:`kiln.runtime.pooling`), read from the directory's ``modules.json`` at export and
kept in the saved ``neuron`` section. Outputs ``token_embeddings`` and ``sentence_embedding``;
``encode`` and ``similarity`` as sentence-transformers'.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from kiln.optimum.neuron.modeling import NeuronTracedModel
from kiln.runtime import pooling


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

    @classmethod
    def _export(cls, path, config=None, **kwargs):
        mode, normalize, max_seq_length = pooling.pooling_of(path)
        model = super()._export(path, config, **kwargs)
        model.neuron.update(library_name=cls.library_name, pooling_mode=mode, normalize=normalize,
                            max_seq_length=max_seq_length)
        return model

    @classmethod
    def _load(cls, path, file_name):
        model = super()._load(path, file_name)
        if model.neuron.get("library_name") != cls.library_name:
            from kiln.errors import ArtifactError
            raise ArtifactError(f"{path} was exported as a plain feature-extraction model; load it with "
                                "NeuronModelForFeatureExtraction, or export the sentence-transformers "
                                "directory with this class")
        return model

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        ids = torch.as_tensor(input_ids)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)
        hidden = super().forward(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids,
                                 **kwargs).last_hidden_state
        pooled = pooling.pool(hidden, mask, self.neuron["pooling_mode"], self.neuron["normalize"])
        return _output_class()(token_embeddings=hidden, sentence_embedding=pooled)

    def encode(self, sentences, batch_size: int = 32, convert_to_numpy: bool = True,
               convert_to_tensor: bool = False, normalize_embeddings: bool = False, show_progress_bar=None,
               **kwargs):
        """sentence-transformers' ``encode``: one embedding per sentence (a 1-D one for a lone
        string), texts cut at the compiled sequence length (and the model's ``max_seq_length``)."""
        if not self.preprocessors:
            raise ValueError("this model has no tokenizer (none was saved beside it): tokenize the texts and "
                             "call the model")
        tokenizer = self.preprocessors[0]
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        limit = min(v for v in (self.static["sequence_length"], self.neuron.get("max_seq_length")) if v)
        out = []
        for i in range(0, len(texts), max(1, batch_size)):
            enc = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=limit,
                            return_tensors="pt")
            chunk = {k: v for k, v in enc.items() if k in self.input_names}
            out.append(self._encode_rows(chunk))
        emb = torch.cat(out) if out else torch.empty(0)
        if normalize_embeddings:
            emb = torch.nn.functional.normalize(emb, p=2, dim=1)
        if single:
            emb = emb[0]
        if convert_to_tensor:
            return emb
        return emb.numpy() if convert_to_numpy else list(emb)

    def _encode_rows(self, chunk: dict) -> torch.Tensor:
        rows, static = chunk["input_ids"].shape[0], self.static["batch_size"]
        parts = [self.forward(**{k: v[j:j + static] for k, v in chunk.items()}).sentence_embedding
                 for j in range(0, rows, static)]
        return torch.cat(parts)

    @staticmethod
    def similarity(a, b) -> torch.Tensor:
        """Cosine similarity of every row of ``a`` with every row of ``b`` (sentence-transformers'
        default similarity)."""
        a, b = (torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x) for x in (a, b))
        a, b = (x.unsqueeze(0) if x.dim() == 1 else x for x in (a, b))
        return torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(b, dim=1).T


NeuronModelForSentenceTransformers = NeuronSentenceTransformers     # its name before Optimum Neuron 0.4.2
