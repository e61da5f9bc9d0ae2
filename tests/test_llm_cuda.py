"""An LLM compiled for an NVIDIA GPU (``compile_llm(device="cuda")``, kiln.runtime.cuda_llm).

The GPU test runs only where torch sees a CUDA device (CI has none; it was run on an H100,
docs/llm.md, "NVIDIA GPUs"): a tiny random Llama compiled for the GPU, five prompts of
different lengths through the continuous-batching scheduler three at a time, each equal
token for token to Hugging Face's greedy ``generate`` on the same GPU in float32, with the
KV cache on the GPU and decode replayed from captured CUDA graphs; again after a save and
load. The rest run on every host: the cache memory a GPU LLM hands its schedulers, and the
options ``device="cuda"`` refuses.
"""
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.errors import CompilerArgsError  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from kiln.runtime import cuda_llm, kv  # noqa: E402
from kiln.runtime.scheduler import run_all  # noqa: E402
from tests.test_llm_decoder import _model  # noqa: E402

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device (torch.cuda.is_available())")
PROMPTS = [[5, 9, 14], [7, 3, 3, 21, 40, 2, 11, 60], [33], [12, 12, 80, 4, 19], [8, 70, 1, 1, 6, 50]]
NEW = 12


# -- every host -----------------------------------------------------------------------------

def test_cache_memory_is_handed_to_one_live_cache_at_a_time():
    """What keeps captured CUDA graphs valid: a later cache gets the same buffers, zeroed,
    once the earlier one is gone; a cache made while another lives gets its own."""
    memory = kv.CacheMemory("cpu")
    shape = (2, 3, 2, 8, 4)
    with kv.placed(memory):
        first = kv.KVCache(shape, windows=(4,))
    first.write_slot(1, torch.ones(2, 2, 3, 4), torch.ones(2, 2, 3, 4))
    address = first.keys.data_ptr()
    with kv.placed(memory):
        second = kv.KVCache(shape)
    assert second.keys.data_ptr() != address and second.keys.abs().sum() == 0     # first still lives
    del first, second
    gc.collect()
    with kv.placed(memory):
        third = kv.KVCache(shape)
    assert third.keys.data_ptr() == address and third.keys.abs().sum() == 0 and third.values.abs().sum() == 0
    plain = kv.KVCache(shape)                  # outside placed(): its own zeros
    assert plain.keys.data_ptr() != address


def test_device_cuda_refuses_quantized_weights_and_tensor_parallelism():
    model = _model("llama")
    with pytest.raises(CompilerArgsError, match=r"quantize='int4' with device='cuda'.*CPU kernels only"):
        compile_llm(model, device="cuda", quantize="int4")
    with pytest.raises(CompilerArgsError, match=r"tp_degree=2 with device='cuda'"):
        compile_llm(model, device="cuda", tp_degree=2)


@pytest.mark.skipif(GPU, reason="this host has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(CompilerArgsError, match=r"device='cuda' but torch .* sees no CUDA device"):
        compile_llm(_model("llama"), device="cuda", context_buckets=(8,), cache_length=32)


@pytest.mark.skipif(GPU, reason="this host has a GPU")
def test_a_decode_step_that_cannot_be_captured_runs_uncaptured_with_a_warning(tiny_llm):
    """CPU caches run the graph as it is (the batch-invariance probe's calls), and a capture
    that fails (here: no CUDA at all) leaves the step running uncaptured, with the reason."""
    graph = tiny_llm[1].decode[3]
    layers, rows, heads, slots, dim = tiny_llm[1].meta["cache_shape"]
    torch.manual_seed(0)
    inputs = [torch.randint(3, 90, (rows, 1)), torch.tensor([[4], [9], [2]]),
              *[torch.randn(rows, heads, slots, dim) for _ in range(2 * layers)],
              torch.arange(slots).unsqueeze(0) < torch.tensor([[4], [9], [2]])]
    step = cuda_llm.GraphedDecode(graph, torch.device("cpu"))
    want = graph(*inputs)
    got = step(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and not step.captures
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph"):
        assert step._try_capture(0, inputs[0], inputs[1], inputs[2:-1], inputs[-1]) is None
    assert step.capture_error and all(torch.equal(a, b) for a, b in zip(step(*inputs), want))


# -- on the GPU -----------------------------------------------------------------------------

def _hugging_face(model, prompts, new):
    with torch.no_grad():
        return [model.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.int64,
                                                                                         device="cuda"),
                               max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _captures(llm) -> int:
    graphs = list(llm.decode.values()) + [g for w in llm.windows.values() for g in w["decode"].values()]
    return sum(len(g.captures) for g in graphs)


@needs_gpu
def test_cuda_llm_greedy_equals_hugging_face_batched_and_after_load(tmp_path):
    model = _model("llama")
    # windows 16 and 32: sequences grow past 16 positions, so the cache is re-laid out on the GPU
    llm = compile_llm(model, batch_size=3, context_buckets=(8,), cache_length=32, sequence_buckets=(16,),
                      device="cuda", workers=5)
    expected = _hugging_face(model.cuda(), PROMPTS, NEW)
    model.cpu()

    sched = llm.scheduler()
    assert sched.cache.keys.is_cuda and not sched.cache.lengths.is_cuda
    assert run_all(sched, PROMPTS, NEW) == expected
    captured = _captures(llm)
    assert captured >= 2, "the decode steps ran uncaptured"
    assert sched.window_steps.get(16) and sched.window_steps.get(32), sched.window_steps
    address = sched.cache.keys.data_ptr()
    del sched
    gc.collect()

    assert llm.generate(PROMPTS, NEW) == expected            # a new scheduler on the same memory...
    assert _captures(llm) == captured                        # ...replays the graphs captured before
    assert llm.scheduler().cache.keys.data_ptr() == address

    path = llm.save(tmp_path / "gpu.kiln")
    loaded = kiln.load(path, trust_native_code=True)
    assert loaded.generate(PROMPTS[:3], NEW) == expected[:3]
    assert _captures(loaded) >= 1
