"""NxD's core under kiln.neuronx_distributed: parallel state, parallel layers, mappings,
parallel cross-entropy, RNG tracker, grad clipping, GQA QKV, against unsharded PyTorch.

Two launches do the multi-process work (each rank runs many checks and prints one line per
check; see tests/data/nxd_layers_check.py and nxd_layout_check.py); the rest runs in this
process: errors, module paths, state-dict sharding, pad_model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
TP2_CHECKS = [
    "column_gather_output", "column_no_gather", "column_stride2", "row_input_not_parallel", "row_input_is_parallel",
    "skip_bias_add", "embedding_vocab_parallel", "embedding_shard_across_embedding", "embedding_options_vocab_parallel",
    "embedding_options_shard_across_embedding", "sequence_parallel_mlp",
    "parallel_cross_entropy_plain", "parallel_cross_entropy_label_smoothing", "gqa_qkv_fused", "gqa_qkv_unfused",
    "same_seed_shards_concatenate_to_tp1", "clip_grad_norm_matches_torch", "rng_tracker", "export_keeps_all_reduce", "kiln_device_eager_and_lazy",
    "legacy_load_failure_reaches_every_rank",
]


def _torchrun(script, nproc, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", KILN_CACHE_URL=str(tmp_path / "cache"), KILN_REGISTRY="off")
    proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={nproc}", os.path.join(DATA, script)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = _torchrun("nxd_layers_check.py", 2, tmp_path_factory.mktemp("tp2"))
    results = {}
    for line in out.splitlines():
        if line.startswith("CHECK "):
            _, name, verdicts = line.split(" ", 2)
            results[name] = json.loads(verdicts)
    return results, out


@pytest.mark.parametrize("name", TP2_CHECKS)
def test_tp2_matches_unsharded(tp2_results, name):
    """Each check ran on both ranks and passed on both (forward, input grads, weight-grad
    shards, at 1e-5 unless the check says otherwise)."""
    results, out = tp2_results
    verdicts = results.get(name)
    assert verdicts is not None and len(verdicts) == 2, f"{name} did not report on both ranks:\n{out[-2000:]}"
    assert verdicts == ["ok", "ok"], f"{name}: {verdicts}"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _torchrun("nxd_layout_check.py", 4, tmp_path_factory.mktemp("four"))


def test_rank_layout_on_four_ranks(four_ranks):
    """NxD's layout: arange(world).reshape(PP, DP, TP), TP contiguous."""
    out = four_ranks
    lay = json.loads(next(line for line in out.splitlines() if line.startswith("LAYOUT "))[len("LAYOUT "):])
    tp2 = lay["tp2"]
    assert tp2["meshes"] == {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]], "pp": [[0], [1], [2], [3]],
                             "zero1": [[0, 2], [1, 3]]}
    assert [r["tp"] for r in tp2["ranks"]] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    assert [r["dp"] for r in tp2["ranks"]] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert [r["tp_group_ranks"] for r in tp2["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_group_ranks"] for r in tp2["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp_src"] for r in tp2["ranks"]] == [0, 0, 2, 2]
    assert [r["dp_src"] for r in tp2["ranks"]] == [0, 1, 0, 1]
    assert tp2["ranks"][3]["rmsg"] == "[rank_3_pp0_tp1_dp1] x"
    assert "already initialized" in tp2["again"]
    pp = lay["tp2pp2"]
    assert pp["meshes"]["tp"] == [[0, 1], [2, 3]] and pp["meshes"]["pp"] == [[0, 2], [1, 3]]
    assert pp["meshes"]["dp"] == [[0], [1], [2], [3]]
    assert [r["pp"] for r in pp["ranks"]] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert [r["pp_group_ranks"] for r in pp["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(r["next"], r["prev"]) for r in pp["ranks"]] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert lay["tp3"].startswith("ParallelSizeError") and "not divisible" in lay["tp3"]
    for name, option in (("tp0", "tensor_model_parallel_size"), ("pp0", "pipeline_model_parallel_size")):
        assert lay[name].startswith("ParallelDegreeError") and f"{option}=0" in lay[name], lay[name]


def test_pp2_x_tp2_with_collectives_in_the_traced_forward_equals_one_process(four_ranks):
    """PP=2 x TP=2 through the trainer, the model's own forward calling sequence-parallel
    mappings and parallel_cross_entropy: the loss (last stage) and every rank's gradient
    shards equal one process's. Traced into, those calls failed to trace (the mappings) or
    left every gradient zero (parallel_cross_entropy's collectives have no autograd)."""
    line = next(line for line in four_ranks.splitlines() if line.startswith("PPTP "))
    ranks = json.loads(line[len("PPTP "):])
    assert [r[0] is None for r in ranks] == [True, True, False, False]     # the loss is on the last stage
    for rank, (loss_err, grad_err, zero) in enumerate(ranks):
        assert zero == 0, f"rank {rank}: {zero} all-zero gradients"
        assert grad_err < 1e-5, f"rank {rank}: gradient max-rel error {grad_err}"
        assert loss_err is None or loss_err < 1e-5, f"rank {rank}: loss error {loss_err}"


# -- in-process ------------------------------------------------------------------------------
@pytest.fixture
def fresh_state():
    from kiln.distributed import state
    state.destroy_model_parallel()
    yield state
    state.destroy_model_parallel()


def _fallback_layers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kiln.neuronx_distributed.parallel_layers import layers
        layers.ColumnParallelLinear(2, 2)
    return layers


def test_getters_before_init_say_what_to_do(fresh_state):
    from kiln.neuronx_distributed.parallel_layers import parallel_state as ps
    for getter in (ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_size,
                   ps.get_tensor_model_parallel_group):
        with pytest.raises(AssertionError, match="intra_layer_model parallel group is not initialized.*"
                                                 "initialize_model_parallel"):
            getter()
    with pytest.raises(AssertionError, match="data parallel group is not initialized"):
        ps.get_data_parallel_rank()
    assert ps.rmsg("m") == "[rank_0_pp-1_tp-1_dp-1] m"
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(AssertionError, match="init_process_group"):
        ps.initialize_model_parallel(2)      # torch.distributed is not initialized in this process


def test_non_divisible_world_is_a_runtime_error():
    from kiln.distributed import mesh
    with pytest.raises(RuntimeError, match=r"`world_size` \(4\) is not divisible by tensor_model_parallel_size \(3\)"):
        mesh.layout(4, tp=3)
    with pytest.raises(RuntimeError, match="expert_model_parallel_size"):
        mesh.layout(4, tp=2, ep=3)
    sizes, meshes = mesh.layout(8, tp=2, pp=2, cp=1)
    assert sizes["dp"] == 2 and meshes["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.layout(2, tp=8)[0]["tp"] == 2                     # clamped to the world
    assert mesh.layout(8, tp=2, cp=2)[1]["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]   # stride TP*CP


@pytest.mark.parametrize("sizes", [dict(tp=0), dict(pp=0), dict(cp=-1), dict(ep=0), dict(tp=1.5), dict(tp=True)])
def test_a_degree_below_one_is_a_value_error(sizes):
    from kiln.distributed import mesh
    option = next(iter(sizes))
    with pytest.raises(ValueError, match=f"{mesh.OPTION_NAMES[option]}={sizes[option]!r}: expected an int >= 1"):
        mesh.layout(4, **sizes)


def test_layers_self_initialize_with_a_warning(fresh_state):
    from kiln.neuronx_distributed.parallel_layers import ColumnParallelLinear
    with pytest.warns(UserWarning, match="parallel state is not initialized"):
        layer = ColumnParallelLinear(4, 6)
    assert fresh_state.get_tensor_model_parallel_size() == 1
    torch.manual_seed(0)
    layer = ColumnParallelLinear(4, 6)
    torch.manual_seed(0)
    ref = nn.Linear(4, 6)
    assert torch.equal(layer.weight, ref.weight) and torch.equal(layer.bias, ref.bias)
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), ref(x), atol=1e-6, rtol=0)


def test_unknown_and_unsupported_options(fresh_state):
    layers = _fallback_layers()
    from kiln.distributed.mesh import UnsupportedOptionError
    with pytest.raises(TypeError, match="bogus"):
        layers.ColumnParallelLinear(4, 4, bogus=1)
    with pytest.raises(TypeError, match="input_is_parallel"):
        layers.ColumnParallelLinear(4, 4, input_is_parallel=True)      # a Row option, as NxD
    with pytest.raises(UnsupportedOptionError, match="tile_cc"):
        layers.RowParallelLinear(4, 4, tile_cc=True)
    with pytest.raises(UnsupportedOptionError, match="use_spmd_rank"):
        layers.ParallelEmbedding(8, 4, use_spmd_rank=True)
    with pytest.raises(UnsupportedOptionError, match="rank_ordering"):
        layers.ColumnParallelLinear(4, 4, rank_ordering=[1, 0])
    layers.RowParallelLinear(4, 4, tile_cc=False, rank_ordering=None)   # defaults are accepted
    with pytest.raises(RuntimeError, match="input_is_parallel"):
        layers.RowParallelLinear(4, 4, sequence_parallel_enabled=True)


def test_pad_is_inference_only(fresh_state):
    layers = _fallback_layers()
    col = layers.ColumnParallelLinear(4, 5, pad=True, pad_alignment_size_per_rank=2)
    assert col.weight.shape == (6, 4) and col.pad_size == 1
    with pytest.raises(RuntimeError, match="only supported for inference"):
        col(torch.randn(2, 4))
    col.eval()
    assert col(torch.randn(2, 4)).shape == (2, 5)
    emb = layers.ParallelEmbedding(7, 4, pad=True).eval()
    assert emb(torch.tensor([1, 6])).shape == (2, 4)


def test_an_unpadded_checkpoint_loads_into_a_padded_layer_with_a_bias(fresh_state):
    """NxD's preshard_hook pads the weight only: the bias of a pad=True layer then failed the
    size check (gather_output=True) or the sharding on one rank (found at TP=2 by probing)."""
    layers = _fallback_layers()
    from kiln.distributed.shard import shard_state_dict
    for gather in (True, False):
        col = layers.ColumnParallelLinear(4, 5, pad=True, pad_alignment_size_per_rank=2, gather_output=gather).eval()
        full = {"weight": torch.randn(5, 4), "bias": torch.randn(5)}
        shard = shard_state_dict(col, dict(full), tp_rank=0, tp_size=1)
        assert shard["bias"].shape == (6,) and torch.equal(shard["bias"][:5], full["bias"])
        col.load_state_dict(shard)
        x = torch.randn(3, 4)
        y = col(x)              # without gather_output the padded column stays, for the row-parallel layer
        assert y.shape == (3, 5 if gather else 6) and (gather or torch.equal(y[:, 5], torch.zeros(3)))
        torch.testing.assert_close(y[:, :5], torch.nn.functional.linear(x, full["weight"], full["bias"]))


def test_shard_state_dict_and_stride(fresh_state):
    """An unsharded state dict is cut as the layers' own init is (stride chunks r::tp)."""
    layers = _fallback_layers()
    from kiln.distributed.shard import shard_state_dict
    model = nn.ModuleDict({"up": layers.ColumnParallelLinear(4, 8, gather_output=False, stride=2),
                           "down": layers.RowParallelLinear(8, 4, input_is_parallel=True)})
    full = {k: v.clone() for k, v in model.state_dict().items()}
    r1 = shard_state_dict(model, full, tp_rank=1, tp_size=2)
    assert torch.equal(r1["up.weight"], torch.cat([full["up.weight"][2:4], full["up.weight"][6:8]]))
    assert torch.equal(r1["up.bias"], torch.cat([full["up.bias"][2:4], full["up.bias"][6:8]]))
    assert torch.equal(r1["down.weight"], full["down.weight"][:, 4:8])
    assert torch.equal(r1["down.bias"], full["down.bias"])          # replicated: kept whole


def test_gqa_asserts_are_clear_errors(fresh_state):
    _fallback_layers()
    from kiln.neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
    with pytest.raises(ValueError, match="kv_size_multiplier"):
        GQAQKVColumnParallelLinear(16, [8, 4], kv_size_multiplier=2)      # TP 1 is not divisible by 2
    q, k, v = GQAQKVColumnParallelLinear(16, [8, 4], fuse_qkv=False)(torch.randn(2, 16))
    assert q.shape == (2, 8) and k.shape == v.shape == (2, 4)


def test_pad_model_keeps_outputs(fresh_state):
    layers = _fallback_layers()
    from kiln.neuronx_distributed.parallel_layers.pad import get_number_of_extra_heads, pad_model
    assert get_number_of_extra_heads(9, 2) == 1 and get_number_of_extra_heads(8, 4) == 0
    assert get_number_of_extra_heads(9, 4) == 3
    model = nn.Sequential(layers.ColumnParallelLinear(8, 9 * 2, gather_output=False),
                          layers.RowParallelLinear(9 * 2, 8, input_is_parallel=True))
    x = torch.randn(3, 8)
    want = model(x)
    pad_model(model, tp_degree=2, n_heads=9)
    assert model[0].weight.shape == (20, 8) and model[1].weight.shape == (8, 20)
    assert model[0].weight.tensor_model_parallel
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=0)


def test_module_paths():
    import kiln.distributed.state as impl
    import kiln.neuronx_distributed as nxd
    from kiln.neuronx_distributed import parallel_state as documented
    from kiln.neuronx_distributed.parallel_layers import parallel_state as real
    assert documented is real is impl, "one module object, one set of state"
    pl = nxd.parallel_layers
    for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "parallel_cross_entropy",
                 "clip_grad_norm", "initialize_model_parallel", "get_xla_rng_tracker", "model_parallel_xla_manual_seed",
                 "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
                 "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
                 "copy_tensor_model_parallel_attributes", "set_tensor_model_parallel_attributes",
                 "set_defaults_if_not_set_tensor_model_parallel_attributes", "split_tensor_along_last_dim",
                 "move_model_to_device", "PARALLEL_MODULES", "PARALLEL_FUNCTIONS"):
        assert hasattr(pl, name), name
    assert callable(impl.get_data_parallel_world_size) and callable(impl.get_tensor_parallel_size)
    from kiln.neuronx_distributed.parallel_layers import layers
    assert issubclass(layers.ColumnParallelLinear, layers.BaseParallelLinear)     # scripts test isinstance
    assert issubclass(layers.RowParallelLinear, layers.BaseParallelLinear)
    assert not issubclass(layers.ParallelEmbedding, layers.BaseParallelLinear)
    from kiln.neuronx_distributed.parallel_layers.layer_norm import LayerNorm
    from kiln.neuronx_distributed.modules.rms_norm import RMSNorm
    assert LayerNorm(4, sequence_parallel_enabled=True).weight.sequence_parallel_enabled
    norm = RMSNorm(4)
    x = torch.randn(2, 4)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    with pytest.raises(AttributeError, match="no attribute"):
        nxd.not_a_thing  # noqa: B018


def test_the_helpers_nxds_training_scripts_import(monkeypatch, caplog):
    """Missing until 12-03: NxD's Llama training scripts import these."""
    import logging

    from kiln.neuronx_distributed.parallel_layers.grads import bucket_allreduce_gradients
    from kiln.neuronx_distributed.parallel_layers.utils import is_pjrt_device, requires_init_pg_override
    from kiln.neuronx_distributed.utils.adamw_fp32_optim_params import AdamW_FP32OptimParams
    from kiln.neuronx_distributed.utils.logger import get_logger
    assert callable(bucket_allreduce_gradients)
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    assert is_pjrt_device() and not requires_init_pg_override()     # torch 2.13: the plain init branch
    with caplog.at_level(logging.INFO, logger="neuronx_distributed"):
        get_logger().info("step 3")                     # no process group: this process is rank 0
    assert "step 3" in caplog.text
    # AdamW_FP32OptimParams: transformers' AdamW in float32 (torch's AdamW when the eps terms
    # agree: weight decay 0, eps negligible), its moments float32 for a bf16 model too
    torch.manual_seed(0)
    w = torch.randn(6, 4)
    ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt, torch_opt = AdamW_FP32OptimParams([ours], lr=0.1, eps=1e-12), torch.optim.AdamW([ref], lr=0.1, eps=1e-12,
                                                                                           weight_decay=0.0)
    for step in range(3):
        g = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    half = torch.nn.Parameter(w.to(torch.bfloat16))
    half.grad = torch.full_like(half, 1e-3)
    bf16_opt = AdamW_FP32OptimParams([half], lr=1e-2, weight_decay=0.01)
    bf16_opt.step()
    state = bf16_opt.state[half]
    assert half.dtype == torch.bfloat16 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    want = w.to(torch.bfloat16).float()
    step_size = 1e-2 * (1 - 0.999) ** 0.5 / (1 - 0.9)
    want = want - step_size * (0.1 * 1e-3) / ((0.001 * 1e-6) ** 0.5 + 1e-6)
    want = want - 1e-2 * 0.01 * want
    torch.testing.assert_close(half.detach(), want.to(torch.bfloat16), rtol=0, atol=0)


def test_cpu_mode_reads_nxd_cpu_mode(monkeypatch):
    from kiln.neuronx_distributed import utils
    monkeypatch.setenv("NXD_CPU_MODE", "1")
    assert utils.cpu_mode() and utils.get_device() == torch.device("cpu")
    utils.mark_step()                                   # a no-op in CPU mode
    monkeypatch.setenv("NXD_CPU_MODE", "0")
    assert not utils.cpu_mode()


def test_activation_checkpointing_in_nxds_spelling_recomputes_and_keeps_names():
    """neuronx_distributed.utils.activation_checkpoint: the accepted submodules' forwards run
    again during backward (a hook sees each twice), gradients equal the plain module's,
    and parameter names do not change (NxD's checkpoints key on them)."""
    from torch import nn

    from kiln.neuronx_distributed.utils.activation_checkpoint import (apply_activation_checkpointing,
                                                                      checkpoint_wrapper)

    def make():
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
                             nn.Linear(16, 1))
    torch.manual_seed(0)
    plain, model = make(), make()
    model.load_state_dict(plain.state_dict())
    calls = []
    model[2][1].register_forward_pre_hook(lambda *_: calls.append(1))     # inside a wrapped module
    assert apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Sequential)) is model
    x = torch.randn(4, 8)
    plain(x).sum().backward()
    model(x).sum().backward()
    assert len(calls) == 2                                   # the forward, and its recomputation
    assert list(dict(model.named_parameters())) == list(dict(plain.named_parameters()))
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    linear = nn.Linear(3, 3)
    assert checkpoint_wrapper(linear) is linear and linear._kiln_checkpointed


def test_activation_checkpointing_redraws_the_forwards_dropout_on_the_tracker_stream():
    """Dropout under get_xla_rng_tracker().fork() (and on the default stream) inside a
    checkpointed module: the recomputation draws the forward's masks, so the gradients
    equal the uncheckpointed module's, and the stream ends where one forward leaves it.
    Before, checkpoint restored torch's generator only: the fork's stream had moved on, the
    recomputed mask differed and the gradients were wrong (max-rel 0.5-0.9) at an equal loss."""
    from torch import nn

    from kiln.distributed.rng import MODEL_PARALLEL_RNG_TRACKER_NAME, get_xla_rng_tracker
    from kiln.neuronx_distributed.utils.activation_checkpoint import apply_activation_checkpointing

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

        def forward(self, x):
            h = torch.nn.functional.gelu(self.up(x))
            with get_xla_rng_tracker().fork():
                h = torch.nn.functional.dropout(h, 0.5, training=True)
            return x + torch.nn.functional.dropout(self.down(h), 0.3, training=True)

    def run(checkpointed):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        if checkpointed:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        tracker = get_xla_rng_tracker()
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)
        torch.manual_seed(7)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        stream = tracker.get_states()[MODEL_PARALLEL_RNG_TRACKER_NAME]
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, stream, torch.get_rng_state()

    try:
        plain, ckpt = run(False), run(True)
    finally:
        get_xla_rng_tracker().reset()
    torch.testing.assert_close(ckpt[0], plain[0], rtol=0, atol=0)
    for name, grad in plain[1].items():
        torch.testing.assert_close(ckpt[1][name], grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert torch.equal(ckpt[2], plain[2]) and torch.equal(ckpt[3], plain[3])


def test_replicated_kv_rows_count_once_in_zero1_shards_of_the_norm(fresh_state):
    """A weight [q; k; v] whose K/V rows are copies on 2 TP ranks (GQA, kv_size_multiplier
    2): ZeRO-1's shard norm weighs each row by 1/copies at the row's place in the padded
    parameter, whichever DP rank's chunk holds it (the TP=2 check covers whole parameters)."""
    import warnings

    from kiln.distributed import grads, zero1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh_state.ensure_initialized()
    param = nn.Parameter(torch.zeros(5, 3))            # 1 q row, 2 k rows, 2 v rows; dim 0 padded to 6
    param.tensor_model_parallel, param.row_replicas = True, ((1, 1), (2, 2), (2, 2))
    param.grad = torch.arange(15.0).reshape(5, 3)
    want = (param.grad[0].pow(2).sum() + param.grad[1:].pow(2).sum() / 2).sqrt()
    torch.testing.assert_close(grads.get_grad_norm([param]).reshape(()), want, rtol=1e-6, atol=0)
    padded = torch.cat([param.grad, torch.zeros(1, 3)])
    total = 0.0
    for dp_rank, chunk in enumerate(padded.chunk(2)):
        view = type("Shard", (), {"grad": chunk})()
        total += zero1.sharded_grad_norm([(param, view)], 2.0, None, 1, dp_rank) ** 2
    torch.testing.assert_close(total.sqrt(), want, rtol=1e-6, atol=0)
    assert grads.row_scale(param, 3, 3).tolist() == [0.5, 0.5, 1.0]


def test_nxd_names_kiln_does_not_provide_say_what_to_use_instead():
    import kiln.neuronx_distributed as nxd
    with pytest.raises(AttributeError, match="ModelBuilder v2 inference flow.*parallel_model_trace"):
        nxd.ModelBuilder
    assert not hasattr(nxd, "shard_checkpoint")


def test_initializing_after_a_layer_set_up_the_fallback_says_so(fresh_state, tmp_path):
    """Found by probing: a parallel layer built before initialize_model_parallel sets up NxD's
    one-rank state (with a warning); the script's own initialize_model_parallel then said only
    'tensor model parallel group is already initialized', which the user never did."""
    import torch.distributed as dist
    from kiln.neuronx_distributed.parallel_layers import ColumnParallelLinear
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning, match="parallel state is not initialized"):
            ColumnParallelLinear(8, 8)
        with pytest.raises(fresh_state.ParallelStateError,
                           match="when a parallel layer was built before initialize_model_parallel"):
            fresh_state.initialize_model_parallel(1)
    finally:
        fresh_state.destroy_model_parallel()
        dist.destroy_process_group()
