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
def test_gpu_tf32_auto_cast_is_checked_at_tf32():
    from kiln.host import tf32
    if not tf32.computed_here():
        pytest.skip("the GPU has no TF32 (before Ampere)")
    model, x = models.mlp()
    compiled = kiln.trace(model, x, compiler_args="--auto-cast matmult --auto-cast-type tf32")
    assert compiled.manifest["precision"]["type"] == "tf32"
    assert compiled.manifest["validation"]["precision"] == "tf32"
    assert_close(compiled(x), model(x).detach(), atol=1e-2, rtol=1e-2)
