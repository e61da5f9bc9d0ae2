"""Neuron spellings: kiln.neuronx / kiln.neuron and compiler flags."""
import pytest
import torch

import kiln
import kiln.neuron as torch_neuron
import kiln.neuronx as torch_neuronx
from kiln.compiler.options import parse_compiler_args
from tests import models
from tests.conftest import assert_close


def test_neuronx_trace_defaults_to_no_fallback():
    model, x = models.custom_op()
    with pytest.raises(kiln.UnsupportedOpError, match="kilntest::odd_scale"):
        torch_neuronx.trace(model, x)


def test_neuronx_partitioner_config_enables_fallback(tmp_path):
    model, x = models.custom_op()
    cfg = torch_neuronx.PartitionerConfig()
    traced = torch_neuronx.trace(model, x, partitioner_config=cfg, compiler_args=["-O2"],
                                 compiler_workdir=str(tmp_path))
    assert_close(traced(x), model(x).detach())
    assert (tmp_path / "model.kiln").exists() and (tmp_path / "report.json").exists()
    strict = torch_neuronx.PartitionerConfig(max_subgraph_count=1)
    with pytest.raises(kiln.UnsupportedOpError, match="max_subgraph_count=1"):
        torch_neuronx.trace(model, x, partitioner_config=strict)


def test_neuronx_seed_script_after_import_swap(tmp_path):
    """The seed documents' script, with torchvision's ResNet replaced by a transformers one."""
    model = models.tiny_resnet()
    image = torch.rand(1, 3, 32, 32)
    trace = torch_neuronx.trace(model, image)
    torch.jit.save(trace, str(tmp_path / "model.pt"))
    loaded = torch.jit.load(str(tmp_path / "model.pt"))
    assert_close(loaded(image)[1], model(image).pooler_output.detach())


def test_neuronx_placement_and_load_calls(tmp_path):
    """move_trace_to_device runs the model on that kiln core; lazy_load and async_load change
    nothing (a kiln model is loaded when it is returned); replace_weights is a clear error."""
    model = models.tiny_resnet()
    image = torch.rand(1, 3, 32, 32)
    trace = torch_neuronx.trace(model, image)
    want = model(image).pooler_output.detach()
    torch_neuronx.move_trace_to_device(trace, 0)
    assert trace.core.id == 0
    torch_neuronx.lazy_load(trace)
    torch_neuronx.async_load(trace)
    assert_close(trace(image)[1], want)
    with pytest.raises(kiln.errors.CompilerArgsError, match="inline_weights_to_neff=False"):
        torch_neuronx.replace_weights(trace, model.state_dict())
    with pytest.raises(TypeError, match="takes a model returned by kiln.neuronx.trace"):
        torch_neuronx.lazy_load(model)


def test_neuronx_analyze_dict():
    model, x = models.custom_op()
    d = torch_neuronx.analyze(model, x)
    assert d["support_percentage"].endswith("%")
    assert d["supported_operators"]["aten::addmm"] == 2
    (u,) = d["unsupported_operators"]
    assert u["kind"] == "kilntest::odd_scale" and "models.py" in u["call"]


def test_neuron_trace_falls_back_with_minimum_segment_size(caplog):
    model, x = models.custom_op()
    with caplog.at_level("WARNING", logger="kiln"):
        traced = torch_neuron.trace(model, x, separate_weights=True)   # fallback=True, minimum_segment_size=2
    assert "separate_weights=True is accepted and has no effect" in caplog.text      # said, not silently dropped
    assert_close(traced(x), model(x).detach())
    traced = torch_neuron.trace(model, x, minimum_segment_size=3)
    assert len(traced.manifest["partitions"]) == 1
    with pytest.raises(kiln.UnsupportedOpError):
        torch_neuron.trace(model, x, fallback=False)


def test_neuron_analyze_model_prints(capsys):
    model, x = models.custom_op()
    torch_neuron.analyze_model(model, x)
    out = capsys.readouterr().out
    assert "83.33% of all operations (5 of 6) are supported" in out
    # torch_neuron's second line: views and copies (here two permutes) are no arithmetic
    assert "75.00% of arithmetic operations (3 of 4) are supported" in out


@pytest.mark.parametrize("args, expected", [
    (["-O1"], {"optlevel": 1}),
    ("--optlevel 3", {"optlevel": 3}),
    (["--optlevel=2", "--target", "generic"], {"optlevel": 2, "target": "generic"}),
    (["--auto-cast", "none", "--auto-cast-type=fp32"], {"auto_cast": "none", "auto_cast_type": "fp32"}),
    # a type alone casts the matmuls, as neuronx-cc's default --auto-cast does (it was fp32)
    (["--auto-cast-type", "fp16"], {"auto_cast": "matmult", "auto_cast_type": "fp16"}),
])
def test_compiler_args_parse(args, expected):
    assert parse_compiler_args(args) == expected


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown compiler flag '--bogus'"),
    (["--optlevel", "7"], "expected 1, 2 or 3"),
    (["--target", "inf2"], "names a Neuron chip"),
    (["--auto-cast"], "needs a value"),
])
def test_compiler_args_errors(args, message):
    with pytest.raises(kiln.CompilerArgsError, match=message):
        parse_compiler_args(args)


def test_auto_cast_type_cpus_lack_is_an_error_not_ignored():
    model, x = models.mlp()
    with pytest.raises(kiln.CompilerArgsError, match="tf32 is not supported on CPUs"):
        kiln.trace(model, x, compiler_args=["--auto-cast", "matmult", "--auto-cast-type", "tf32"])


def test_generic_target_and_o1_compile():
    model, x = models.mlp()
    generic = kiln.trace(model, x, compiler_args="--target generic -O1")
    assert generic.manifest["target"]["target"] == "generic"
    assert set(generic.manifest["target"]["isa"]) <= {"sse4_2"}
    assert_close(generic(x), model(x).detach())


class _Biased(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 4)

    def forward(self, x, bias):            # bias: one row every row of the batch shares
        return self.linear(x) + bias


class _Across(torch.nn.Module):
    def forward(self, x):                  # neither output follows the batch on dim 0
        return x.t() * 2, x.mean()


def test_a_jit_loaded_model_in_neurons_wrappers_and_outputs_that_do_not_follow_the_batch(tmp_path):
    """Found by probing: a model back from torch.jit.load (Neuron's serving pattern) was refused
    by dynamic_batch, move_trace_to_device and lazy_load; and dynamic_batch handed back the
    first chunk's value of an output that does not follow the batch (x.mean() over 8 rows
    was the mean of the first 4; x.t() lost half its columns)."""
    model, x, bias = _Biased().eval(), torch.randn(2, 16), torch.randn(4)
    torch.jit.save(torch_neuronx.trace(model, (x, bias)), str(tmp_path / "m.pt"))
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    five = torch.randn(5, 16)
    assert_close(torch_neuronx.dynamic_batch(loaded)(five, bias), model(five, bias).detach(), atol=1e-5, rtol=1e-5)
    torch_neuronx.move_trace_to_device(loaded, 0)
    torch_neuronx.lazy_load(loaded)
    assert_close(loaded(x, bias), model(x, bias).detach(), atol=1e-5, rtol=1e-5)
    across = torch_neuronx.dynamic_batch(torch_neuronx.trace(_Across(), torch.randn(4, 8)))
    four = torch.randn(4, 8)
    assert_close(across(four)[1], four.mean(), atol=1e-6, rtol=1e-6)         # the compiled batch: one chunk
    with pytest.raises(kiln.InputError, match=r"not proven to give the model.s answers: an output.s shape depends on the batch size"):
        across(torch.randn(8, 8))


def test_neuron_cc_flags_reach_neurons_traces(monkeypatch):
    """NEURON_CC_FLAGS, where Neuron scripts set compiler flags, was read by the device and
    the trainer but not by torch_neuronx.trace / torch_neuron.trace: an fp16 run computed in
    fp32. Flags kiln does not take are ignored with a warning; compiler_args given win."""
    model, x = models.mlp()
    monkeypatch.setenv("NEURON_CC_FLAGS", "--auto-cast all --auto-cast-type fp16 --model-type transformer")
    with pytest.warns(RuntimeWarning, match="--model-type transformer mean nothing"):
        traced = torch_neuronx.trace(model, x)
    assert traced.manifest["precision"]["auto_cast"] == "all" and traced.manifest["precision"]["type"] == "fp16"
    with pytest.warns(RuntimeWarning, match="--model-type"):
        plain = torch_neuron.trace(model, x, compiler_args=["--auto-cast", "none"])
    assert not plain.manifest.get("precision")
    assert_close(plain(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    # a bad value there is the variable's error, as the device says it, not the script's arguments'
    monkeypatch.setenv("NEURON_CC_FLAGS", "--auto-cast-type fp8")
    for trace in (torch_neuronx.trace, torch_neuron.trace):
        with pytest.raises(kiln.CompilerArgsError, match="^NEURON_CC_FLAGS: .*fp8"):
            trace(model, x, compiler_args=["-O1"])
    # compiler_args given to Neuron's traces are read the same way: a ported script's
    # "--model-type=transformer --verbose 1" raised CompilerArgsError (found by probing);
    # kiln.trace's own compiler_args stay strict
    monkeypatch.delenv("NEURON_CC_FLAGS")
    with pytest.warns(RuntimeWarning, match="compiler_args --model-type=transformer --verbose 1 mean nothing"):
        traced = torch_neuronx.trace(model, x, compiler_args="--model-type=transformer --verbose 1 -O1")
    assert traced.manifest["compile_options"]["optlevel"] == 1
    assert_close(traced(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(kiln.CompilerArgsError, match="unknown compiler flag '--verbose'"):
        kiln.trace(model, x, compiler_args="--verbose 1")


def test_ops_to_partition_takes_bare_names_and_warns_of_names_the_graph_lacks():
    """PartitionerConfig(ops_to_partition={"relu"}) kept nothing on the host, without a word
    (only "aten::relu" matched); a misspelt name did the same."""
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), torch.randn(2, 8)
    bare = torch_neuronx.trace(model, x, partitioner_config=torch_neuronx.PartitionerConfig(ops_to_partition={"relu"}))
    assert bare.report["host_ops"] == 1
    assert_close(bare(x), model(x).detach(), atol=1e-6, rtol=1e-6)
    with pytest.warns(UserWarning, match="ops_on_host names aten::rleu, which this graph has no operation of"):
        torch_neuronx.trace(model, x, partitioner_config=torch_neuronx.PartitionerConfig(ops_to_partition={"rleu"}))


def test_each_jit_load_of_one_file_is_its_own_model_on_its_own_core(tmp_path, monkeypatch):
    """Found by probing: two torch.jit.loads of one file shared one kiln model (found by the
    bytes' checksum), so move_trace_to_device(a, 0) then (b, 1) put both on core 1. Each
    load is now its own model: placed apart, each running its own calls, both right."""
    from kiln.compat.common import as_model
    from kiln.host import cores
    monkeypatch.setenv("KILN_CPUS_PER_CORE", "1")
    for name in ("KILN_VISIBLE_CORES", "KILN_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES"):
        monkeypatch.delenv(name, raising=False)
    if len(cores.visible()) < 2:
        pytest.skip("needs 2 kiln cores")
    model, x = models.mlp()
    torch.jit.save(torch_neuronx.trace(model, x), str(tmp_path / "m.pt"))
    a, b = torch.jit.load(str(tmp_path / "m.pt")), torch.jit.load(str(tmp_path / "m.pt"))
    torch_neuronx.move_trace_to_device(a, 0)
    torch_neuronx.move_trace_to_device(b, 1)
    ma, mb = as_model(a), as_model(b)
    assert ma is not mb and (ma.core.id, mb.core.id) == (0, 1)
    want = model(x).detach()
    for _ in range(2):
        assert_close(a(x), want, atol=1e-5, rtol=1e-5)
    assert_close(b(x), want, atol=1e-5, rtol=1e-5)
    assert (ma.calls, mb.calls) == (2, 1)           # each module's calls ran on its own model
    assert as_model(a) is ma and (ma.core.id, mb.core.id) == (0, 1)


def test_a_neuron_traced_models_save_writes_what_torch_jit_load_reads(tmp_path):
    """Found by probing: traced.save("m.pt"), as Neuron's tutorials save their TorchScript
    modules, wrote a .kiln artifact, and torch.jit.load("m.pt") failed with torch's raw
    "file in archive is not in a subdirectory: manifest.json". Both Neuron spellings' traces
    (and dynamic_batch's model) now save TorchScript; a .kiln path still gets kiln's artifact."""
    import io
    from tests.conftest import run_py
    model, x = models.mlp()
    torch_neuronx.trace(model, x).save(str(tmp_path / "x.pt"))
    torch_neuron.trace(model, x).save(tmp_path / "n.pt")
    torch_neuronx.dynamic_batch(torch_neuronx.trace(model, x)).save(str(tmp_path / "d.pt"))
    five = torch.randn(5, 16)
    torch.save({"x": x, "want": model(x).detach(), "five": five, "want5": model(five).detach()}, tmp_path / "io.pt")
    code = f"""
import torch
d = torch.load({str(tmp_path / 'io.pt')!r})
for name in ("x.pt", "n.pt"):
    torch.testing.assert_close(torch.jit.load({str(tmp_path)!r} + "/" + name)(d["x"]), d["want"], atol=1e-5, rtol=1e-5)
torch.testing.assert_close(torch.jit.load({str(tmp_path / 'd.pt')!r})(d["five"]), d["want5"], atol=1e-5, rtol=1e-5)
print("OK")
"""
    r = run_py(code, cwd=str(tmp_path))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    traced = torch_neuronx.trace(model, x)
    buf = io.BytesIO()
    traced.save(buf)
    buf.seek(0)
    assert_close(torch.jit.load(buf)(x), model(x).detach(), atol=1e-5, rtol=1e-5)
    traced.save(str(tmp_path / "m.kiln"))
    assert_close(kiln.load(str(tmp_path / "m.kiln"))(x), model(x).detach(), atol=1e-5, rtol=1e-5)


def test_kiln_load_of_a_torchscript_file_says_to_use_torch_jit_load(tmp_path):
    """A Neuron spelling's traced.save("m.pt") writes TorchScript; kiln.load of it said only
    "zip archive without manifest.json; not a kiln artifact"."""
    model, x = models.mlp()
    torch_neuronx.trace(model, x).save(str(tmp_path / "m.pt"))
    with pytest.raises(kiln.errors.ArtifactError, match="TorchScript archive.*torch.jit.load"):
        kiln.load(str(tmp_path / "m.pt"))
