"""One multi-host run for real: two network namespaces ("hosts" A and B, made here and
joined by a veth pair with addresses only inside this sandbox), one ``torchrun --nnodes 2
--nproc_per_node 1`` node in each, rendezvous at A's address (static: master_addr/port).

1. The NxD training script (tests/data/nxd_train.py) at TP=2 on CPU tensors over gloo equals
   the one-process TP=1 run (tests/test_nxd_train.py's reference launch and assertions).
2. ``kiln serve`` of a tp-2 LLM artifact under torchrun: rank 0 (in A) serves HTTP on A's
   address, rank 1 (in B) follows; a request from inside A gets Hugging Face's greedy tokens.

Both "hosts" are this machine: each node runs on a CPU of its own (``taskset``), and gloo is
told the veth (GLOO_SOCKET_IFNAME; by default it binds to the address the hostname resolves
to, loopback here). The shared-memory all-reduce must not be chosen across them: ``ip netns
exec`` gives each node its own mount namespace, which kiln.distributed.shm.host_identity
includes, so the ranks see two hosts (asserted by the third test).

Skipped with the reason where namespaces cannot be made (not root, no ``ip``, not permitted).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, shared_compile_cache, tiny_tokenizer
from tests.test_nxd_train import SCRIPT, STEPS, _assert_equal_to_reference, _launch

pytestmark = pytest.mark.slow

ADDR_A, ADDR_B = "10.231.0.1", "10.231.0.2"
BIN = os.path.dirname(sys.executable)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _probe():
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("taskset") is None:
        return "no `taskset` command (util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kiln-probe-{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@pytest.fixture(scope="module")
def hosts():
    why = _probe()
    if why:
        pytest.skip(why)
    pid = os.getpid()
    a, b = f"kiln-a-{pid}", f"kiln-b-{pid}"
    veth_a, veth_b = f"kva{pid % 100000}", f"kvb{pid % 100000}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", a)
        _ip("link", "set", veth_b, "netns", b)
        for ns, dev, addr in ((a, veth_a, ADDR_A), (b, veth_b, ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield (a, veth_a), (b, veth_b)
    finally:
        for ns in (a, b):            # deleting a namespace deletes its end of the veth pair (and the pair)
            _ip("netns", "del", ns, check=False)


def _node(host, node_rank, port, entry, log, **env):
    """One torchrun node on ``host`` (namespace, interface), in its own session so the test can
    stop it, on a CPU of its own (``taskset``: each "host" has one CPU, so its one local rank
    takes kiln core 0 of it; KILN_VISIBLE_CORES counts the CPUs a process is allowed, so
    KILN_VISIBLE_CORES=1 would name a core that a one-CPU host lacks). gloo binds to the interface its hostname resolves to
    (here loopback, the same name in both namespaces) unless GLOO_SOCKET_IFNAME names one, as
    on real hosts whose hostname does not resolve to the cluster network."""
    ns, dev = host
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=dev, **env)
    environ.pop("KILN_VISIBLE_CORES", None)
    environ.pop("NEURON_RT_VISIBLE_CORES", None)
    cpu = node_rank % (os.cpu_count() or 1)
    cmd = ["ip", "netns", "exec", ns, "taskset", "-c", str(cpu), os.path.join(BIN, "torchrun"), "--nnodes", "2", "--nproc_per_node", "1",
           "--node_rank", str(node_rank), "--master_addr", ADDR_A, "--master_port", str(port), *entry]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=environ,
                            start_new_session=True)


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path, n=3000):
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def test_training_tp2_across_two_hosts_equals_one_process(hosts, tmp_path):
    cache = str(tmp_path / "cache")
    out = tmp_path / "multi" / "report.json"
    out.parent.mkdir()
    entry = [SCRIPT, "--tp", "2", "--steps", str(STEPS), "--out", str(out)]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [_node(host, k, 29511, entry, open(logs[k], "w"), NXD_CPU_MODE="1", KILN_CACHE_URL=cache)
             for k, host in enumerate(hosts)]
    try:
        for k, proc in enumerate(procs):
            assert proc.wait(timeout=120) == 0, f"node {k}:\n{_tail(logs[k])}"
    finally:
        for proc in procs:
            _stop(proc)
    report = json.loads(out.read_text())
    assert (report["tp"], report["dp"]) == (2, 1)
    params = {r: torch.load(out.parent / f"params_tp{r}.pt", weights_only=True) for r in range(2)}
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    reference = _launch(ref_dir, 1, "--tp", "1", cpu=True, cache=cache)
    _assert_equal_to_reference(report, params, reference)


_CLIENT = """
import http.client, json, sys, time
host, port, prompt, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def call(method, path, body=None):
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()
deadline = time.monotonic() + 90
while True:
    try:
        if call("GET", "/v2/health/ready")[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("server not ready in 90 s")
    time.sleep(0.2)
status, body = call("POST", "/v1/completions", json.dumps(
    {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0}))
print(json.dumps({"status": status, "body": json.loads(body)}))
"""


def test_tp2_serving_across_two_hosts_gives_hugging_faces_tokens(hosts, tmp_path, tmp_path_factory, run_id):
    pytest.importorskip("transformers")
    from kiln.llm.build import compile_llm
    from kiln.runtime.text import Tokenizer
    from tests.test_llm_tp import _hf, _llama_9_3
    a = hosts[0][0]
    model = _llama_9_3()
    with pytest.MonkeyPatch.context() as mp:      # test_llm_tp.py compiles the same graphs into it
        mp.setenv("KILN_CACHE_URL", shared_compile_cache(tmp_path_factory, run_id, "tp-cache"))
        llm = compile_llm(model, tp_degree=2, batch_size=2, decode_batches=(2,), context_buckets=(4, 8),
                          cache_length=32, optlevel=1, tokenizer=tiny_tokenizer())
    path = tmp_path / "llama.kiln"
    llm.save(path)
    port = 8011
    entry = ["-m", "kiln.serving", f"tiny={path}", "--host", ADDR_A, "--port", str(port)]
    logs = [tmp_path / "serve0.log", tmp_path / "serve1.log"]
    procs = [_node(host, k, 29512, entry, open(logs[k], "w"), KILN_QUIET="1")
             for k, host in enumerate(hosts)]
    try:
        client = subprocess.run(["ip", "netns", "exec", a, sys.executable, "-c", _CLIENT, ADDR_A, str(port), "Hi",
                                 "5"], capture_output=True, text=True, timeout=150)
        assert client.returncode == 0, (client.stderr[-2000:], _tail(logs[0]), _tail(logs[1]))
        answer = json.loads(client.stdout)
        assert answer["status"] == 200, answer
        tok = Tokenizer(llm.tokenizer_files)
        expected = _hf(model, tok.encode("Hi"), 5)
        expected = expected[:expected.index(2) + 1] if 2 in expected else expected     # </s> ends the server's
        assert answer["body"]["choices"][0]["text"] == tok.decode(expected)
    finally:
        for proc in procs:
            _stop(proc)


def test_the_two_hosts_are_two_hosts_to_the_shared_memory_all_reduce(hosts):
    """kiln.distributed.shm picks shared memory only for ranks with one host identity; the
    namespaces share /dev/shm and the kernel, but ``ip netns exec`` gives each its own mount
    namespace, which the identity includes, so ranks on A and B use gloo over the veth."""
    code = "from kiln.distributed.shm import host_identity; print(host_identity())"
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)) for ns, _ in hosts]
    ids = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and all(ids)
    assert ids[0] != ids[1], ids
