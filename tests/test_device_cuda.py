"""device="cuda": TorchInductor on an NVIDIA GPU, and the checks that guard it everywhere.

The GPU tests run only where torch sees a CUDA device (CI has none; they were
run on an H100, see docs/performance.md, "NVIDIA GPU"). The rest run on every host: a CUDA
artifact is refused with a message on a host without the GPU, device="cuda"
without one is a clear error, and the bf16 lowering used on GPUs is checked
on the graph itself.
"""
import pytest
import torch

import kiln
from kiln.graph import precision
from kiln.host import target
from kiln.engines import inductor
from kiln.errors import CompilerArgsError, TargetMismatchError
from tests import models
from tests.conftest import assert_close, run_py

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device (torch.cuda.is_available())")
needs_cxx = pytest.mark.skipif(inductor.compiler() is None, reason="inductor needs a C++ compiler")


# -- every host -----------------------------------------------------------------------------

@pytest.mark.skipif(GPU, reason="this host has a GPU")
def test_device_cuda_without_a_gpu_is_a_clear_error():
    model, x = models.mlp()
    with pytest.raises(CompilerArgsError, match=r"device='cuda' but torch .* sees no CUDA device"):
        kiln.trace(model, x, device="cuda")


def test_device_values_are_checked():
    model, x = models.mlp()
    with pytest.raises(CompilerArgsError, match=r"device='gpu': expected one of auto, cpu, cuda"):
        kiln.trace(model, x, device="gpu")


def test_cpu_engine_or_int8_keeps_auto_on_the_cpu(monkeypatch):
    """auto means the GPU only for work that can run there."""
    from kiln.compiler import selection as select
    monkeypatch.setattr(select, "cuda_available", lambda: True)
    make = kiln.compiler.driver.make_options
    assert make(engine="onnxruntime").device == "cpu"
    assert make(quantize="int8").device == "cpu"
    assert make().device == "cuda"
    assert make(device="cpu").device == "cpu"
    with pytest.raises(CompilerArgsError, match="engine 'openvino' runs on CPUs only"):
        make(engine="openvino", device="cuda")
    with pytest.raises(CompilerArgsError, match="int8 quantization runs on CPU engines only"):
        make(quantize="int8", device="cuda")


@pytest.mark.skipif(GPU, reason="this host has a GPU")
def test_cuda_artifact_is_refused_on_a_host_without_one(tmp_path):
    """The manifest's device decides, before any engine is loaded: a clear message, no crash."""
    model, x = models.mlp()
    compiled = kiln.trace(model, x, engine="onnxruntime")
    art = compiled._artifact
    art.manifest["target"].update(device="cuda", cuda={"name": "NVIDIA H100 80GB HBM3",
                                                       "capability": "9.0", "cuda": "13.0"})
    path = tmp_path / "gpu.kiln"
    kiln.artifact.container.Artifact(art.manifest, dict(art.blobs)).save(str(path))
    with pytest.raises(TargetMismatchError, match=r"compiled for CUDA on NVIDIA H100 80GB HBM3 "
                                                  r"\(compute capability 9\.0\).*no CUDA device"):
        kiln.load(str(path))


def test_gpu_machine_code_compatibility():
    ok = target._binary_compatible
    assert ok("9.0", "9.0") and ok("8.0", "8.6")
    assert not ok("8.6", "8.0")      # older minor: missing instructions
    assert not ok("8.0", "9.0")      # another major: SASS does not carry over
    assert not ok("", "9.0")


def test_lowering_runs_matmuls_in_bf16_and_keeps_fp32_outside():
    """What auto-cast does on a GPU, checked on the graph (it runs on the CPU too)."""
    model, x = models.mlp()
    gm = torch.export.export(model, (x,)).run_decompositions().module()
    expected = model(x).detach()
    n = precision.lower(gm, "matmult", "bf16")
    assert n == sum(1 for node in gm.graph.nodes if node.target in precision.MATMULT_OPS) > 0
    for node in gm.graph.nodes:
        if node.target in precision.MATMULT_OPS:
            assert node.meta["val"].dtype == torch.bfloat16
            assert all(a.meta["val"].dtype == torch.bfloat16 for a in node.all_input_nodes)
            (user,) = node.users
            assert user.kwargs["dtype"] == torch.float32
    out = gm(x)
    assert out.dtype == torch.float32
    err = (out - expected).abs().max().item()
    assert 1e-5 < err < 5e-2 * expected.abs().max().item()   # bf16 rounding, visible and bounded


# -- with a GPU ------------------------------------------------------------------------------

TOL = {"atol": 2e-4, "rtol": 2e-4}


@pytest.fixture(scope="module")
def on_gpu():
    if not GPU or inductor.compiler() is None:
        pytest.skip("needs a CUDA device and a C++ compiler")
    out = {}
    for name, make in (("mlp", models.mlp), ("cnn", models.cnn), ("bert", models.bert)):
        model, example = make()
        kwargs = example if isinstance(example, dict) else None
        args = () if kwargs else (example,)
        compiled = kiln.trace(model, args, kwargs)             # device auto: the GPU
        out[name] = (model, args, kwargs or {}, compiled)
    return out


def _first(out):
    """The first output: last_hidden_state for HF models (an output object, or kiln's dict)."""
    if isinstance(out, dict) or hasattr(out, "last_hidden_state"):
        return out["last_hidden_state"]
    return out


def _eager(model, args, kwargs):
    with torch.no_grad():
        return _first(model(*args, **kwargs))


@needs_gpu
@pytest.mark.parametrize("name", ["mlp", "cnn", "bert"])
def test_gpu_models_match_eager(on_gpu, name):
    model, args, kwargs, compiled = on_gpu[name]
    m = compiled.manifest
    assert m["target"]["device"] == "cuda" and m["target"]["cuda"]["capability"]
    assert {p["engine"] for p in m["partitions"]} == {"inductor"}
    out = _first(compiled(*args, **kwargs))
    assert out.device.type == "cpu"                       # CPU in, CPU out
    assert_close(out, _eager(model, args, kwargs), **TOL)


@needs_gpu
def test_gpu_inputs_give_gpu_outputs(on_gpu):
    model, args, _, compiled = on_gpu["cnn"]
    x = args[0].cuda()
    out = compiled(x)
    assert out.device.type == "cuda"
    assert_close(out.cpu(), _eager(model, args, {}), **TOL)


@needs_gpu
def test_gpu_artifact_loads_in_a_fresh_process(on_gpu, tmp_path):
    model, args, _, compiled = on_gpu["cnn"]
    path = tmp_path / "cnn.kiln"
    compiled.save(str(path))
    torch.save(args[0], tmp_path / "x.pt")
    torch.save(_eager(model, args, {}), tmp_path / "y.pt")
    code = f"""
import torch, kiln
m = kiln.load({str(path)!r})
x, y = torch.load({str(tmp_path / 'x.pt')!r}), torch.load({str(tmp_path / 'y.pt')!r})
torch.testing.assert_close(m(x), y, atol=2e-4, rtol=2e-4)
torch.testing.assert_close(m(x.cuda()).cpu(), y, atol=2e-4, rtol=2e-4)
print("ok", m.manifest["target"]["cuda"]["name"])
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@needs_gpu
def test_gpu_bf16_auto_cast_runs_natively(on_gpu):
    model, args, _, fp32 = on_gpu["mlp"]
    compiled = kiln.trace(model, args, compiler_args="--auto-cast matmult --auto-cast-type bf16", min_top1=0.5)
    p = compiled.manifest["precision"]
    assert p["emulated"] is False and p["ops_lowered"] > 0
    assert compiled.manifest["validation"]["min_cosine"] > 0.999
    expected = _eager(model, args, {})
    err_fp32 = (fp32(*args) - expected).abs().max().item()
    err_bf16 = (compiled(*args) - expected).abs().max().item()
    assert err_fp32 < 1e-4 < err_bf16 < 5e-2 * expected.abs().max().item()


@needs_gpu
def test_gpu_o3_keeps_its_fastest_measured_variant(on_gpu):
    model, args, _, _ = on_gpu["mlp"]
    compiled = kiln.trace(model, args, optlevel=3)
    (part,) = compiled.manifest["partitions"]
    timed = [c for c in part["candidates"] if "latency_ms" in c]
    assert timed and all(c["engine"] == "inductor" for c in timed)
    best = min(timed, key=lambda c: c["latency_ms"])
    assert part.get("variant") == best.get("variant")
    assert_close(compiled(*args), _eager(model, args, {}), **TOL)


@needs_gpu
@needs_cxx
def test_gpu_conv_net_at_torchs_default_flags_is_held_to_tf32():
    """torch lets cuDNN convolutions use TF32 by default: eager's own answers then differ
    from strict fp32 by more than atol=1e-3 on large outputs (ResNet-50: 0.38 on outputs up
    to 254). The check holds such a graph to TF32's precision, and says so."""
    from kiln.host import tf32
    model, x = models.cnn()
    compiled = kiln.trace(model, x, device="cuda")
    v = compiled.manifest["validation"]
    assert v["passed"]
    if tf32.in_effect()["conv"]:             # Ampere on, torch's default flags
        assert v["precision"] == "tf32"
        assert any("TF32 precision" in n for n in compiled.manifest["report"]["notes"])
    else:
        assert v["precision"] == "fp32"


@needs_gpu
@needs_cxx
def test_gpu_conv_net_traced_from_gpu_tensors():
    """A model and inputs already on the GPU (benchmarks/gpu.py's way): the compile's own
    runs, the non-finite probe's included, stay there. Its probe inputs were made on the CPU
    and ResNet-50's first convolution refused them (11-28, H100)."""
    model, x = models.cnn()
    model, x = model.cuda(), x.cuda()
    compiled = kiln.trace(model, x, device="cuda")
    assert compiled.manifest["validation"]["passed"]
    out = compiled(x)
    assert out.is_cuda
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)   # cuDNN's TF32 in both


@needs_gpu
@needs_cxx
def test_gpu_tf32_auto_cast_is_checked_at_tf32():
    from kiln.host import tf32
    if not tf32.computed_here():
        pytest.skip("the GPU has no TF32 (before Ampere)")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type tf32")
    assert compiled.manifest["precision"]["type"] == "tf32"
    assert compiled.manifest["validation"]["precision"] == "tf32"
    assert_close(compiled(x), model(x).detach(), atol=1e-2, rtol=1e-2)


# -- CUDA graphs (kiln.runtime.cuda_graphs) --------------------------------------------------

def _inputs_like(args, kwargs, seed):
    """Fresh inputs of the compiled shapes: random floats, token ids in range, masks kept."""
    g = torch.Generator().manual_seed(seed)

    def fresh(t):
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g, dtype=t.dtype)
        if t.dtype == torch.long and t.max() > 1:                  # token ids
            return torch.randint(0, int(t.max()) + 1, t.shape, generator=g)
        return t.clone()
    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


@needs_gpu
@pytest.mark.parametrize("name", ["cnn", "bert"])
def test_gpu_calls_replay_one_captured_graph_and_never_overwrite_held_outputs(on_gpu, name):
    """Five calls in a row with other inputs, on the GPU and from the CPU, every output held:
    each equals eager on its own inputs after all five ran (the graph's buffers are reused by
    each replay; what the caller holds must not be)."""
    model, args, kwargs, compiled = on_gpu[name]
    graph = compiled.cuda_graph
    assert graph is not None
    compiled(*args, **kwargs)
    assert graph.captured, graph.state
    before = graph.replays
    held = []
    for seed in range(5):
        a, kw = _inputs_like(args, kwargs, seed)
        on_gpu_now = seed % 2 == 0
        if on_gpu_now:
            a, kw = tuple(t.cuda() for t in a), {k: v.cuda() for k, v in kw.items()}
        out = _first(compiled(*a, **kw))
        assert out.device.type == ("cuda" if on_gpu_now else "cpu")
        held.append((a, kw, out))
    assert graph.replays == before + 5 and graph.state == "captured"
    for a, kw, out in held:
        cpu_a, cpu_kw = tuple(t.cpu() for t in a), {k: v.cpu() for k, v in kw.items()}
        assert_close(out.cpu(), _eager(model, cpu_a, cpu_kw), **TOL)


@needs_gpu
def test_gpu_graphs_can_be_turned_off(on_gpu, tmp_path, monkeypatch):
    from kiln.runtime.options import RuntimeOptions
    model, args, _, compiled = on_gpu["mlp"]
    path = tmp_path / "mlp.kiln"
    compiled.save(str(path))
    plain = kiln.runtime.model.CompiledModel(compiled._artifact, RuntimeOptions(cuda_graphs=False))
    assert plain.cuda_graph is None
    assert_close(plain(*args), _eager(model, args, {}), **TOL)
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "off")
    assert kiln.load(str(path), trust_native_code=True).cuda_graph is None
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "on")
    assert kiln.load(str(path), trust_native_code=True).cuda_graph is not None


# -- torch.compile(backend="kiln") training on CUDA tensors ----------------------------------

def _bert_classifier():
    from transformers import BertForSequenceClassification
    torch.manual_seed(0)
    cfg = models.tiny_bert_config(num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


@needs_gpu
@needs_cxx
@pytest.mark.parametrize("kind", ["bert", "cnn"])
def test_gpu_torch_compile_training_compiles_and_equals_eager(kind, monkeypatch):
    """Every graph compiled (no warning: nothing ran eagerly), the losses and weights of
    three AdamW steps equal eager's on the same GPU. Convolutions in strict fp32 for both
    (torch lets cuDNN use TF32 by default): AdamW turns TF32's noise on near-zero gradients
    into steps of full size."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    # a registered kiln device would make PyTorch's autograd fail every CUDA backward pass
    # (kiln.device.registration.spares_cuda); conftest leaves it out where a GPU is
    assert torch.accelerator.current_accelerator().type == "cuda"
    import copy
    import warnings
    from kiln.device import metrics
    torch._dynamo.reset()
    metrics.clear()
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (8,), generator=g).cuda()
    if kind == "bert":
        ref = _bert_classifier().cuda()
        x = {"input_ids": torch.randint(0, 120, (8, 16), generator=g).cuda()}
        loss_of = lambda m: torch.nn.functional.cross_entropy(m(**x).logits, y)    # noqa: E731
    else:
        torch.manual_seed(0)
        # no bias before BatchNorm (as a real CNN has it): that bias's gradient is zero up
        # to rounding, which AdamW turns into full steps in directions that differ between
        # any two kernels (0.016 apart after three steps on an H200, eager against kiln)
        ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                  torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
                                  torch.nn.Linear(32, 4)).cuda()
        xs = torch.randn(8, 3, 12, 12, generator=g).cuda()
        loss_of = lambda m: torch.nn.functional.cross_entropy(m(xs), y)            # noqa: E731
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="kiln", options={"optlevel": 1}, dynamic=False)

    def train(m, run, steps=3):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_of(run)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    expected = train(ref, ref)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = train(model, compiled)
    eager = [str(w.message) for w in seen if "runs eagerly" in str(w.message)]
    assert not eager, "\n".join(eager)                          # every graph compiled
    assert metrics.counter_value("EagerGraphs") == 0
    assert metrics.counter_value("UncachedCompile") + metrics.counter_value("CachedCompile") >= 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-3, atol=1e-4)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-2, atol=1e-3, msg=lambda m: f"{name}: {m}")
    torch._dynamo.reset()


# last in the file: a failed capture must leave the GPU usable for what follows
@needs_gpu
def test_gpu_program_that_cannot_be_captured_runs_uncaptured_with_a_warning(on_gpu):
    """A program that waits for the CPU mid-call (here: reads a value back) cannot be
    captured: the model says why once and answers from its uncaptured program."""
    from kiln.runtime.cuda_graphs import GraphedProgram
    from kiln.runtime.options import RuntimeOptions
    model, args, _, compiled = on_gpu["mlp"]
    fresh = kiln.runtime.model.CompiledModel(compiled._artifact, RuntimeOptions())
    real = fresh.program

    def syncing():
        def run(inputs):
            inputs[0].sum().item()                  # a device-to-host read: not allowed while capturing
            return real(inputs)
        return run
    fresh.cuda_graph = GraphedProgram(syncing, fresh.cuda_graph.device, name="the test's model")
    assert_close(fresh(*args), _eager(model, args, {}), **TOL)       # a first call is never captured
    with pytest.warns(RuntimeWarning, match="could not be captured as a CUDA graph"):
        out = fresh(*args)
    assert fresh.cuda_graph.state.startswith("uncaptured: "), fresh.cuda_graph.state
    assert_close(out, _eager(model, args, {}), **TOL)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # said once
        assert_close(fresh(args[0].cuda()).cpu(), _eager(model, args, {}), **TOL)
        # the failed capture left the GPU usable: the compiled model's own graph still replays,
        # and random draws on the GPU work (PyTorch leaves its generator "capturing" after a
        # capture that fails at its end: kiln.runtime.cuda_graphs.end_failed_capture)
        assert_close(compiled(args[0].cuda()).cpu(), _eager(model, args, {}), **TOL)
        assert torch.rand(64, device="cuda").std() > 0
        assert 0 < int((torch.nn.functional.dropout(torch.ones(256, device="cuda"), 0.5) == 0).sum()) < 256
