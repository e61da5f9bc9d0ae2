"""torch_xla's spelling on kiln's lazy device: a torch-neuronx training script runs
unchanged through ``kiln run-xla`` (or with its imports swapped to ``kiln.xla``) and
trains as CPU eager does."""
import os
import sys

import pytest
import torch

from tests.conftest import ROOT, run_py
from tests import forkserver

SCRIPT = os.path.join(ROOT, "tests", "data", "xla_mnist_mlp.py")


def _cpu_losses(steps=6, batch=32):
    """The script's loop on the CPU, PyTorch eager."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import importlib.util
        spec = importlib.util.spec_from_file_location("mnist_cpu", SCRIPT)
        source = open(SCRIPT).read().replace("import torch_xla.core.xla_model as xm", "") \
            .replace("import torch_xla.debug.metrics as met", "").replace(
                "import torch_xla.distributed.parallel_loader as pl", "")
        namespace: dict = {"__name__": "mnist_cpu"}
        exec(compile(source, spec.origin, "exec"), namespace)
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    images = torch.randn(steps * batch, 28 * 28)
    labels = torch.randint(0, 10, (steps * batch,))
    model = namespace["MLP"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for i in range(steps):
        x, y = images[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch]
        opt.zero_grad()
        loss = torch.nn.NLLLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, model.state_dict()


def test_neuron_training_script_runs_unchanged_through_the_launcher(kiln_cli, tmp_path):
    out = tmp_path / "ckpt.pt"
    proc = forkserver.run([kiln_cli, "run-xla", SCRIPT, "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("losses "))
    got = [float(v) for v in line.split()[1:]]
    expected, state = _cpu_losses()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    for name in ("Metric: CompileTime", "Metric: ExecuteTime", "Metric: TensorsGraphSize",
                 "Counter: UncachedCompile", "Counter: MarkStep\n  Value: 6"):
        assert name in proc.stdout, proc.stdout
    assert "world 1 ordinal 0 master True" in proc.stdout
    saved = torch.load(out, weights_only=True)["state_dict"]      # CPU tensors, no device class
    for key, value in state.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-5)


def test_swapped_imports_mark_step_closures_and_flags(tmp_path):
    code = f"""
import warnings, torch
import kiln.xla.core.xla_model as xm
import kiln.xla.debug.metrics as met
import kiln.xla.runtime as xr
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dev = xm.xla_device()
assert any("--model-type" in str(w.message) for w in caught), [str(w.message) for w in caught]
from kiln.device import modes
assert modes.mode() == "lazy" and modes.policy().options["optlevel"] == 1
w = torch.nn.Parameter(torch.ones(3, device=dev))
opt = torch.optim.SGD([w], lr=0.5)
seen = []
for step in range(3):
    opt.zero_grad()
    loss = (w * torch.arange(3.0, device=dev)).sum()
    loss.backward()
    xm.optimizer_step(opt)
    xm.add_step_closure(lambda l: seen.append(float(l)), args=(loss,))
    assert not seen or len(seen) == step          # closures wait for the step to end
    xm.mark_step()
assert seen == [3.0, 0.5, -2.0], seen
assert torch.equal(w.cpu(), torch.tensor([1.0, -0.5, -2.0]))
modes.wait_compiles()                               # programs compile in the background
assert met.counter_value("MarkStep") == 3 and met.counter_value("UncachedCompile") >= 1
assert "Counter: MarkStep" in met.short_metrics_report()
assert xm.rendezvous("x", b"p") == [b"p"] and xr.world_size() == 1 and xr.global_ordinal() == 0
xm.save({{"w": w}}, {str(tmp_path / "w.pt")!r})
assert torch.load({str(tmp_path / "w.pt")!r}, weights_only=True)["w"].device.type == "cpu"
print("ok")
"""
    proc = run_py(code, env={"NEURON_CC_FLAGS": "--model-type=transformer -O1 --retry_failed_compilation"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_autocast_for_xla_reaches_the_device():
    """A torch-neuronx script's bf16: ``torch.autocast("xla")`` (as a context and a decorator)
    and ``torch_xla.amp.autocast(device)`` cast the device's products to bf16, as
    ``torch.autocast("kiln")`` does, with the same values. Before, autocast for "xla"
    reached no kiln tensor: the script ran in float32 without a word."""
    code = """
import torch
import kiln.xla.amp as amp
import kiln.xla.core.xla_model as xm
dev = xm.xla_device()
torch.manual_seed(0)
m = torch.nn.Linear(8, 4).to(dev)
x = torch.randn(3, 8).to(dev)
with torch.autocast(dev.type, dtype=torch.bfloat16):
    want = m(x)
with torch.autocast("xla", dtype=torch.bfloat16):
    got = m(x)
with amp.autocast(dev):
    also = m(x)
@torch.autocast("xla", dtype=torch.bfloat16)
def step():
    return m(x)
assert want.dtype == got.dtype == also.dtype == step().dtype == torch.bfloat16, (got.dtype, also.dtype)
assert m(x).dtype == torch.float32                  # outside, as before
with torch.autocast("cpu", dtype=torch.bfloat16):   # other device types are torch's own
    assert torch.nn.Linear(8, 4)(torch.randn(3, 8)).dtype == torch.bfloat16
xm.mark_step()
assert torch.equal(got.cpu(), want.cpu()) and torch.equal(also.cpu(), want.cpu())
print("ok")
"""
    out = run_py(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_xla_use_bf16_is_named_as_not_honoured():
    """torch_xla's XLA_USE_BF16=1 (float32 kept as bf16 on the device) would be ignored
    silently: the script would compute in float32. xla_device() says so and what to use."""
    code = """
import warnings
import kiln.xla.core.xla_model as xm
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xm.xla_device()
print([str(w.message) for w in caught if "XLA_USE_BF16" in str(w.message)])
"""
    proc = run_py(code, env={"XLA_USE_BF16": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "not honoured" in proc.stdout and "torch.autocast('xla'" in proc.stdout, proc.stdout


def test_bad_neuron_cc_flags_are_a_clear_error():
    proc = run_py("import kiln.xla.core.xla_model as xm\nxm.xla_device()\n",
                  env={"NEURON_CC_FLAGS": "--optlevel 7"})
    assert proc.returncode != 0
    assert "NEURON_CC_FLAGS" in proc.stderr and "expected 1, 2 or 3" in proc.stderr


@pytest.mark.parametrize("module", ["torch_xla.core.xla_model", "torch_xla.distributed.parallel_loader",
                                    "torch_xla.debug.metrics", "torch_xla.distributed.xla_backend",
                                    "torch_xla.runtime", "torch_xla.amp", "torch_xla.amp.syncfree",
                                    "torch_xla.distributed.xla_multiprocessing", "torch_xla.utils.utils",
                                    "torch_xla.utils.serialization", "torch_xla.debug.profiler",
                                    "torch_neuronx"])
def test_launcher_maps_the_module_paths(module):
    code = (f"from kiln.compat import xla_launch\nxla_launch.install()\nimport importlib\n"
            f"m = importlib.import_module({module!r})\nprint(m.__name__)\n")
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("kiln.")


def test_torch_xla_2x_top_level_api():
    """torch_xla 2.x's own spellings, which its newer examples use: ``torch_xla.device()``,
    ``with torch_xla.step():``, ``@torch_xla.compile``, ``torch_xla.manual_seed``,
    ``torch_xla.launch(fn, debug_single_process=True)``, ``devices()``/``device_count()``,
    the runtime's process and device counts, and ``xm.get_memory_info``: ``step`` and
    ``compile`` were missing (AttributeError at a script's training loop). Training through
    them equals the CPU's."""
    code = """
import warnings
import torch
from kiln.compat import xla_launch
xla_launch.install()
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

def train(where, wrap):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    def one():
        opt.zero_grad()
        loss = (model(x.to(where)) ** 2).mean()
        loss.backward()
        opt.step()
        return loss
    losses = []
    for i in range(3):
        if wrap == "step":
            with torch_xla.step():
                loss = one()
        elif wrap == "compile":
            loss = torch_xla.compile(one)()
        else:
            loss = one()
        losses.append(loss.item())
    return losses

want = train("cpu", None)
dev = torch_xla.device()
for wrap in ("step", "compile"):
    got = train(dev, wrap)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (wrap, got, want)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch_xla.compile(full_graph=True)
assert any("not checked" in str(w.message) for w in caught)
torch_xla.manual_seed(7)
assert torch_xla.devices() == [dev] and torch_xla.device_count() == 1
seen = []
torch_xla.launch(lambda i, a: seen.append((i, a)), args=("x",), debug_single_process=True)
assert seen == [(0, "x")], seen
assert (xr.local_process_count(), xr.global_device_count(), xr.is_spmd()) == (1, 1, False)
info = xm.get_memory_info(dev)
assert set(info) == {"bytes_used", "bytes_limit", "peak_bytes_used"} and info["bytes_limit"] > 0
print("ok")
"""
    proc = run_py(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_torch_xla_launch_and_loss_scaling_names():
    """The rest of torch_xla's example scripts' lines, in one process: ``xmp.spawn(nprocs=1)``
    runs in this process; ranks come from the launcher's environment before any process
    group; ``init_method="xla://"`` joins as ``env://``; ``RateTracker``, ``SampleGenerator``;
    ``amp.GradScaler`` with the ``syncfree`` optimizers trains as ``torch.amp.GradScaler``
    with torch's on the CPU, an overflowing step skipped on both."""
    code = """
import os, torch
import torch.distributed as dist
import kiln.xla.core.xla_model as xm
import kiln.xla.distributed.xla_multiprocessing as xmp
import kiln.xla.distributed.xla_backend
import kiln.xla.runtime as xr
import kiln.xla.utils.utils as xu
from kiln.xla import amp
from kiln.xla.amp import syncfree
from kiln.errors import InputError

assert (xm.get_ordinal(), xm.xrt_world_size(), xm.get_local_ordinal()) == (1, 2, 1)   # RANK=1 WORLD_SIZE=2
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
seen = []
xmp.spawn(lambda i, a: seen.append((i, a)), args=("x",), nprocs=1)
assert seen == [(0, "x")], seen
for bad in (0, -2, "2"):
    try:
        xmp.spawn(print, nprocs=bad)
        raise SystemExit(f"nprocs={bad!r} accepted")
    except InputError as e:
        assert "nprocs" in str(e)
from kiln.errors import PlacementError
try:
    xmp.spawn(print, nprocs=10_000)
    raise SystemExit("more ranks than cores accepted")
except PlacementError as e:
    assert "10000 ranks/workers need at least 10000 kiln cores" in str(e), e
dist.init_process_group("xla", init_method="xla://")
assert (dist.get_rank(), dist.get_world_size(), xr.using_pjrt()) == (0, 1, True)
tracker = xm.RateTracker()
tracker.add(32)
assert tracker.rate() > 0 and tracker.global_rate() > 0
fake = xu.SampleGenerator((torch.zeros(2, 3), torch.ones(2)), 3)
assert len(fake) == 3 and len(list(fake)) == 3 and len(list(fake)) == 3
assert xm.get_xla_supported_devices() == [str(xm.xla_device())]
try:
    amp.GradScaler(use_zero_grad=True)
    raise SystemExit("use_zero_grad accepted")
except InputError:
    pass

def train(where, scaler, opt_cls):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(where)
    opt = opt_cls(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(5, 4, generator=g).to(where)).pow(2).mean()
        if step == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        xm.mark_step()
    return scaler.get_scale(), [p.detach().cpu() for p in model.parameters()]

for name in ("SGD", "Adam", "AdamW"):
    want = train("cpu", torch.amp.GradScaler("cpu", init_scale=1024.0), getattr(torch.optim, name))
    got = train(xm.xla_device(), amp.GradScaler(init_scale=1024.0), getattr(syncfree, name))
    assert got[0] == want[0] == 512.0, (got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
opt = syncfree.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
opt.param_groups[0]["params"][0].grad = torch.ones(2)
opt.step(found_inf=torch.tensor(1.0))
assert opt.param_groups[0]["params"][0].tolist() == [1.0, 1.0]      # skipped
opt.step(found_inf=torch.tensor(0.0))
assert opt.param_groups[0]["params"][0].tolist() == [0.0, 0.0]
print("ok")
"""
    proc = run_py(code, env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(_free_port())})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_xser_checkpoints_and_profiler_spans(tmp_path):
    """``torch_xla.utils.serialization``: a checkpoint in torch_xla's own layout (written here
    the way torch_xla writes it, its ``TensorReference`` class under torch_xla's module name)
    loads without running code from it; kiln's own round-trips a device model's state, and a
    save interrupted between its two files is an error at load, not tensors under the wrong
    names. ``debug.profiler``: ``StepTrace`` ends the step as torch_xla's does, its spans
    reach ``torch.profiler``, and ``start_server`` warns that it serves nothing."""
    code = f"""
import os, pickle, shutil, sys, types, warnings, torch
root = {str(tmp_path)!r}
# torch_xla's writer, as torch_xla/utils/serialization.py does it
fake = types.ModuleType("torch_xla.utils.serialization")
class TensorReference:
    def __init__(self, tid):
        self.tid = tid
TensorReference.__module__ = fake.__name__
fake.TensorReference = TensorReference
sys.modules.update({{"torch_xla": types.ModuleType("torch_xla"), "torch_xla.utils": types.ModuleType("torch_xla.utils"),
                     fake.__name__: fake}})
theirs = os.path.join(root, "theirs.pt")
os.mkdir(theirs + ".tensors")
w = torch.randn(3, 2)
torch.save(w, os.path.join(theirs + ".tensors", "tensor_0.pt"))
torch.save({{"model": {{"w": TensorReference(0), "cpu": torch.ones(2)}}, "step": 7}}, theirs)
for name in ("torch_xla.utils.serialization", "torch_xla.utils", "torch_xla"):
    del sys.modules[name]

import kiln.xla.core.xla_model as xm
import kiln.xla.debug.profiler as xp
import kiln.xla.utils.serialization as xser
from kiln.device import metrics
got = xser.load(theirs)
assert got["step"] == 7 and torch.equal(got["model"]["w"], w) and torch.equal(got["model"]["cpu"], torch.ones(2))

class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.path.join(root, "pwned"),))
torch.save({{"x": Evil()}}, os.path.join(root, "evil.pt"))
try:
    xser.load(os.path.join(root, "evil.pt"))
    raise SystemExit("a checkpoint's code ran")
except pickle.UnpicklingError:
    assert not os.path.exists(os.path.join(root, "pwned"))

dev = xm.xla_device()
torch.manual_seed(0)
model = torch.nn.Linear(4, 3).to(dev)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 4).to(dev)).sum().backward()
opt.step()
xm.mark_step()
ours = os.path.join(root, "ours.pt")
xser.save({{"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 2}}, ours)
assert sorted(os.listdir(ours + ".tensors"))[:2] == [".kiln-ref-sha256", "tensor_0.pt"]
back = xser.load(ours)
for k, v in model.state_dict().items():
    assert back["model"][k].device.type == "cpu" and torch.equal(back["model"][k], v.cpu()), k
assert torch.equal(back["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"].cpu())
keep = ours + ".old"
shutil.copy(ours, keep)
xser.save({{"model": {{"w": model.weight * 2}}}}, ours)
os.replace(keep, ours)                               # the reference file of the save before
try:
    xser.load(ours)
    raise SystemExit("a mixed checkpoint loaded")
except RuntimeError as e:
    assert "different saves" in str(e), e

with torch.profiler.profile() as prof:
    for step in range(2):
        with xp.StepTrace("train_loop", step_num=step):
            with xp.Trace("forward"):
                loss = model(torch.randn(2, 4).to(dev)).sum()
            loss.backward()
        from kiln.device import dispatch
        assert not dispatch.current().ops, "StepTrace left the step's operations unrun"
names = {{e.name for e in prof.events()}}
assert {{"train_loop 0", "train_loop 1", "forward"}} <= names, sorted(names)[:20]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    xp.start_server(9012)
assert any("no profiler server" in str(w.message) for w in caught)
try:
    xp.trace("localhost:9012", root)
    raise SystemExit("trace accepted")
except NotImplementedError as e:
    assert "torch.profiler" in str(e)
print("ok")
"""
    proc = run_py(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_xla_rng_state_reseeds_and_round_trips():
    """``xm.set_rng_state(seed)`` and ``torch_xla.manual_seed`` reseed every time, and
    ``set_rng_state(get_rng_state())`` puts the stream back, as on torch_xla. Seeding with the
    seed the generator started from was a no-op (so the second of two ``set_rng_state(42)``
    went on with the stream) and ``get_rng_state`` returned that initial seed, not the state.
    A checkpoint's integer still restores after its CPU state in a new process (Hugging
    Face's Trainer and accelerate restore in that order)."""
    code = """
import torch, torch.nn.functional as F
import kiln.xla as kx
import kiln.xla.core.xla_model as xm
dev = xm.xla_device()
def draw():
    out = torch.cat([F.dropout(torch.ones(8, device=dev), 0.5), torch.randn(3, device=dev)]).cpu()
    xm.mark_step()
    return out
for seed in (lambda: xm.set_rng_state(42), lambda: kx.manual_seed(42), lambda: xm.set_rng_state(torch.initial_seed())):
    seed(); a = draw(); seed(); b = draw()
    assert torch.equal(a, b), (a, b)
torch.manual_seed(42); c = draw()
assert torch.equal(a, c)                       # the seed is torch.manual_seed's
s = xm.get_rng_state(); a = draw(); draw(); xm.set_rng_state(s); b = draw()
assert torch.equal(a, b) and isinstance(s, int) and torch.tensor(s).item() == s, (a, b)
# a new process: the Trainer restores the CPU state, then the integer saved beside it
cpu, s = torch.get_rng_state(), xm.get_rng_state(); a = draw()
xm._named_states.clear(); torch.set_rng_state(cpu); xm.set_rng_state(s); b = draw()
assert torch.equal(a, b), (a, b)
print("ok")
"""
    proc = run_py(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_a_hugging_face_trainer_script_trains_on_the_device_through_the_launcher(kiln_cli, tmp_path):
    """The plain Hugging Face Trainer under ``kiln run-xla``: transformers and accelerate see
    torch_xla and take their XLA paths, as on a Neuron host. ``import transformers`` failed
    (accelerate subclasses ``MpDeviceLoader``, then a function here), then one missing
    torch_xla name after another. Now it trains on the device with the CPU Trainer's losses,
    saves checkpoints, and a run resumed from one ends where the uninterrupted run does."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = os.path.join(ROOT, "tests", "data", "hf_trainer_xla.py")
    proc = forkserver.run([kiln_cli, "run-xla", script, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["xla"] and got["device"] == got["param_device"] == "kiln:0"
    assert got["resumed_gap"] < 1e-6
    # the only process is process zero, locally too: it logs and saves (LOCAL_RANK was -1
    # without a launcher, so the Trainer's logging was skipped)
    assert got["process_zero"] == [True, True, True, True]
    # the same script's training on the CPU, here (transformers sees no torch_xla in this process)
    import importlib.util
    spec = importlib.util.spec_from_file_location("hf_trainer_cpu", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer, _ = module.run(str(tmp_path / "cpu"))
    assert str(trainer.args.device) == "cpu"
    want = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert got["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_an_accelerate_loop_trains_on_the_device_through_the_launcher(kiln_cli, tmp_path):
    """An accelerate script under ``kiln run-xla`` (accelerate's XLA path): the same losses as
    on the CPU, and ``save_state`` writes its files (it read the loader's ``dataset`` through
    torch_xla's ``MpDeviceLoader``, which kiln's now passes through)."""
    pytest.importorskip("accelerate")
    import json
    script = os.path.join(ROOT, "tests", "data", "accelerate_xla.py")
    runs = []
    for command, where in (([kiln_cli, "run-xla"], "kiln"), ([sys.executable], "cpu")):
        proc = forkserver.run(command + [script, str(tmp_path / where)], capture_output=True, text=True, timeout=600,
                              cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    on_device, on_cpu = runs
    assert on_device["device"] == on_device["param_device"] == "kiln:0" and on_cpu["device"] == "cpu"
    assert on_device["losses"] == pytest.approx(on_cpu["losses"], rel=1e-5, abs=1e-6)
    assert on_device["gathered"] == [1.0]
    assert on_device["main"] == on_cpu["main"] == [True, True, 0]      # the local main process, as on the CPU
    assert {"model.safetensors", "optimizer.bin"} <= set(on_device["saved"])
