"""An encoder artifact served as text embeddings: tokenizer, padding to the compiled shapes,
and pooling, as sentence-transformers computes them.

A ``.kiln`` traced from a Hugging Face encoder (``kiln.trace(AutoModel..., {"input_ids",
"attention_mask"[, "token_type_ids"]})``) holds the graph only: no tokenizer and no pooling.
The server gets both from the model's own directory, named per model on the command line
(``kiln serve minilm.kiln --embeddings minilm=DIR``): a sentence-transformers or Hugging
Face directory with ``tokenizer.json``, and, when it is a sentence-transformers one, its
``modules.json`` (whether a ``Normalize`` module follows the pooling),
``<Pooling>/config.json`` (mean, CLS or max pooling) and ``sentence_bert_config.json``
(``max_seq_length``). A plain Hugging Face directory gets mean pooling, not normalized.

Each request's texts are tokenized (special tokens added, no truncation: a text longer
than the model takes is refused), sorted by length and cut into batches of the rows the
artifact takes (its compiled batch, padded with copies of a row; any number with
``dynamic_batch``), each padded to the smallest compiled sequence length that holds its
longest text (the buckets of ``input_ids`` dim 1, or its one static length) with the
tokenizer's pad id and attention mask 0. The encoder's last hidden state is pooled over
the attention mask, so padding never counts; a model whose first output is already one
vector per row (a whole sentence-transformers pipeline traced) is taken as pooled.
"""
from __future__ import annotations

import os

import torch

from kiln.errors import InputError, KilnError
from kiln.runtime.pooling import pool, pooling_of
from kiln.runtime.text import Tokenizer

__all__ = ["Embedder", "Plan", "pooling_of"]

class Embedder:
    """How texts become one served encoder's embeddings (module doc)."""

    def __init__(self, name: str, directory: str):
        if not os.path.isdir(directory):
            raise KilnError(f"--embeddings {name}={directory}: not a directory (give the model's "
                            "sentence-transformers or Hugging Face directory, with its tokenizer.json)")
        files = {}
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(directory, f)):
                with open(os.path.join(directory, f), "rb") as fh:
                    files[f] = fh.read()
        if "tokenizer.json" not in files:
            raise KilnError(f"--embeddings {name}={directory}: no tokenizer.json there (save the tokenizer "
                            "with save_pretrained, a fast tokenizer)")
        self.name, self.directory = name, directory
        self.tokenizer = Tokenizer(files)
        self.tokenizer.backend.no_truncation()
        self.tokenizer.backend.no_padding()
        self.pad_id = self.tokenizer.token_id("pad_token") or 0
        self.mode, self.normalize, self.max_seq_length = pooling_of(directory)
        self.vocab = self.tokenizer.backend.get_vocab_size(with_added_tokens=True)
        self.plan = None            # how the loaded model is called (bind, at the first request)

    def describe(self) -> str:
        return f"{self.mode} pooling" + (", normalized" if self.normalize else "")

    # -- the model -------------------------------------------------------------------------
    def bind(self, sm):
        """Read the served model's inputs (once it is loaded): which flat input is which,
        the sequence lengths it was compiled for, the rows per call."""
        if self.plan is None:
            self.plan = Plan(sm)
        return self.plan

    def tokenize(self, inputs: list) -> list:
        """Each input (a string or token ids) as token ids."""
        out = []
        for x in inputs:
            if isinstance(x, str):
                out.append(self.tokenizer.encode(x))
            else:
                if not all(0 <= t < self.vocab for t in x):
                    raise InputError(f"token ids must be in [0, {self.vocab}) (the tokenizer's vocabulary)")
                out.append(list(x))
        return out

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[rows, S, H]`` (or ``[rows, H]``, already pooled) -> ``[rows, H]``, as
        sentence-transformers' Pooling (and Normalize) modules compute it."""
        return pool(hidden, mask, self.mode, self.normalize)


class Plan:
    """Which flat input is which, and the shapes a served encoder takes (module doc)."""

    def __init__(self, sm):
        model, layout = sm.instances[0], sm.layout
        names = [s.name for s in model.input_specs]
        if "input_ids" not in names or "attention_mask" not in names:
            raise InputError(f"model '{sm.name}' takes inputs {names}; /v1/embeddings serves encoders traced "
                             "with input_ids and attention_mask (and optionally token_type_ids)")
        extra = [n for n in names if n not in ("input_ids", "attention_mask", "token_type_ids")]
        if extra:
            raise InputError(f"model '{sm.name}' takes inputs {extra} that /v1/embeddings cannot fill")
        self.names, self.specs = names, model.input_specs
        ids = names.index("input_ids")
        self.lengths = [self.specs[ids].shape[1]]
        for ax in layout.axes:
            if (ids, 1) in [tuple(m) for m in ax.inputs]:
                self.lengths = list(ax.sizes)
        self.batchable = layout.batchable
        self.rows = (layout.max_rows or sm.config.max_batch_size or 1) if self.batchable else self.specs[ids].shape[0]
        self.rows = max(1, int(self.rows))
        self.max_length = max(self.lengths)

    def length_for(self, n: int) -> int:
        return next(s for s in self.lengths if s >= n)

    def batches(self, tokens: list, pad_id: int) -> list:
        """``[(row indices, flat inputs, rows)]``: the texts sorted by length, cut into the
        rows a call takes, each batch padded to its sequence length (module doc)."""
        order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]))
        out = []
        for start in range(0, len(order), self.rows):
            idx = order[start:start + self.rows]
            length = self.length_for(max(len(tokens[i]) for i in idx))
            rows = len(idx) if self.batchable else self.rows
            ids = torch.full((rows, length), pad_id, dtype=torch.long)
            mask = torch.zeros((rows, length), dtype=torch.long)
            for r in range(rows):
                t = tokens[idx[min(r, len(idx) - 1)]]      # a static batch's spare rows: copies
                ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
                mask[r, :len(t)] = 1
            named = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
            flat = [named[n].to(s.dtype) for n, s in zip(self.names, self.specs)]
            out.append((idx, flat, rows if self.batchable else 1))
        return out


def load_embedders(spec: dict, models: dict) -> dict:
    """``{model name: Embedder}`` for ``--embeddings name=DIR`` (read now, so that a wrong
    directory stops the server before it listens)."""
    out = {}
    for name, directory in (spec or {}).items():
        sm = models.get(name)
        if sm is None:
            raise KilnError(f"--embeddings names model '{name}', which is not served (served: "
                            f"{', '.join(models) or 'none'})")
        if getattr(sm, "kind", None) == "llm":
            raise KilnError(f"--embeddings: '{name}' is an LLM; /v1/embeddings serves encoder artifacts")
        out[name] = Embedder(name, os.fspath(directory))
    return out
