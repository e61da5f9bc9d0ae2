"""Loading a decoder from a GGUF file (kiln.llm.source): the same weights transformers
loads, with the file's header read once instead of three times and each of its values
parsed once, and the gguf and transformers modules left as they were. A tiny Llama GGUF is written with gguf's own writer (tests/gguf_files.py)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from kiln.llm.source import load_pretrained  # noqa: E402
from tests import gguf_files  # noqa: E402


def test_gguf_loads_transformers_weights_parsing_the_file_once(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    gguf_files.write_llama(path, {}, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64)   # float32 tensors
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses = []

    def counting_reader(*args, **kwargs):
        parses.append(args[0])
        return real_reader(*args, **kwargs)
    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    # and each field's value parsed once, not on each of transformers' reads (SmolLM2's
    # 49,152-token vocabulary was parsed three times)
    from gguf import gguf_reader
    from transformers import modeling_gguf_pytorch_utils as utils
    real_parse, values = utils._gguf_parse_value, []

    def counting_parse(value, types):
        values.append(id(value))
        return real_parse(value, types)
    monkeypatch.setattr(utils, "_gguf_parse_value", counting_parse)
    model, tokenizer = load_pretrained(str(path))
    assert len(parses) == 1                   # transformers alone reads it for the config and the weights
    assert values and len(values) == len(set(values))
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is real_map      # put back
    assert utils._gguf_parse_value is counting_parse and gguf_reader.np is __import__("numpy")
    monkeypatch.setattr(gguf, "GGUFReader", real_reader)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                             dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    got, ref = model.state_dict(), want.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert tokenizer is None                  # no vocabulary in this file: the graphs still compile


def test_a_file_missing_a_weight_is_refused_not_filled_with_random_values(tmp_path):
    """A GGUF (or checkpoint) without one of the model's matrices loaded with transformers'
    fresh random initialisation in its place, only a printed report saying so, and compiled
    (the accuracy gate's reference is the same broken model); found by probing."""
    from kiln.errors import UnsupportedModelError
    tensors = gguf_files.llama_tensors(2, 16, 2, 1, 32, 64)
    del tensors["blk.1.ffn_down.weight"]
    gguf_files.write_llama(tmp_path / "holed.GGUF", {}, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64,
                           tensors=tensors)                      # the extension in capitals is taken too
    with pytest.raises(UnsupportedModelError, match=r"1 weight\(s\) the model needs are not in it "
                                                    r"\(model\.layers\.1\.mlp\.down_proj\.weight\)"):
        load_pretrained(str(tmp_path / "holed.GGUF"))
    # a tensor of another shape than the metadata's model (K with 2 heads where the file says
    # 1): transformers' own error named none ("You set ignore_mismatched_sizes to False ...
    # look at the above report!"); found by probing
    import numpy as np
    tensors = gguf_files.llama_tensors(2, 16, 2, 1, 32, 64)
    tensors["blk.0.attn_k.weight"] = np.zeros((16, 16), np.float32)
    gguf_files.write_llama(tmp_path / "wrong.gguf", {}, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=64,
                           tensors=tensors)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight is \(16, 16\) in "
                                                    r"the file, \(8, 16\) in the model"):
        load_pretrained(str(tmp_path / "wrong.gguf"))
