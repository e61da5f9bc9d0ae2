"""NxD's parallel layers at TP=2 against their unsharded PyTorch equivalents, for
tests/test_nxd_layers.py. Run under ``torchrun --nproc_per_node=2``: every rank runs every
check (the collectives need both) and prints ``CHECK <name> ok`` or ``CHECK <name> FAIL
<detail>``; the test asserts on rank 0's lines. One launch covers all TP=2 checks
(process start-up is most of the cost)."""
import json
import math
import sys
from datetime import timedelta
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kiln.xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend
from kiln.neuronx_distributed.parallel_layers import (
    ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, clip_grad_norm, parallel_cross_entropy,
    parallel_state as ps,
)
from kiln.distributed.shard import create_local_weight
from kiln.neuronx_distributed.modules.qkv_linear import GQAQKVColumnParallelLinear
from kiln.neuronx_distributed.parallel_layers.random import get_xla_rng_tracker, model_parallel_xla_manual_seed

ATOL = 1e-5
CHECKS = []
FAILURES = []   # a check records mismatches and raises only at its end, after all its collectives,
                # so one rank's failure cannot leave the other waiting in a collective


def expect(ok, what):
    if not ok:
        FAILURES.append(what)


def check(fn):
    CHECKS.append(fn)
    return fn


def close(a, b, what, atol=ATOL):
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or not torch.allclose(a, b, atol=atol, rtol=1e-5):
        err = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        FAILURES.append(f"{what}: differs by {err}")


def gather(t, dim):
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=dim)


def data(*shape, seed=7):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


R = None  # this rank's TP rank


def _column_case(gather_output, stride=1):
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 12, gather_output=gather_output, stride=stride)
    torch.manual_seed(0)
    ref = nn.Linear(16, 12)          # NxD's init order at TP=1 is nn.Linear's: kaiming weight, then bias
    rows = torch.cat([torch.arange(12)[c * 3:(c + 1) * 3] for c in range(R, 4, 2)]) if stride == 2 \
        else torch.arange(R * 6, (R + 1) * 6)
    close(layer.weight, ref.weight[rows], "weight shard = same-seed unsharded weight rows")
    x, g = data(3, 5, 16).requires_grad_(), data(3, 5, 12, seed=8)
    xr = x.detach().clone().requires_grad_()
    out, want = layer(x), ref(xr)
    if not gather_output:
        # the full bias drawn as at TP=1 (after the full weight), this rank's rows kept
        close(layer.bias, ref.bias[rows], "bias shard = same-seed unsharded bias rows")
        want = ref(xr)[..., rows]
        g_here = g[..., rows]
    else:
        g_here = g
        close(layer.bias, ref.bias, "full bias")
    close(out, want, "output")
    (out * g_here).sum().backward()
    (ref(xr) * g).sum().backward()
    close(x.grad, xr.grad, "input grad (all-reduced)")
    close(layer.weight.grad, ref.weight.grad[rows], "weight-grad shard")
    close(layer.bias.grad, ref.bias.grad if gather_output else ref.bias.grad[rows], "bias grad")
    expect(layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0, "TP attributes")
    expect(layer.weight.partition_stride == stride and layer.weight.num_partitions == 2, "TP attributes")


@check
def column_gather_output():
    _column_case(True)


@check
def column_no_gather():
    _column_case(False)


@check
def column_stride2():
    _column_case(False, stride=2)


def _row_case(input_is_parallel):
    torch.manual_seed(1)
    layer = RowParallelLinear(12, 16, input_is_parallel=input_is_parallel)
    ref = nn.Linear(12, 16)
    cols = slice(R * 6, (R + 1) * 6)
    with torch.no_grad():
        ref.weight.copy_(gather(layer.weight, 1))
        ref.bias.copy_(layer.bias)
    torch.manual_seed(1)
    master = torch.empty(16, 12)
    nn.init.kaiming_uniform_(master, a=math.sqrt(5))
    close(layer.weight, master[:, cols], "weight shard = same-seed master columns")
    torch.manual_seed(1)
    close(layer.bias, nn.Linear(12, 16).bias, "row bias = same-seed unsharded bias (U(±1/sqrt(in)))")
    x, g = data(3, 5, 12).requires_grad_(), data(3, 5, 16, seed=9)
    xr = x.detach().clone().requires_grad_()
    xin = x[..., cols] if input_is_parallel else x
    out = layer(xin)
    close(out, ref(xr), "output")
    (out * g).sum().backward()
    (ref(xr) * g).sum().backward()
    want = xr.grad.clone()
    if input_is_parallel:
        want[..., [i for i in range(12) if not (cols.start <= i < cols.stop)]] = 0
    close(x.grad, want, "input grad")
    close(layer.weight.grad, ref.weight.grad[:, cols], "weight-grad shard")
    close(layer.bias.grad, ref.bias.grad, "bias grad")
    expect(layer.weight.partition_dim == 1 and layer.weight.tensor_model_parallel, "TP attributes")


@check
def row_input_not_parallel():
    _row_case(False)


@check
def row_input_is_parallel():
    _row_case(True)


@check
def skip_bias_add():
    torch.manual_seed(2)
    col = ColumnParallelLinear(8, 4, gather_output=True, skip_bias_add=True)
    row = RowParallelLinear(4, 8, skip_bias_add=True)
    x = data(2, 8)
    out, bias = col(x)
    close(out + bias, F.linear(x, gather(col.weight, 0), col.bias), "column output + bias")
    expect(bias is col.bias, "skip_bias_add returns the column bias")
    out, bias = row(out)
    expect(bias is row.bias, "skip_bias_add returns the row bias")
    close(out + bias, F.linear(F.linear(x, gather(col.weight, 0)), gather(row.weight, 1), row.bias),
          "row output + bias")


def _embedding_case(across):
    torch.manual_seed(3)
    layer = ParallelEmbedding(20, 8, shard_across_embedding=across)
    torch.manual_seed(3)
    ref = nn.Embedding(20, 8)
    dim = 1 if across else 0
    part = slice(R * 4, (R + 1) * 4) if across else slice(R * 10, (R + 1) * 10)
    close(layer.weight, ref.weight[:, part] if across else ref.weight[part], "weight shard = same-seed nn.Embedding")
    expect(layer.weight.partition_dim == dim, "TP attributes")
    ids = torch.tensor([[0, 5, 9, 10], [19, 3, 12, 10]])
    g = data(2, 4, 8, seed=10)
    out = layer(ids)
    close(out, ref(ids), "output")
    (out * g).sum().backward()
    (ref(ids) * g).sum().backward()
    close(layer.weight.grad, ref.weight.grad[:, part] if across else ref.weight.grad[part], "weight-grad shard")


@check
def embedding_vocab_parallel():
    _embedding_case(False)


@check
def embedding_shard_across_embedding():
    _embedding_case(True)


def _embedding_option_case(across, **options):
    """``max_norm`` and ``scale_grad_by_freq`` as one process's nn.Embedding has them: rows
    renormalised where looked up (on every rank's slice by the whole row's norm), gradients
    divided by each id's count. Until 12-03 the vocabulary shards counted the other shards'
    ids as uses of their row 0, and a slice was renormalised by its own part of the norm."""
    torch.manual_seed(3)
    layer = ParallelEmbedding(20, 8, shard_across_embedding=across, **options)
    torch.manual_seed(3)
    ref = nn.Embedding(20, 8, **options)
    with torch.no_grad():
        layer.weight.mul_(3)
        ref.weight.mul_(3)
    part = slice(R * 4, (R + 1) * 4) if across else slice(R * 10, (R + 1) * 10)
    ids = torch.tensor([[0, 5, 9, 10], [19, 3, 3, 10]])       # 3 and 10 twice; 1 and 11 never
    g = data(2, 4, 8, seed=10)
    out = layer(ids)
    want = ref(ids)
    close(out, want, "output")
    close(layer.weight, ref.weight[:, part] if across else ref.weight[part], "weights after the lookup")
    (out * g).sum().backward()
    (want * g).sum().backward()
    close(layer.weight.grad, ref.weight.grad[:, part] if across else ref.weight.grad[part], "weight-grad shard")


@check
def embedding_options_vocab_parallel():
    _embedding_option_case(False, max_norm=4.0, scale_grad_by_freq=True)


@check
def embedding_options_shard_across_embedding():
    _embedding_option_case(True, max_norm=4.0, scale_grad_by_freq=True)


@check
def sequence_parallel_mlp():
    """[S, B, H] activations sharded on S: Column all-gathers (grad reduce-scatter), Row
    reduce-scatters (grad all-gathers)."""
    torch.manual_seed(4)
    col = ColumnParallelLinear(8, 12, gather_output=False, sequence_parallel_enabled=True, sequence_dimension=0)
    row = RowParallelLinear(12, 8, input_is_parallel=True, sequence_parallel_enabled=True, sequence_dimension=0)
    ref_col, ref_row = nn.Linear(8, 12), nn.Linear(12, 8)
    with torch.no_grad():
        ref_col.weight.copy_(gather(col.weight, 0))
        ref_col.bias.copy_(gather(col.bias, 0))
        ref_row.weight.copy_(gather(row.weight, 1))
        ref_row.bias.copy_(row.bias)
    x, g = data(6, 2, 8), data(6, 2, 8, seed=11)
    seq = slice(R * 3, (R + 1) * 3)
    xl = x[seq].clone().requires_grad_()
    xr = x.clone().requires_grad_()
    out = row(F.gelu(col(xl)))
    want = ref_row(F.gelu(ref_col(xr)))
    close(out, want[seq], "output (this rank's sequence slice)")
    (out * g[seq]).sum().backward()
    (want * g).sum().backward()
    close(xl.grad, xr.grad[seq], "input grad slice")
    close(col.weight.grad, ref_col.weight.grad[R * 6:(R + 1) * 6], "column weight grad")
    # the row bias is replicated and sees only this rank's tokens: NxDOptimizer sums it over TP
    close(gather(row.bias.grad.unsqueeze(0), 0).sum(0), ref_row.bias.grad, "row bias grad summed over TP")
    expect(row.bias.sequence_parallel_enabled, "row bias tagged sequence_parallel_enabled")


def _ce_case(smoothing):
    logits = data(2, 3, 10, seed=12) * 3
    target = torch.tensor([[0, 4, 9], [5, 7, 2]])
    local = logits[..., R * 5:(R + 1) * 5].clone().requires_grad_()
    before = local.detach().clone()
    ref_logits = logits.clone().requires_grad_()
    loss = parallel_cross_entropy(local, target, label_smoothing=smoothing)
    vocab = 10
    want = F.cross_entropy(ref_logits.reshape(-1, 10), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing * vocab / (vocab - 1)).reshape(2, 3)
    close(loss, want, "per-token loss", atol=1e-5)
    g = data(2, 3, seed=13)
    (loss * g).sum().backward()
    (want * g).sum().backward()
    close(local.grad, ref_logits.grad[..., R * 5:(R + 1) * 5], "logit-grad shard")
    shifted = before - logits.max(-1, keepdim=True).values
    close(local.detach(), shifted, "logits modified in place (max subtracted), as NxD")


@check
def parallel_cross_entropy_plain():
    _ce_case(0.0)


@check
def parallel_cross_entropy_label_smoothing():
    _ce_case(0.1)


def _gqa_case(fuse):
    """2 query heads, 1 KV head (fewer KV heads than ranks), head_dim 4, kv_size_multiplier 2."""
    torch.manual_seed(5)
    layer = GQAQKVColumnParallelLinear(16, [8, 4], bias=True, gather_output=False, kv_size_multiplier=2,
                                       fuse_qkv=fuse)
    torch.manual_seed(5)
    w = {}
    for name, rows in (("q", 8), ("k", 4), ("v", 4)):
        w[name] = torch.empty(rows, 16)
        nn.init.kaiming_uniform_(w[name], a=math.sqrt(5))
    if fuse:
        wq, wk, wv = torch.split(layer.weight_qkv, [4, 4, 4])
        bq, bk, bv = torch.split(layer.bias_qkv, [4, 4, 4])
    else:
        wq, wk, wv, bq, bk, bv = (layer.weight_q, layer.weight_k, layer.weight_v,
                                  layer.bias_q, layer.bias_k, layer.bias_v)
    close(wq, w["q"][R * 4:(R + 1) * 4], "q shard = same-seed master rows")
    close(wk, w["k"], "k replicated on every rank")
    close(wv, w["v"], "v replicated on every rank")
    full_bq, full_bk, full_bv = gather(bq, 0), gather(bk, 0)[:4], gather(bv, 0)[:4]
    x = data(2, 3, 16).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    q, k, v = layer(x)
    refs = [t.detach().clone().requires_grad_() for t in (w["q"], w["k"], w["v"], full_bq, full_bk, full_bv)]
    rq, rk, rv = (F.linear(xr, wt, bt) for wt, bt in zip(refs[:3], refs[3:]))
    close(q, rq[..., R * 4:(R + 1) * 4], "q (this rank's head)")
    close(k, rk, "k")
    close(v, rv, "v")
    gs = [(data(2, 3, 4, seed=20 + r), data(2, 3, 4, seed=30 + r), data(2, 3, 4, seed=40 + r)) for r in range(2)]
    gq, gk, gv = gs[R]
    ((q * gq).sum() + (k * gk).sum() + (v * gv).sum()).backward()
    ref_loss = sum((rq[..., r * 4:(r + 1) * 4] * gs[r][0]).sum() + (rk * gs[r][1]).sum() + (rv * gs[r][2]).sum()
                   for r in range(2))
    ref_loss.backward()
    close(x.grad, xr.grad, "input grad")
    gx = xr.detach().reshape(-1, 16)
    want_q = sum(gs[r][0].reshape(-1, 4).t() @ gx for r in range(2) if r == R)
    want_k = sum(gs[r][1].reshape(-1, 4).t() @ gx for r in range(2))
    want_v = sum(gs[r][2].reshape(-1, 4).t() @ gx for r in range(2))
    got = torch.split(layer.weight_qkv.grad, [4, 4, 4]) if fuse else (
        layer.weight_q.grad, layer.weight_k.grad, layer.weight_v.grad)
    close(got[0], want_q, "q weight grad")
    close(got[1], want_k, "k weight grad (summed over the kv-shared group)")
    close(got[2], want_v, "v weight grad")
    # the gradient norm is the one-process model's: each replicated K/V row counts once
    from kiln.distributed import zero1
    want_norm = torch.stack([r.grad.norm() for r in refs]).norm()
    params = list(layer.parameters())
    close(clip_grad_norm(params, max_norm=1e9).reshape(()), want_norm, "clip_grad_norm's norm", atol=1e-5)
    close(zero1.clip_grad_norm(params, max_norm=1e9).reshape(()), want_norm, "the trainer's norm", atol=1e-5)


@check
def gqa_qkv_fused():
    _gqa_case(True)


@check
def gqa_qkv_unfused():
    _gqa_case(False)


@check
def same_seed_shards_concatenate_to_tp1():
    """Every parameter of a small model with biases, built at TP=2, is this rank's slice of
    the same model built with the same seed at TP=1 (its layers on a one-rank group)."""
    solo = [dist.new_group([r]) for r in range(2)][R]

    def build(group):
        torch.manual_seed(11)
        kw = {"tensor_model_parallel_group": group}
        return nn.ModuleDict({
            "embed": ParallelEmbedding(16, 8, **kw), "across": ParallelEmbedding(16, 8, shard_across_embedding=True, **kw),
            "up": ColumnParallelLinear(8, 12, gather_output=False, **kw),
            "gate_up": ColumnParallelLinear(8, 16, gather_output=False, stride=2, **kw),
            "gathered": ColumnParallelLinear(8, 6, gather_output=True, **kw),
            "down": RowParallelLinear(12, 8, input_is_parallel=True, **kw),
            "row_plain": RowParallelLinear(8, 4, **kw)})
    tp2, tp1 = dict(build(None).named_parameters()), dict(build(solo).named_parameters())
    expect(sorted(tp2) == sorted(tp1), "same parameters")
    for name, p in tp2.items():
        full = tp1[name]
        if getattr(p, "tensor_model_parallel", False):
            dim, stride = p.partition_dim, p.partition_stride
            want = create_local_weight(full, dim, full.shape[dim] // 2, stride, tp_rank=R, tp_size=2)
        else:
            want = full
        close(p, want, f"{name}: TP=2 shard vs the TP=1 parameter", atol=0)


def _tp_mlp(seed):
    torch.manual_seed(seed)
    return nn.ModuleDict({"up": ColumnParallelLinear(8, 12, gather_output=False),
                          "down": RowParallelLinear(12, 8, input_is_parallel=True), "norm": nn.LayerNorm(8)})


def _unsharded(m):
    ref = nn.ModuleDict({"up": nn.Linear(8, 12), "down": nn.Linear(12, 8), "norm": nn.LayerNorm(8)})
    with torch.no_grad():
        ref["up"].weight.copy_(gather(m["up"].weight, 0))
        ref["up"].bias.copy_(gather(m["up"].bias, 0))
        ref["down"].weight.copy_(gather(m["down"].weight, 1))
        ref["down"].bias.copy_(m["down"].bias)
        ref["norm"].load_state_dict(m["norm"].state_dict())
    return ref


def _run(m, x):
    return m["norm"](m["down"](torch.relu(m["up"](x)))).pow(2).sum()


@check
def clip_grad_norm_matches_torch():
    for norm_type in (2.0, math.inf):
        m = _tp_mlp(6)
        ref = _unsharded(m)
        x = data(4, 8) * 4
        _run(m, x).backward()
        _run(ref, x).backward()
        total = clip_grad_norm(list(m.parameters()), max_norm=0.5, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5, norm_type=norm_type)
        close(total.reshape(()), want, f"pre-clip total norm ({norm_type})", atol=1e-4)
        expect(want > 0.5, "the test must clip")
        close(m["up"].weight.grad, ref["up"].weight.grad[R * 6:(R + 1) * 6], "clipped column grad shard", atol=1e-5)
        close(m["down"].weight.grad, ref["down"].weight.grad[:, R * 6:(R + 1) * 6], "clipped row grad shard")
        close(m["norm"].weight.grad, ref["norm"].weight.grad, "clipped replicated grad")


@check
def rng_tracker():
    model_parallel_xla_manual_seed(1234)
    tracker = get_xla_rng_tracker()
    with tracker.fork():
        tp_draw = torch.rand(6)
    default_draw = torch.rand(6)
    both_tp, both_default = gather(tp_draw.unsqueeze(0), 0), gather(default_draw.unsqueeze(0), 0)
    expect(not torch.equal(both_tp[0], both_tp[1]), "model-parallel streams must differ per TP rank")
    expect(torch.equal(both_default[0], both_default[1]), "the default stream must agree across TP ranks")
    torch.manual_seed(1234 + 2718 + R)
    close(tp_draw, torch.rand(6), "TP stream seeded seed + 2718 + tp_rank", atol=0)
    torch.manual_seed(1234)
    close(default_draw, torch.rand(6), "default stream seeded seed (the fork left it untouched)", atol=0)
    model_parallel_xla_manual_seed(1234)
    with tracker.fork():
        again = torch.rand(6)
    close(again, tp_draw, "re-seeding reproduces the stream", atol=0)
    with tracker.fork():
        nxt = torch.rand(6)
    expect(not torch.equal(nxt, tp_draw), "a fork continues its stream")
    states = tracker.get_states()
    with tracker.fork():
        a = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork():
        b = torch.rand(3)
    close(a, b, "set_states restores the stream", atol=0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = ColumnParallelLinear(8, 16, gather_output=False)
        self.down = RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@check
def export_keeps_all_reduce():
    torch.manual_seed(7)
    mlp = MLP().eval()
    x = data(2, 8)
    ep = torch.export.export(mlp, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    expect(torch.ops.kiln.all_reduce.default in targets, f"no kiln all_reduce node in {targets}")
    close(ep.module()(x), mlp(x), "exported graph = eager")


@check
def kiln_device_eager_and_lazy():
    """The layers on kiln's device, eager then lazy mode: forward and backward equal CPU eager."""
    from kiln.device import modes
    from kiln.neuronx_distributed.utils.model_utils import move_model_to_device
    old = modes.mode()
    for mode in ("eager", "lazy"):
        torch.manual_seed(8)
        mlp = MLP()
        x, g = data(3, 8), data(3, 8, seed=14)
        xc = x.clone().requires_grad_()
        want_out = mlp(xc)
        (want_out * g).sum().backward()
        want = {n: p.grad.clone() for n, p in mlp.named_parameters()}
        mlp.zero_grad()
        dev = torch.device("kiln")
        modes.set_mode(mode, compile_after=1000)      # record and interpret: no compile in the test
        try:
            move_model_to_device(mlp, dev)
            expect(mlp.up.weight.device.type == "kiln" and mlp.up.weight.tensor_model_parallel,
                   f"{mode}: moved with TP attributes")
            xd = x.to(dev).requires_grad_()
            out = mlp(xd)
            (out * g.to(dev)).sum().backward()
            modes.mark_step()
            close(out.cpu(), want_out, f"{mode}: output on the device")
            close(xd.grad.cpu(), xc.grad, f"{mode}: input grad on the device")
            for n, p in mlp.named_parameters():
                close(p.grad.cpu(), want[n], f"{mode}: {n} grad on the device")
        finally:
            modes.set_mode(old)


@check
def legacy_load_failure_reaches_every_rank():
    """parallel_layers.load loads one TP rank at a time; when rank 0's load_state_dict raised, it
    left the loop and rank 1 waited in the turn's barrier until rank 0 exited, then failed with
    gloo's "Connection closed by peer". Every rank now raises at once, rank 1 naming rank 0's error."""
    import os
    import tempfile
    from kiln.distributed.ckpt_files import CheckpointError
    from kiln.neuronx_distributed.parallel_layers import load

    class Net(nn.Module):
        def __init__(self, f):
            super().__init__()
            self.up = ColumnParallelLinear(8, f, gather_output=False)
            self.down = RowParallelLinear(f, 8, input_is_parallel=True)

    path = [os.path.join(tempfile.gettempdir(), f"kiln-nxd-full-{os.getpid()}.pt")]
    dist.broadcast_object_list(path, src=0)
    if R == 0:
        full = {"up.weight": data(16, 8), "up.bias": data(16), "down.weight": data(8, 16), "down.bias": data(8)}
        torch.save({"model": full}, path[0])
    dist.barrier()
    try:
        load(path[0], Net(12), sharded=False)
        expect(False, "a checkpoint of other sizes loaded")
    except CheckpointError as e:
        expect(R == 1 and "rank 0 could not load its checkpoint" in str(e) and "size mismatch" in str(e),
               f"rank {R}: {e}")
    except RuntimeError as e:
        expect(R == 0 and "size mismatch" in str(e), f"rank {R}: {e}")
    dist.barrier()
    if R == 0:
        os.remove(path[0])


def main():
    global R
    only = sys.argv[1:]
    dist.init_process_group("xla", timeout=timedelta(seconds=90))
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    R = ps.get_tensor_model_parallel_rank()
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        FAILURES.clear()
        try:
            fn()
            if FAILURES:
                raise AssertionError("; ".join(FAILURES))
            verdict = "ok"
        except Exception as e:  # report and go on: every rank still runs every collective in order
            verdict = f"FAIL {type(e).__name__}: {e}"
            traceback.print_exc()
        verdicts = [None, None]
        dist.all_gather_object(verdicts, verdict)      # rank 0 prints both ranks' verdicts
        if R == 0:
            print(f"CHECK {fn.__name__} " + json.dumps(verdicts), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
