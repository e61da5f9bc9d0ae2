"""Loading a decoder from a GGUF file (kiln.llm.source): the same weights transformers
loads, with the file's header parsed once instead of three times, and the gguf module
left as it was. A tiny Llama GGUF is written here with gguf's own writer."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kiln.llm.source import load_pretrained  # noqa: E402


def _write_tiny_llama(path, layers=2, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    head = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * head, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * head),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_transformers_weights_parsing_the_file_once(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path)
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses = []

    def counting_reader(*args, **kwargs):
        parses.append(args[0])
        return real_reader(*args, **kwargs)
    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    model, tokenizer = load_pretrained(str(path))
    assert len(parses) == 1                   # transformers alone reads it for the config and the weights
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is real_map      # put back
    monkeypatch.setattr(gguf, "GGUFReader", real_reader)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                             dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    got, ref = model.state_dict(), want.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert tokenizer is None                  # no vocabulary in this file: the graphs still compile
