"""An LLM compiled into one .kiln artifact (prefill per context bucket + decode), saved,
loaded in a fresh process without the model's code, and generating Hugging Face's tokens."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.errors import CompilerArgsError, InputError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from tests.conftest import run_py  # noqa: E402
from tests.test_llm_decoder import PROMPTS, _hf_greedy, _model  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tiny_llm):
    return tiny_llm


def test_artifact_generates_hugging_face_tokens_in_a_fresh_process(compiled, tmp_path):
    model, llm, path = compiled
    expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    assert llm.meta["eos_token_ids"] == []       # the test model's eos is off (see _model)
    code = f"""
import json, sys, kiln
m = kiln.load({str(path)!r})
print(repr(m))
print(json.dumps(m.generate({PROMPTS!r}, 12)))
print(json.dumps(m.generate([[3, 1, 4]], 5)))
assert not any(k.startswith(('transformers', 'tests')) for k in sys.modules), 'model code imported'
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "context buckets [4, 8]" in lines[0]
    assert json.loads(lines[1]) == expected
    assert json.loads(lines[2]) == [_hf_greedy(model, [3, 1, 4], 5)]      # fewer rows than the batch


def test_bad_requests_are_clear_errors(compiled):
    _, llm, _ = compiled
    with pytest.raises(InputError, match="longer than the largest context bucket \\(8\\)"):
        llm.generate([list(range(1, 10))], 2)
    with pytest.raises(InputError, match="max_new_tokens must be at least 1"):
        llm.generate([[1]], 0)
    with pytest.raises(InputError, match="exceed the compiled cache of 32"):
        llm.generate([[1, 2]], 31)
    with pytest.raises(InputError, match="at least one token"):
        llm.generate([[]], 2)


def test_generate_arguments_are_checked_or_read_as_meant(compiled):
    """``max_new_tokens`` is an integer: 2.5 gave 3 tokens (``hf_generate`` gave 2), True
    gave 1, "3" a TypeError. The prompts are a list of id lists or a 2-D integer tensor,
    a row per prompt (a tensor was "Boolean value of Tensor ... is ambiguous"); a flat list
    is an error naming the spelling (it was "'int' object is not iterable"), a dict of
    params one naming SamplingParams (it was an AttributeError)."""
    import numpy as np
    _, llm, _ = compiled
    want = llm.generate([[5, 17, 3], [9, 4]], 3, stop_at_eos=False)
    for n in (2.5, True, "3", None):
        with pytest.raises(InputError, match="max_new_tokens must be an integer"):
            llm.generate([[5, 17, 3]], n)
    assert llm.generate([[5, 17, 3]], np.int64(3), stop_at_eos=False) == want[:1]
    assert llm.generate(torch.tensor([[5, 17, 3]]), 3, stop_at_eos=False) == want[:1]
    assert llm.generate(np.array([[5, 17, 3]]), 3, stop_at_eos=False) == want[:1]
    assert llm.generate(([5, 17, 3], torch.tensor([9, 4])), 3, stop_at_eos=False) == want
    for bad, msg in [([5, 17, 3], r"one flat list of ids: for one prompt give \[\[5, 17, 3\]\]"),
                     (torch.tensor([5, 17, 3]), r"\[batch, tokens\].*one prompt is \[1, tokens\]"),
                     (torch.tensor([[5.0, 17.0]]), "token ids must be integers"),
                     ([[5, 17], 3], "a prompt is a list of token ids; got 3"),
                     ("hello", "list of prompts"), ([], "at least one prompt"),
                     (torch.zeros(0, 3, dtype=torch.long), "at least one prompt"),
                     (torch.zeros(1, 0, dtype=torch.long), "at least one token")]:
        with pytest.raises(InputError, match=msg):
            llm.generate(bad, 2)
    with pytest.raises(InputError, match=r"SamplingParams\(\*\*params\)"):
        llm.generate([[5, 17, 3]], 2, params={"do_sample": True})


def test_bad_compile_options_are_clear_errors():
    model = _model("llama")
    with pytest.raises(CompilerArgsError, match="exceeds cache_length"):
        compile_llm(model, context_buckets=(64,), cache_length=32)
    with pytest.raises(kiln.errors.UnsupportedModelError):
        compile_llm(torch.nn.Linear(2, 2))
    with pytest.raises(CompilerArgsError, match="exceeds the 128 positions GPT2LMHeadModel has learned"):
        compile_llm(_model("gpt2"), context_buckets=(8,), cache_length=256)
    # 0 compiled no verify (chunk) graph without a word while -1 was an error; a float size was a
    # TypeError (batch_size) or cut to an int (a bucket); all are refused before compiling anything
    for kw, msg in [({"speculation_length": 0}, "speculation_length must be a positive integer, or None"),
                    ({"prefill_chunk": 0}, "prefill_chunk must be a positive integer, or None"),
                    ({"speculation_length": 2.0}, "speculation_length must be a positive integer"),
                    ({"batch_size": 1.5}, "batch_size must be a positive integer; got 1.5"),
                    ({"batch_size": 0}, "batch_size must be a positive integer"),
                    ({"cache_length": "32"}, "cache_length must be a positive integer"),
                    ({"context_buckets": (4.5,)}, "a context bucket must be a positive integer; got 4.5"),
                    ({"decode_batches": (0,)}, "a decode batch must be a positive integer"),
                    # found by probing: truncated (8.9 a window of 8, True of 1), silently taken
                    # (workers=0) or a raw TypeError (a bare int)
                    ({"sequence_buckets": (8.9,)}, "a sequence bucket must be a positive integer; got 8.9"),
                    ({"sequence_buckets": (True,)}, "a sequence bucket must be a positive integer; got True"),
                    ({"context_buckets": 4}, r"context_buckets must be a list of sizes, such as \(4,\)"),
                    ({"workers": 0}, "workers must be a positive integer; got 0")]:
        with pytest.raises(CompilerArgsError, match=msg):
            compile_llm(model, **{"context_buckets": (4,), "cache_length": 16, **kw})


def test_hugging_face_generate_signature_with_left_padding_and_eos(compiled):
    """``hf_generate(input_ids, attention_mask, generation_config)`` returns what
    transformers' ``generate`` returns for a left-padded batch, rows ending at EOS padded."""
    model, llm, _ = compiled
    ids = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8], [0, 0, 0, 60, 61]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    config = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, generation_config=config)
    got = llm.hf_generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(got, want)
    assert (want[:, 5:] == 2).any()                     # a row did stop at EOS
    assert llm.hf_generate(ids[:1, 2:], max_new_tokens=3).shape == (1, 6)
    with pytest.raises(InputError, match="settings kiln does not know"):
        llm.hf_generate(ids, attention_mask=mask, beam_width=4)


def test_hugging_face_lengths_and_settings_kiln_does_not_do(compiled):
    """``max_length`` (the prompt's padded width plus the new tokens; 20 new tokens when no
    length is set) as transformers counts it, from an override or the config, and ``max_new_tokens``
    over it; settings that would change the tokens and that kiln does not implement are
    errors naming them. Before: ``max_length`` was an unknown setting, a config's was
    ignored (20 new tokens whatever it said), and a config's ``num_beams=4`` decoded
    greedily without a word."""
    model, llm, _ = compiled
    ids = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    base = dict(do_sample=False, eos_token_id=2, pad_token_id=0)
    cases = [(transformers.GenerationConfig(**base), {}),                              # 20 new tokens
             (transformers.GenerationConfig(max_length=9, **base), {}),
             (transformers.GenerationConfig(**base), {"max_length": 12}),
             (transformers.GenerationConfig(max_length=30, **base), {"max_new_tokens": 4})]
    for config, kwargs in cases:
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        got = llm.hf_generate(ids, attention_mask=mask, generation_config=config, **kwargs)
        assert torch.equal(got, want), (config.max_length, kwargs)
    assert llm.hf_generate(ids, attention_mask=mask, max_length=8).shape == (2, 8)
    with pytest.raises(InputError, match="num_beams=4"):
        llm.hf_generate(ids, attention_mask=mask, generation_config=transformers.GenerationConfig(num_beams=4))
    with pytest.raises(InputError, match="no_repeat_ngram_size=3"):
        llm.hf_generate(ids, attention_mask=mask, no_repeat_ngram_size=3)
    with pytest.raises(InputError, match="max_length is 5"):
        llm.hf_generate(ids, attention_mask=mask, max_length=5)
    # a refused setting at its default is harmless, and None is a setting's default, as there
    assert llm.hf_generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=2).shape == (2, 7)
    assert llm.hf_generate(ids, attention_mask=mask, temperature=None, max_new_tokens=2).shape == (2, 7)
    for n in (2.5, "2", True):
        with pytest.raises(InputError, match="max_new_tokens must be an integer"):
            llm.hf_generate(ids, attention_mask=mask, max_new_tokens=n)
    with pytest.raises(InputError, match="max_length must be an integer"):
        llm.hf_generate(ids, attention_mask=mask, max_length=9.0)
    from kiln.runtime import hf_settings
    # a setting no list here names is refused when set, in a config or as an override: until
    # 12-03 a config's exponential_decay_length_penalty was not read (transformers stopped
    # after 5 tokens, kiln generated 10)
    for setting in ({"exponential_decay_length_penalty": (1, 3.0)}, {"top_h": 0.3}, {"dola_layers": "low"},
                    {"max_time": 0.5}, {"token_healing": True}):
        name = next(iter(setting))
        config = transformers.GenerationConfig(max_new_tokens=4, pad_token_id=0, **setting)
        with pytest.raises(InputError, match=f"does not do {name}="):
            llm.hf_generate(ids, attention_mask=mask, generation_config=config)
        with pytest.raises(InputError, match=f"does not do {name}="):
            llm.hf_generate(ids, attention_mask=mask, max_new_tokens=4, **setting)
    with pytest.raises(InputError, match="settings kiln does not know: \\['no_such_setting'\\]"):
        llm.hf_generate(ids, attention_mask=mask, no_such_setting=1)
    # settings that change no token still pass, in a config too
    config = transformers.GenerationConfig(max_new_tokens=4, pad_token_id=0, bos_token_id=1, length_penalty=2.0,
                                           cache_implementation="static", renormalize_logits=True,
                                           token_healing=False)          # a switch left off
    assert hf_settings._is_default("num_beams", 1) and hf_settings._is_default("dola_layers", None)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0, do_sample=False)
    assert torch.equal(llm.hf_generate(ids, attention_mask=mask, generation_config=config), want)


def test_hugging_face_greedy_calls_transformers_accepts(compiled):
    """transformers ignores the sampling settings when ``do_sample=False`` and takes values
    that change nothing (``min_new_tokens=0``, ``suppress_tokens=[]``, ``use_cache``):
    each was an InputError (``temperature must be > 0``, "not implemented", "unknown
    setting"). The same tokens as transformers' ``generate``; an eos id of NumPy's counts."""
    import numpy as np
    model, llm, _ = compiled
    ids = torch.tensor([[0, 0, 5, 17, 3], [11, 2, 9, 4, 8]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0]])).long()
    base = dict(attention_mask=mask, max_new_tokens=4, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, **base)
    for kw in ({"do_sample": False, "temperature": 0.0}, {"do_sample": False, "top_p": 0.0},
               {"do_sample": False, "top_k": -1, "temperature": -1.0, "seed": 1.5},
               {"min_new_tokens": 0}, {"suppress_tokens": []}, {"begin_suppress_tokens": ()},
               {"use_cache": True}, {"use_cache": False}, {"min_p": 0.0}, {"guidance_scale": 1.0}):
        hf = {k: v for k, v in kw.items() if k != "seed"}        # kiln's own setting
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **{"do_sample": False, **base, **hf}), want), kw
        assert torch.equal(llm.hf_generate(ids, **{**base, **kw}), want), kw
    with pytest.raises(InputError, match="temperature must be > 0"):       # sampling reads it
        llm.hf_generate(ids, do_sample=True, temperature=0.0, **base)
    with pytest.raises(InputError, match="min_new_tokens=2"):
        llm.hf_generate(ids, min_new_tokens=2, **base)
    with pytest.raises(InputError, match="suppress_tokens=\\[5\\]"):
        llm.hf_generate(ids, suppress_tokens=[5], **base)
    eos = int(want[0, 6])
    with torch.no_grad():
        stopped = model.generate(ids, do_sample=False, eos_token_id=eos, **base)
    for spelling in (np.int64(eos), torch.tensor(eos), [np.int32(eos)], np.array([eos])):
        assert torch.equal(llm.hf_generate(ids, eos_token_id=spelling, **base), stopped), spelling


class _Recording:
    """transformers' streamer protocol, recorded: put(tensor) per piece, end() once."""

    def __init__(self):
        self.pieces, self.ended = [], 0

    def put(self, value):
        self.pieces.append((tuple(value.shape), value.tolist()))

    def end(self):
        self.ended += 1


def test_hugging_face_streamer_gets_what_transformers_gives_it(compiled, capsys):
    """``hf_generate(streamer=)`` (behind transformers-neuronx's and NxD Inference's HF
    adapters) was an unknown setting. transformers' ``TextStreamer`` prints the text
    transformers' ``generate`` prints, and a recording streamer gets the same pieces in the
    same shapes (the input ids, then each token), sampled as well as greedy; several rows
    are refused, as transformers' streamers refuse them."""
    from transformers import TextStreamer

    from tests.conftest import tiny_tokenizer
    model, llm, _ = compiled
    ids = torch.tensor([[5, 17, 3, 88]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=2)
    theirs, ours = _Recording(), _Recording()
    with torch.no_grad():
        want = model.generate(ids, streamer=theirs, **kw)
    assert torch.equal(llm.hf_generate(ids, streamer=ours, **kw), want)
    assert ours.pieces == theirs.pieces and ours.ended == theirs.ended == 1
    assert len(ours.pieces) == want.shape[1] - 3            # the prompt, then each new token
    tok = tiny_tokenizer()
    with torch.no_grad():
        model.generate(ids, streamer=TextStreamer(tok, skip_prompt=True), **kw)
    printed = capsys.readouterr().out
    llm.hf_generate(ids, streamer=TextStreamer(tok, skip_prompt=True), **kw)
    assert capsys.readouterr().out == printed and printed.strip()
    sampled, plain = _Recording(), None
    settings = dict(max_new_tokens=6, do_sample=True, top_k=20, temperature=1.5, seed=3)
    plain = llm.hf_generate(ids, **settings)
    assert torch.equal(llm.hf_generate(ids, streamer=sampled, **settings), plain)
    assert [p[1] for p in sampled.pieces[1:]] == [[t] for t in plain[0, 4:].tolist()] and sampled.ended == 1
    refused = _Recording()
    with pytest.raises(InputError, match="a streamer takes one sequence"):
        llm.hf_generate(ids.repeat(2, 1), streamer=refused, max_new_tokens=2)
    with pytest.raises(InputError, match="longer than the largest context bucket"):
        llm.hf_generate(torch.arange(3, 13).unsqueeze(0), streamer=refused, max_new_tokens=2)
    assert refused.pieces == [] and refused.ended == 0         # nothing streamed for a call that cannot run


def test_generate_calls_reuse_one_zeroed_kv_cache(compiled):
    """Each ``generate`` call's cache takes the LLM's kept buffers (kiln.runtime.kv.CacheMemory)
    instead of allocating them, zeroed first: stale values from an earlier call, even NaN,
    never reach a later one, whose tokens stay Hugging Face's."""
    import copy

    from kiln.runtime import kv
    model, shared, _ = compiled
    # the session's LLM with memory of its own: a scheduler another test left alive would hold
    # the shared one's buffers
    llm = copy.copy(shared)
    llm.cache_memory = kv.CacheMemory("cpu")
    expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    keys, values = llm.cache_memory._buffers
    address = keys.data_ptr()
    keys.fill_(float("nan"))            # what a call that overflowed might leave behind
    values.fill_(float("nan"))
    assert llm.generate(PROMPTS, 12, stop_at_eos=False) == expected
    assert llm.cache_memory._buffers[0].data_ptr() == address          # the same memory, not a new one
    held = llm.scheduler()              # a live cache: the next call gets buffers of its own
    assert held.cache.keys.data_ptr() == address and not held.cache.keys.isnan().any()
    assert llm.generate(PROMPTS[:1], 12, stop_at_eos=False) == expected[:1]
    del held


def test_a_cache_shape_that_disagrees_with_the_graphs_is_refused_at_load(compiled, tmp_path):
    """``llm.cache_shape`` is what generation allocates: edited to 2^31 positions the artifact
    loaded and its first generate asked for 137 GB; to 2^20 it failed with an InputError
    blaming the prompt. Load compares it with the decode graphs' cache inputs."""
    import zipfile
    _, _, path = compiled
    shape = json.loads(zipfile.ZipFile(path).read("manifest.json"))["llm"]["cache_shape"]
    for changed in ([*shape[:3], 1 << 31, shape[4]], [shape[0], shape[1], shape[2] + 1, *shape[3:]]):
        bad = tmp_path / "bad.kiln"
        with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bad, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item)
                if item.filename == "manifest.json":
                    m = json.loads(data)
                    m["llm"]["cache_shape"] = changed
                    data = json.dumps(m).encode()
                if item.filename != "signature.json":
                    zout.writestr(item.filename, data)
        with pytest.raises(kiln.ArtifactError, match=rf"llm.cache_shape \[{', '.join(map(str, changed))}\] does "
                                                     r"not match the decode/\d+.kiln graph"):
            kiln.load(bad)



def test_a_kv_cache_larger_than_memory_is_a_kiln_error_naming_its_size(compiled):
    """Found by probing: a KV cache no memory holds (an LLM compiled for more rows or positions
    than this host has memory for) ended in torch's "DefaultCPUAllocator: can't allocate
    memory" RuntimeError, or in the out-of-memory killer. It is checked before allocating.
    (The first generate's batch-invariance probe, kiln/runtime/invariance.py, allocates a
    cache-sized probe of its own before: that is done here on the real shape first.)"""
    import copy

    from kiln.errors import KilnError
    from kiln.runtime import kv
    model, shared, _ = compiled
    expected = shared.generate([[1, 2]], 2, stop_at_eos=False)
    assert expected == [_hf_greedy(model, [1, 2], 2)]
    llm = copy.copy(shared)
    layers, rows, heads, _, dim = shared.meta["cache_shape"]
    huge = [layers, rows, heads, 1 << 40, dim]
    llm.meta = dict(shared.meta, cache_shape=huge)
    llm.cache_memory = kv.CacheMemory("cpu")
    need = 2 * layers * rows * heads * (1 << 40) * dim * 4
    message = (rf"KV cache \(keys and values\) of shape \[{', '.join(map(str, huge))}\] .* needs {need} bytes "
               r".* available\. .*--batch-size or --cache-length")
    with pytest.raises(KilnError, match=message):
        llm.generate([[1, 2]], 2)
    assert llm.cache_memory._buffers is None
    with pytest.raises(KilnError, match=message):
        kv.KVCache(tuple(huge))                     # a cache with no LLM memory to take (drafters)
    assert shared.generate([[1, 2]], 2, stop_at_eos=False) == expected


def test_the_batch_invariance_probe_checks_its_cache_sized_rows_first():
    """Found by probing: the first generate's batch-invariance probe allocates cache-sized rows
    of its own before the KV cache, so an LLM whose cache no memory holds ended there in the
    allocator's raw RuntimeError; the probe checks the size first, as the KV cache does."""
    from kiln.errors import KilnError
    from kiln.runtime import invariance

    def never(*args):
        raise AssertionError("the probe ran a graph")
    with pytest.raises(KilnError, match=r"KV cache \(keys and values\) .* needs .* available\. .*--cache-length"):
        invariance.probe({1: never}, (2, 1, 2, 1 << 40, 8), 1 << 40)
