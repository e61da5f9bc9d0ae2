"""An LLM's graphs compiled in worker processes (kiln.llm.parallel): the same answers as
compiling in this process, a worker's error raised here with its type and message, and
the measurement lock that keeps parallel workers from timing builds at once."""
import fcntl
import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kiln.compiler import measure  # noqa: E402
from kiln.errors import CompilerArgsError  # noqa: E402
from kiln.llm import parallel  # noqa: E402
from kiln.llm.build import compile_llm  # noqa: E402
from tests.test_llm_decoder import PROMPTS, _hf_greedy, _model  # noqa: E402


def test_graphs_compiled_in_workers_generate_hugging_face_tokens():
    model = _model("llama")
    seen = []
    llm = compile_llm(model, batch_size=1, context_buckets=(8,), cache_length=32, optlevel=1, workers=2,
                      on_graph=lambda name, k, n, s: seen.append((name, k, n)))
    assert sorted(name for name, _, _ in seen) == ["decode 1x32", "prefill 8"]
    assert [(k, n) for _, k, n in seen] == [(1, 2), (2, 2)]     # in order of completion
    assert sorted(llm.prefill) == [8] and sorted(llm.decode) == [1]
    assert llm.generate(PROMPTS[:1], 10, stop_at_eos=False) == [_hf_greedy(model, PROMPTS[0], 10)]


def test_a_workers_error_is_raised_with_its_type_and_message(tmp_path):
    # the graph this process compiles itself (the first) fails the same way, naming it
    with pytest.raises(CompilerArgsError, match=r"prefill 4 graph: .*optlevel"):
        compile_llm(_model("llama"), batch_size=2, context_buckets=(4,), cache_length=16, optlevel=7, workers=2)
    # and a worker's: its process reports the error, raised here with its type
    from kiln.llm.build import _decode_example
    from kiln.llm.decoder import cache_shape
    model = _model("llama")
    job = ("decode 2x16", {"with_cache": True, "last_only": False}, _decode_example(cache_shape(model.config, 2, 16), 2))
    torch.save({"model": model, "options": {"optlevel": 7}, "jobs": [job, job]}, tmp_path / "jobs.pt")
    workers = parallel._Workers(str(tmp_path), ["unused", "decode 2x16"], None)
    with pytest.raises(CompilerArgsError, match=r"decode 2x16 graph: .*optlevel"):
        workers.start([1], 1)
        workers.run(1)


def test_small_models_compile_in_this_process():
    assert parallel.default_workers(_model("llama"), 4) == 1         # spawning costs more than it saves


def test_float_builds_on_two_cpus_compile_in_this_process(monkeypatch):
    """On 2 CPUs a float build's graphs cost more to carry between processes than the
    second core saves (SmolLM2 float32: 49.0 s here, 62.2 s in three workers); quantized
    graphs are small and still go to workers, as do float ones on 4 CPUs or more."""
    model = _model("llama")
    monkeypatch.setattr(parallel, "PARALLEL_MIN_PARAMETERS", 0)
    monkeypatch.setattr(parallel, "_available_bytes", lambda: 64 << 30)
    monkeypatch.setattr(parallel, "process_cpus", lambda: [0, 1])
    assert parallel.default_workers(model, 3, quantized=False) == 1
    assert parallel.default_workers(model, 3, quantized=True) == 3
    monkeypatch.setattr(parallel, "process_cpus", lambda: [0, 1, 2, 3])
    assert parallel.default_workers(model, 3, quantized=False) == 3


def test_timings_hold_the_machine_wide_measurement_lock():
    path = os.path.join(tempfile.gettempdir(), "kiln-measure.lock")
    with measure.exclusive():
        with open(path, "a") as other:             # another open file: what another process sees
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path, "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)       # released afterwards
        fcntl.flock(other, fcntl.LOCK_UN)


def test_a_model_that_cannot_be_sent_to_workers_compiles_here_with_a_warning(caplog):
    model = _model("llama")
    model.not_picklable = lambda: None          # e.g. a hook some library attached
    with caplog.at_level("WARNING", logger="kiln"):
        llm = compile_llm(model, batch_size=1, context_buckets=(4,), cache_length=16, optlevel=1, workers=2)
    assert "cannot be sent to worker processes" in caplog.text
    assert llm.generate([[5, 6]], 4, stop_at_eos=False) == [_hf_greedy(model, [5, 6], 4)]
