"""A decoder step on ONNX Runtime's fused operators (kiln.engines.ort_decoder): the rotary
embeddings, the cached attention and the residual norms of kiln's decode step are
rewritten into RotaryEmbedding, GroupQueryAttention and SkipSimplifiedLayerNormalization.
The step equals eager PyTorch for the masks the runtime makes (each row's valid slots a
prefix, rows of different lengths, an empty row riding along), and writes each row's new
key and value into the cache it was given at the row's next slot and nowhere else (an
empty row's at its last slot)."""
import threading
import weakref

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.compiler.api import trace  # noqa: E402
from kiln.engines import onnx_model, onnxruntime as ort_engine  # noqa: E402
from kiln.llm.build import _decode_example  # noqa: E402
from kiln.llm.decoder import DecoderStep, cache_shape  # noqa: E402
from tests.conftest import assert_close  # noqa: E402
from tests.test_llm_decoder import _model  # noqa: E402


def _header(compiled):
    blob = compiled._artifact.blobs[compiled.manifest["partitions"][0]["blob"]]
    return ort_engine.header_of(blob), ort_engine.graph_of(blob)


@pytest.mark.parametrize("export", ["exporter-optimized", "large"])
def test_decode_step_on_fused_operators_equals_eager_for_any_mask(monkeypatch, export):
    if export == "large":      # a real decoder's graphs skip the exporter's optimizer: rotary written out
        monkeypatch.setattr(onnx_model, "EXPORTER_OPTIMIZE_MAX_OPS", 0)
    model = _model("llama").eval()
    rows, slots = 3, 16
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    compiled = trace(step, _decode_example(cache_shape(model.config, rows, slots), rows), optlevel=1,
                     engine="onnxruntime", cache=False)
    header, graph = _header(compiled)
    fused = header.get("decoder_fusions", {})
    assert fused.get("attention") == 2 and fused.get("skip_norm", 0) >= 3, fused
    if export == "large":
        assert fused.get("rotary") == 4, fused
    ops = {n.op_type for n in graph.graph.node}
    assert {"GroupQueryAttention", "RotaryEmbedding"} <= ops and "Softmax" not in ops, ops
    torch.manual_seed(1)
    for trial in range(3):
        lengths = torch.tensor([5 + trial, 0, slots - 1])[torch.randperm(rows)]
        valid = torch.arange(slots).unsqueeze(0) < lengths.unsqueeze(1)
        cache = [torch.randn(rows, 2, slots, 8) for _ in range(4)]
        before = [c.clone() for c in cache]
        inputs = (torch.randint(0, 97, (rows, 1)), lengths.unsqueeze(1).clone(), *cache, valid)
        with torch.no_grad():
            expected = step(*inputs)
        got = compiled(*inputs)
        live = lengths > 0
        for g, e in zip(got, expected):
            assert_close(g[live] if g.shape[0] == rows else g[:, live], e[live] if e.shape[0] == rows else e[:, live],
                         atol=1e-4, rtol=1e-4)
        for layer, (c, b) in enumerate(zip(cache, before)):
            new = got[1 + layer // 2][layer % 2]               # [rows, H_kv, 1, D]: this layer's new keys or values
            for row in range(rows):
                slot = int(lengths[row]) if lengths[row] > 0 else slots - 1
                assert torch.equal(c[row, :, slot], new[row, :, 0]) or lengths[row] == 0
                others = torch.ones(slots, dtype=torch.bool)
                others[slot] = False
                assert torch.equal(c[row][:, others], b[row][:, others]), (layer, row)


def test_prefill_and_multi_token_steps_keep_their_attention(tiny_llm):
    """GroupQueryAttention takes one new token per row with a past (or one row); the
    prefill graphs have no cache and keep attention as it was."""
    _, llm, _ = tiny_llm
    for rows, model in llm.decode.items():
        assert _header(model)[0]["decoder_fusions"]["attention"] == 2, rows
    for width, model in llm.prefill.items():
        assert "attention" not in _header(model)[0].get("decoder_fusions", {}), width


def test_an_llms_graphs_skip_the_exporters_optimizer_as_a_real_ones_do(tiny_llm):
    """compile_llm exports every step graph without torch's exporter optimizer
    (onnx_model.decoder_graphs), as a real LLM's graphs, over EXPORTER_OPTIMIZE_MAX_OPS, always
    were: this tiny model's are under the limit, and took the optimizer's path before."""
    _, llm, _ = tiny_llm
    for graphs in (llm.prefill, llm.decode):
        for key, model in graphs.items():
            assert _header(model)[0]["exporter_optimized"] is False, key
    for rows, model in llm.decode.items():     # kiln's rotary fusion, which the optimizer's output skips
        assert _header(model)[0]["decoder_fusions"].get("rotary") == 4, rows


def test_steps_on_the_same_buffers_read_them_as_they_are_now():
    """The runner keeps its binding of the cache between calls (the scheduler hands the same
    views at every step, and then skips even checking the binding): buffers changed in place
    since the last call, a buffer replaced by another, the same tensor given new memory, and
    a non-contiguous input are each read as they are at this call."""
    model = _model("llama").eval()
    rows, slots = 2, 8
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    compiled = trace(step, _decode_example(cache_shape(model.config, rows, slots), rows), optlevel=1,
                     engine="onnxruntime", cache=False)
    assert _header(compiled)[0]["decoder_fusions"].get("attention") == 2
    assert compiled.program.direct is not None          # the inputs go straight to the graph
    torch.manual_seed(2)
    cache = [torch.randn(rows, 2, slots, 8) for _ in range(4)]
    tokens, lengths = torch.zeros(rows, 1, dtype=torch.int64), torch.zeros(rows, 1, dtype=torch.int64)
    valid = torch.zeros(rows, slots, dtype=torch.bool)
    for trial in range(6):
        for c in cache:
            c.copy_(torch.randn_like(c))                      # same memory, new values
        if trial == 2:
            cache[1] = torch.randn(rows, 2, slots, 8)         # another buffer in one place
        if trial == 5:                                        # the same tensor, other memory
            cache[2].set_(torch.randn(rows, 2, slots, 8))
        tokens.copy_(torch.randint(0, 97, (rows, 1)))
        lengths.copy_(torch.tensor([[1 + trial], [slots - 2 - trial]]))
        valid.copy_(torch.arange(slots).unsqueeze(0) < lengths)
        ids = tokens
        if trial == 3:                                        # a strided view of other memory
            ids = torch.randint(0, 97, (rows, 2))[:, ::2]
            assert not ids.is_contiguous()
        inputs = (ids, lengths, *cache, valid)
        with torch.no_grad():
            expected = step(*[t.clone() for t in inputs])
        got = compiled(*inputs)
        for g, e in zip(got, expected):
            assert_close(g, e, atol=1e-4, rtol=1e-4)
    # and the kept binding holds no reference: the memory of a cache the caller drops is freed
    memory = np.zeros((rows, 2, slots, 8), np.float32)
    gone = weakref.ref(memory)
    cache[0] = torch.from_numpy(memory)
    compiled(ids, lengths, *cache, valid)
    del cache, memory
    assert gone() is None


def test_threads_calling_one_step_each_get_their_own_answers():
    """Two schedulers may run one decode graph at once, each with its own cache: the kept
    binding is per thread, so neither reads the other's buffers."""
    model = _model("llama").eval()
    rows, slots = 2, 8
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    compiled = trace(step, _decode_example(cache_shape(model.config, rows, slots), rows), optlevel=1,
                     engine="onnxruntime", cache=False)
    assert compiled.program.partitions[0].in_place, "the step should write its cache in place"
    torch.manual_seed(3)
    work = []
    for worker in range(2):
        cache = [torch.randn(rows, 2, slots, 8) for _ in range(4)]
        lengths = torch.tensor([[2 + worker], [5 - worker]])
        valid = torch.arange(slots).unsqueeze(0) < lengths
        calls = []
        for _ in range(3):
            tokens = torch.randint(0, 97, (rows, 1))
            with torch.no_grad():
                calls.append((tokens, step(tokens, lengths, *[c.clone() for c in cache], valid)))
        work.append((cache, lengths, valid, calls))
    failures, start = [], threading.Barrier(2)

    def run(cache, lengths, valid, calls):
        start.wait()
        for _ in range(30):
            for tokens, expected in calls:
                got = compiled(tokens, lengths, *cache, valid)
                if not all(torch.allclose(g, e, atol=1e-4, rtol=1e-4) for g, e in zip(got, expected)):
                    failures.append("an answer was another thread's")
                    return

    threads = [threading.Thread(target=run, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == []


def test_a_head_size_onnx_runtimes_attention_refuses_keeps_the_step_unfused():
    """ONNX Runtime's ``GroupQueryAttention`` runs only head sizes that are multiples of 8
    (it fails when called, after the build: a tensor-parallel rank's 12-wide heads went to
    another engine for it); such a step keeps its attention as written and stays on ONNX
    Runtime, equal to eager."""
    from tests.test_llm_decoder import COMMON
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 24, "num_attention_heads": 2, "num_key_value_heads": 1})).eval()
    rows, slots = 2, 16
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    example = _decode_example(cache_shape(model.config, rows, slots), rows)
    compiled = trace(step, example, optlevel=1, engine="onnxruntime", cache=False)
    assert [p["engine"] for p in compiled.manifest["partitions"]] == ["onnxruntime"]
    header, graph = _header(compiled)
    assert header.get("decoder_fusions", {}).get("attention", 0) == 0
    assert "GroupQueryAttention" not in {n.op_type for n in graph.graph.node}
    lengths = torch.tensor([[5], [9]])
    valid = torch.arange(slots).unsqueeze(0) < lengths
    cache = [torch.randn(rows, 1, slots, 12) for _ in range(2 * model.config.num_hidden_layers)]
    inputs = (torch.randint(0, 97, (rows, 1)), lengths.clone(), *cache, valid)
    with torch.no_grad():
        expected = step(*inputs)
    assert_close(compiled(*inputs), expected, atol=1e-4, rtol=1e-4)


def test_a_cache_input_in_pieces_is_updated_as_one_in_one_buffer_is():
    """The runner writes a step's keys into its cache inputs in place (ORT's own output bound
    to the input's memory). An input that is not one buffer gets ORT's output copied back,
    so the scheduler can rely on the update whatever the layout it hands over."""
    model = _model("llama").eval()
    rows, slots = 2, 8
    step = DecoderStep(model, with_cache=True, last_only=False).eval()
    compiled = trace(step, _decode_example(cache_shape(model.config, rows, slots), rows), optlevel=1,
                     engine="onnxruntime", cache=False)
    assert compiled.program.written_inputs() == frozenset(range(2, 6))
    torch.manual_seed(4)
    base = [torch.randn(rows, 2, slots, 8) for _ in range(4)]
    tokens, lengths = torch.randint(0, 97, (rows, 1)), torch.tensor([[3], [5]])
    valid = torch.arange(slots).unsqueeze(0) < lengths
    whole = [c.clone() for c in base]
    compiled(tokens, lengths, *whole, valid)
    pieces = [torch.zeros(rows, 2, slots, 16)[..., ::2] for _ in base]
    for p, c in zip(pieces, base):
        p.copy_(c)
    assert not pieces[0].is_contiguous()
    compiled(tokens, lengths, *pieces, valid)
    assert any(not torch.equal(w, c) for w, c in zip(whole, base))      # the step wrote its keys
    for w, p in zip(whole, pieces):
        assert torch.equal(w, p)
