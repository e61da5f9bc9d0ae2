"""NxD pipeline parallelism (``kiln.neuronx_distributed.pipeline.NxDPPModel``).

In-process: NxD's 1F1B order, the auto_partition split, cutting a traced graph into
stages (values that skip a stage pass through it; the stages chained equal the model),
unsupported options. Over 2 processes (torchrun, PP=2, 4 microbatches, a tiny LM with
tied embeddings split across the ranks): losses step by step, the eval loss and every
parameter after 3 AdamW steps equal the same model trained in one process on the full
batch, on plain CPU tensors (gloo, plus auto_partition's and pipeline_cuts' splits, a
wrong run_train call, broadcast_and_average_loss and the trainer's
initialize_parallel_model path in the same launch) and on kiln's device in lazy mode.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from kiln.distributed import pipeline_cut, schedule
from kiln.distributed.pipeline import NxDPPModel, PipelineError
from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "data", "nxd_pp_train.py")


def _script():
    spec = importlib.util.spec_from_file_location("nxd_pp_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return _script().reference()


def _names(step):
    short = {"ForwardPreprocessTask": "recvF", "ForwardStepTask": "F", "ForwardPostprocessTask": "sendF",
             "BackwardPreprocessTask": "recvB", "BackwardStepTask": "B", "BackwardPostprocessTask": "sendB"}
    return [f"{short[type(t).__name__]}{t.mb}" if type(t).__name__ in short else "reduce" for t in step]


def test_1f1b_order_is_nxds():
    first = [_names(s) for s in schedule.Train1F1BSchedule(4, 2, 0).steps()]
    assert first == [["recvF0", "F0", "sendF0"], ["recvF1", "F1"], ["recvB0", "sendF1", "B0"],
                     ["recvF2", "F2"], ["recvB1", "sendF2", "B1"], ["recvF3", "F3"],
                     ["recvB2", "sendF3", "B2"], ["recvB3", "B3"], ["reduce"]]
    last = [_names(s) for s in schedule.Train1F1BSchedule(4, 2, 1).steps()]
    assert last == [["recvF0", "F0"], ["B0", "sendB0"], ["recvF1", "F1"], ["B1", "sendB1"],
                    ["recvF2", "F2"], ["B2", "sendB2"], ["recvF3", "F3"], ["B3", "sendB3"], ["reduce"]]
    # the docstring's PP4 x 6 picture: computation order of each rank
    pictured = {0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5", 1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5", 3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"}
    for rank, order in pictured.items():
        steps = [n for s in schedule.Train1F1BSchedule(6, 4, rank).steps() for n in _names(s)
                 if n[0] in "FB"]
        assert " ".join(steps) == order
    with pytest.raises(schedule.ScheduleError, match="virtual_pipeline_size=2"):
        schedule.TrainInterleavedSchedule(4, 2, 2, 0)


def test_auto_partition_split_gives_the_remainder_to_later_stages():
    layers = [f"layers.{i}" for i in range(10)]
    assert pipeline_cut.auto_cuts(4, layers) == ["layers.1", "layers.3", "layers.6"]   # 2, 2, 3, 3
    assert pipeline_cut.auto_cuts(2, layers[:3]) == ["layers.0"]                        # 1, 2
    with pytest.raises(PipelineError, match="cannot fill"):
        pipeline_cut.auto_cuts(3, layers[:2])


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)), x.mean()          # a tuple crosses the cut whole


class _Skip(nn.Module):
    """The embedding's output skips two stages; the head reads ``mask`` (a model input)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, ids, mask):
        e = self.embed(ids)
        x = e
        for layer in self.layers:
            x, m = layer(x)
        return (self.head(x + e) * mask).sum() + m


def test_cut_stages_chain_equals_the_model():
    torch.manual_seed(0)
    model = _Skip()
    traced = pipeline_cut.trace_model(model, ["ids", "mask"], [_Layer])
    stages = pipeline_cut.cut_stages(traced, ["layers.0", "layers.1"], ["ids", "mask"])
    assert [s.model_inputs for s in stages] == [["ids"], [], ["mask"]]
    # the layer's (x, mean) tuple crosses whole; the embedding passes through the middle stage
    assert stages[0].sent == stages[1].received == ["embed", "layers_0"]
    assert stages[1].sent == stages[2].received == ["embed", "layers_1"]
    assert sorted(stages[2].module.state_dict()) == ["head.bias", "head.weight", "layers.2.fc.bias",
                                                     "layers.2.fc.weight"]
    ids, mask = torch.randint(0, 10, (3, 5)), torch.rand(3, 5, 1)
    feed = {"ids": ids, "mask": mask}
    values = []
    for stage in stages:
        out = stage.module(*values, *[feed[n] for n in stage.model_inputs])
        values = list(out) if stage.index < 2 else out
    torch.testing.assert_close(values, model(ids, mask), rtol=0, atol=0)
    with pytest.raises(PipelineError, match="'layers.7' is not a module called"):
        pipeline_cut.cut_stages(traced, ["layers.7"], ["ids", "mask"])


class _LossLM(nn.Module):
    """A pipeline model whose own forward (not a leaf) calls kiln's collective functions:
    sequence-parallel mappings, parallel_cross_entropy (which subtracts the max from the
    logits in place), and an in-place op whose result is not used."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(8, 10)

    def forward(self, ids, labels):
        from kiln.neuronx_distributed.parallel_layers import mappings, parallel_cross_entropy
        x = mappings.scatter_to_sequence_parallel_region(self.embed(ids), 1)
        x = mappings.gather_from_sequence_parallel_region(x, 1, to_model_parallel=False)
        for layer in self.layers:
            x, _ = layer(x)
        logits = self.head(x)
        logits.mul_(200.0)          # logits this large overflow exp() unless the max is subtracted
        return parallel_cross_entropy(logits, labels).mean()


def test_collective_functions_and_in_place_ops_stay_whole_in_the_pipeline_graph():
    """Traced into, parallel_cross_entropy's collectives (no autograd) zeroed every gradient
    at TP=2 and its in-place max subtraction was removed as dead code (inf/nan losses at
    PP=2, TP=1): now each collective function is one node, in-place ops stay, and the
    stages chained equal the eager model, loss and gradients."""
    import warnings

    from kiln.distributed import loss, mappings, state
    state.destroy_model_parallel()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state.ensure_initialized()
        torch.manual_seed(0)
        model = _LossLM()
        traced = pipeline_cut.trace_model(model, ["ids", "labels"], [_Layer])
        targets = [n.target for n in traced.graph.nodes if n.op in ("call_function", "call_method")]
        assert loss.parallel_cross_entropy in targets
        assert mappings.scatter_to_sequence_parallel_region in targets
        assert mappings.gather_from_sequence_parallel_region in targets
        assert "mul_" in targets and "sub_" not in targets and torch.exp not in targets
        stages = pipeline_cut.cut_stages(traced, ["layers.0"], ["ids", "labels"])
        ids, labels = torch.randint(0, 10, (3, 4)), torch.randint(0, 10, (3, 4))
        feed = {"ids": ids, "labels": labels}
        sent = stages[0].module(*[feed[n] for n in stages[0].model_inputs])
        got = stages[1].module(*sent, *[feed[n] for n in stages[1].model_inputs])
        got.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        logits = model.head(model.layers[1](model.layers[0](model.embed(ids))[0])[0]) * 200.0
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1))
        want.backward()
        assert torch.isfinite(got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    finally:
        state.destroy_model_parallel()


@pytest.mark.parametrize("option, value", [("deallocate_pipeline_outputs", True), ("manual_pp_partition", True),
                                           ("virtual_pipeline_size", 2), ("_fused_send_recv", True)])
def test_unsupported_options_are_named(option, value):
    with pytest.raises((PipelineError, schedule.ScheduleError), match=option):
        NxDPPModel(_Skip(), transformer_layer_cls=_Layer, **{option: value})
    with pytest.raises(TypeError, match="_no_such_flag"):
        NxDPPModel(_Skip(), transformer_layer_cls=_Layer, _no_such_flag=1)


def _check_training(printed, out, tag, reference, loss_tol, param_tol):
    losses, eval_loss, state = reference
    got = [float(v) for v in printed[f"{tag}_losses"].split()]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), **loss_tol)
    torch.testing.assert_close(float(printed[f"{tag}_eval"]), eval_loss, **loss_tol)
    assert printed[f"{tag}_nonlast"] == "[None, None, None] None"   # the first rank returns None
    first, last = (torch.load(out / f"{tag}_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert sorted(first) == sorted(["embed.weight"] + [k for k in state if k.startswith(("layers.0.", "layers.1."))])
    assert sorted(set(first) | set(last)) == sorted(state)
    for key, value in {**first, **last}.items():
        torch.testing.assert_close(value, state[key], **param_tol, msg=lambda m: f"{tag} {key}: {m}")
    torch.testing.assert_close(first["embed.weight"], last["lm_head.weight"], rtol=0, atol=0)   # still tied


def _run(kind, tmp_path, cache, env=None):
    """Launch the script; each rank's {key: value} result lines (from its own file)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", SCRIPT, kind, str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_URL=cache, **(env or {})))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        results.append(dict(line.split(" ", 1) for line in lines))
    return results


def test_pp2_on_cpu_tensors_equals_one_process(tmp_path, reference):
    r0, r1 = _run("gloo", tmp_path, str(tmp_path / "cache"), {"NXD_CPU_MODE": "1"})
    printed = {**r1, "pp_nonlast": r0["pp_nonlast"], "trainer_nonlast": r0["trainer_nonlast"]}
    tight = dict(rtol=1e-5, atol=1e-6)
    for tag in ("pp", "trainer"):       # NxDPPModel directly; through initialize_parallel_model
        _check_training(printed, tmp_path, tag, reference, tight, dict(rtol=1e-4, atol=1e-5))
    # auto_partition of 3 layers over 2 stages: 1 + 2 (the remainder to the later stage)
    assert r0["auto_cuts"] == "layers.0 local embed,layers.0"
    assert r1["auto_cuts"] == "layers.0 local layers.1,layers.2,lm_head,norm"
    # pipeline_cuts=["layers.1"]: the first stage ends after layers.1
    assert (r0["cuts_local"], r1["cuts_local"]) == ("embed,layers.0,layers.1", "layers.2,lm_head,norm")
    # load_state_dict of the whole model's state: each rank takes (and local_state_dict gives) its part
    assert (r0["load_state_dict"], r1["load_state_dict"]) == ("True 13 True", "True 9 True")
    for r in (r0, r1):
        assert "must be the traced input names" in r["kwargs_error"] and "missing ['labels']" in r["kwargs_error"]
        assert "virtual_pipeline_size=2" in r["vpp_error"]
        # broadcast_and_average_loss: both ranks get the last rank's loss (first batch, initial weights)
        torch.testing.assert_close(float(r["broadcast"]), reference[0][0], **tight)


@pytest.mark.slow
def test_pp2_on_the_kiln_device_lazy_mode_equals_one_process(tmp_path, reference):
    r0, r1 = _run("xla", tmp_path, str(tmp_path / "cache"))
    printed = {**r1, "pp_nonlast": r0["pp_nonlast"]}
    _check_training(printed, tmp_path, "pp", reference, dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-5))
