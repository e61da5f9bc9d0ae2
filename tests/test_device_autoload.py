"""The device exists the moment torch does: kiln's ``torch.backends`` entry point
(PyTorch's device-backend autoload) registers it during ``import torch``, so scripts
that never import kiln use ``.to("kiln")``, and a CPU backward pass run first no longer
stops the device from training. ``KILN_DEVICE_NAME=neuron`` gives TorchNeuron's name;
with autoload off, late registration is a clear error; a failing hook never breaks
``import torch``. Each case runs in a fresh process (autoload happens once, at import)."""
import textwrap

from tests.conftest import run_py as _run_py


def run_py(*args, **kwargs):
    """A new interpreter for each: these tests are about what ``import torch`` does."""
    return _run_py(*args, new_interpreter=True, **kwargs)


ON = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1", "KILN_DEVICE_NAME": "kiln"}

# a tiny MLP trained for three SGD steps on the CPU (a backward pass before the device is
# touched) and then on the device from the same start; no kiln import before the last line
TRAIN = textwrap.dedent("""
    import copy, json, sys
    import torch
    at_import = sorted(m for m in sys.modules if m.split(".")[0] == "kiln")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    xs, ys = torch.randn(3, 4, 8), torch.randn(3, 4, 1)

    def train(m, dev):
        m = m.to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for x, y in zip(xs, ys):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu().tolist() for p in m.parameters()], str(next(m.parameters()).device)

    start = copy.deepcopy(model)
    cpu = train(copy.deepcopy(start), "cpu")
    dev = train(copy.deepcopy(start), "kiln")
    from kiln.device import metrics, modes
    modes.wait_compiles()                           # programs compile in the background
    print(json.dumps({"start": [p.tolist() for p in start.parameters()], "cpu": cpu, "dev": dev,
                      "compiled": metrics.counter_value("UncachedCompile"), "at_import": at_import,
                      "executed": metrics.metric_data("ExecuteTime")[0]}))
""")


def _last_json(proc):
    import json
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_to_kiln_with_no_kiln_import_trains_like_cpu_after_a_cpu_backward():
    import torch
    out = _last_json(run_py(TRAIN, env=ON))
    (cpu_losses, cpu_params, _), (dev_losses, dev_params, where) = out["cpu"], out["dev"]
    assert where == "kiln:0"
    torch.testing.assert_close(torch.tensor(dev_losses), torch.tensor(cpu_losses), atol=1e-5, rtol=1e-5)
    for got, want in zip(dev_params, cpu_params):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    moved = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(dev_params, out["start"]))
    assert moved > 1e-3                                     # it trained: the parameters moved
    assert out["compiled"] >= 1 and out["executed"] >= 3   # ran as compiled device programs
    # import torch registered the device (and declared kiln::run, which torch.jit.load of a
    # saved kiln model needs) without kiln's compiler, runtime or engines: every process that
    # imports torch pays for what autoload imports (~0.2 s of import for those)
    light = ("kiln.graph", "kiln.graph.draws", "kiln.graph.draw_ahead", "kiln.runtime", "kiln.runtime.script_op")
    heavy = [m for m in out["at_import"] if m.split(".")[1:2] in (["compiler"], ["runtime"], ["engines"], ["graph"])
             and m not in light]
    assert "kiln.device.registration" in out["at_import"] and not heavy, heavy


def test_a_cpu_script_with_a_pinning_data_loader_runs_beside_the_device():
    """A plain CPU script (no kiln import) with ``DataLoader(pin_memory=True)``: once autoload
    registers the device it is PyTorch's current accelerator, and pinning for it raised
    NotImplementedError (a Python backend cannot give PyTorch a pinned allocator), so
    installing kiln broke such scripts. Now a pin for the device is an ordinary copy."""
    code = textwrap.dedent("""
        import json, torch
        from torch.utils.data import DataLoader, TensorDataset
        ds = TensorDataset(torch.randn(10, 3), torch.arange(10))
        batches = list(DataLoader(ds, batch_size=4, pin_memory=True))
        x = torch.ones(2)
        pinned = x.pin_memory()
        x.add_(1)                                     # a copy, as a pin is
        print(json.dumps({"accelerator": torch.accelerator.current_accelerator().type,
                          "same": torch.equal(torch.cat([b[0] for b in batches]), ds.tensors[0]),
                          "labels": torch.cat([b[1] for b in batches]).tolist(), "pinned": pinned.tolist()}))
    """)
    out = _last_json(run_py(code, env=ON))
    assert out == {"accelerator": "kiln", "same": True, "labels": list(range(10)), "pinned": [1.0, 1.0]}


def test_a_cpu_accelerate_script_stays_on_the_cpu_beside_the_device():
    """A plain accelerate script (no kiln import): accelerate 1.16 asks ``torch.accelerator``
    for the machine's accelerator, which is kiln's device once autoload registers it, and
    moved the model onto it; a ``transformers.Trainer`` script then failed at its first step
    (its own device stayed the CPU). Now a library that picks the accelerator by itself sees
    none, as for ``DataParallel``; also where the device is registered after accelerate was
    imported (autoload off), whose modules hold copies of the function."""
    code = textwrap.dedent("""
        import json, torch
        late = LATE
        from accelerate import Accelerator
        from accelerate.state import PartialState
        if late:
            from kiln.device import modes
            modes.device()
        acc = Accelerator()
        model, opt = acc.prepare(torch.nn.Linear(3, 2), None)
        print(json.dumps({"accelerator": torch.accelerator.current_accelerator().type, "state": str(acc.device),
                          "model": str(next(model.parameters()).device),
                          "default": str(PartialState().default_device)}))
    """)
    want = {"accelerator": "kiln", "state": "cpu", "model": "cpu", "default": "cpu"}
    assert _last_json(run_py(code.replace("LATE", "False"), env=ON)) == want
    off = dict(ON, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert _last_json(run_py(code.replace("LATE", "True"), env=off)) == want


def test_neuron_name_through_the_variable():
    code = textwrap.dedent("""
        import torch
        x = torch.ones(2, device=torch.device("neuron"), requires_grad=True)
        w = torch.full((2,), 3.0).to("neuron")
        (x * w).sum().backward()
        print(x.grad.device, x.grad.cpu().tolist(), torch.neuron.device_count() >= 1)
        from kiln.device import modes
        import kiln.xla.core.xla_model as xm
        print(modes.device(), modes.device("neuron"), xm.xla_device(), xm.is_xla_tensor(w))
        try:
            modes.device("kiln")
        except RuntimeError as e:
            print("refused:", e)
    """)
    proc = run_py(code, env=dict(ON, KILN_DEVICE_NAME="neuron"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "neuron:0 [3.0, 3.0] True"
    assert lines[1] == "neuron:0 neuron:0 neuron:0 True"      # the explicit spellings agree
    assert "registered as 'neuron'" in lines[2] and "KILN_DEVICE_NAME=kiln" in lines[2]


def test_autoload_off_explicit_registration_and_the_late_error():
    off = dict(ON, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = run_py("import torch\ntry:\n    torch.device('kiln')\nexcept RuntimeError:\n    print('no device')\n"
                  "from kiln.device import modes\nmodes.device('neuron')\n"
                  "x = torch.ones(2, device='neuron', requires_grad=True)\n(x * 3).sum().backward()\n"
                  "print(x.grad.device, x.grad.cpu().tolist())\n", env=off)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["no device", "neuron:0 [3.0, 3.0]"]
    proc = run_py("import torch\nx = torch.ones(2, requires_grad=True)\n(x * 2).sum().backward()\n"
                  "from kiln.device import modes\nmodes.device()\n", env=off)
    assert proc.returncode != 0 and "DeviceUnavailable" in proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    for words in ("before any .backward()", "'torch.backends' entry point", "TORCH_DEVICE_BACKEND_AUTOLOAD='0'",
                  "KILN_DEVICE_NAME"):
        assert words in message, message


def test_a_failing_hook_warns_and_torch_still_imports(tmp_path):
    code = "import torch\nprint(torch.ones(2).add(1).tolist(), torch._C._get_privateuse1_backend_name())\n"
    proc = run_py(code, env=dict(ON, KILN_DEVICE_NAME="cuda"))         # a name PyTorch refuses
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[2.0, 2.0] privateuseone"
    assert "RuntimeWarning: kiln could not register its device 'cuda'" in proc.stderr
    assert "KILN_DEVICE_NAME=off" in proc.stderr
    # a kiln package that cannot be imported at all (here a stand-in that raises, found first)
    (tmp_path / "kiln").mkdir()
    (tmp_path / "kiln" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    proc = run_py(code, env=ON, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kiln could not be imported while torch was imported (ImportError: a broken install)" in proc.stderr
    proc = run_py(code, env=dict(ON, KILN_DEVICE_NAME="off"))          # leaves PrivateUse1 alone
    assert proc.returncode == 0 and proc.stdout.strip() == "[2.0, 2.0] privateuseone", proc.stderr[-2000:]
    assert "Warning" not in proc.stderr


def test_a_cuda_torch_leaves_the_device_out_unless_asked(monkeypatch):
    """A registered PrivateUse1 device breaks CUDA backward passes (PyTorch takes it for the
    process's accelerator), so a CUDA build of torch registers kiln's device only when
    KILN_DEVICE_NAME asks for it, and registering where a GPU is warns why."""
    import torch

    from kiln.device import autoload, registration
    calls = []
    monkeypatch.setattr(registration, "register", lambda name, probe=True: calls.append(name))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("KILN_DEVICE_NAME", raising=False)
    assert registration.spares_cuda()
    autoload.load()
    assert calls == []
    monkeypatch.setenv("KILN_DEVICE_NAME", "kiln")        # asked for: registered all the same
    assert not registration.spares_cuda()
    autoload.load()
    assert calls and set(calls) == {"kiln"}
    monkeypatch.setattr(torch.version, "cuda", None)      # the CPU wheel: registered by default
    monkeypatch.delenv("KILN_DEVICE_NAME")
    assert not registration.spares_cuda()
    # the warning, on a first registration in a process that believes it sees a GPU
    code = ("import warnings, torch\ntorch.cuda.is_available = lambda: True\n"
            "from kiln.device import registration\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    registration.register('kiln', probe=False)\n"
            "print([str(x.message) for x in w if 'CUDA backward' in str(x.message)])\n")
    proc = run_py(code, env=dict(ON, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "opt_ready_stream && opt_parent_stream" in proc.stdout, proc.stdout


def test_torch_accelerator_calls_answer_for_the_device():
    """``torch.accelerator``'s generic calls, which scripts guard with ``is_available()`` (True
    wherever kiln is installed): ``synchronize`` raised "Backend doesn't support synchronizing"
    and the memory calls ``device_allocator INTERNAL ASSERT FAILED``. Now they answer for the
    device: allocated bytes are what live device tensors hold; ``torch.kiln`` has CUDA's names."""
    code = textwrap.dedent("""
        import json, torch
        assert torch.accelerator.is_available()
        before = torch.accelerator.memory_allocated()
        x = torch.randn(1000, 1000, device="kiln")
        y = x * 2
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats()
        stats = torch.accelerator.memory_stats()
        free, total = torch.accelerator.get_memory_info()
        with torch.kiln.device(0):
            name = torch.kiln.get_device_name()
        print(json.dumps({"grew": torch.accelerator.memory_allocated() - before,
                          "kiln": torch.kiln.memory_allocated() - before,
                          "peak_ok": torch.accelerator.max_memory_allocated() >= torch.accelerator.memory_allocated(),
                          "reserved_ok": torch.kiln.memory_reserved() >= torch.kiln.memory_allocated(),
                          "keys": sorted(stats), "info_ok": 0 < free <= total, "name": name,
                          "props": torch.kiln.get_device_properties(0).total_memory == total,
                          "rng": len(torch.kiln.get_rng_state_all())}))
    """)
    out = _last_json(run_py(code, env=ON))
    assert out["grew"] == out["kiln"] == 8_000_000          # x and y, 4 MB each
    assert out["peak_ok"] and out["reserved_ok"] and out["info_ok"] and out["props"] and out["rng"] == 1
    assert "allocated_bytes.all.current" in out["keys"] and out["name"].startswith("kiln")
