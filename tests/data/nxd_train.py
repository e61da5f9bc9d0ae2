"""An NxD training script as its users write it, with the imports swapped to kiln
(``neuronx_distributed`` -> ``kiln.neuronx_distributed``, ``torch_xla`` -> ``kiln.xla``),
for tests/test_nxd_train.py and benchmarks/dist_parts/train.py.

A tiny Llama-like decoder built from NxD's parallel layers (ParallelEmbedding; fused QKV
and gate/up ColumnParallelLinear with gather_output=False and stride 3 / 2; o_proj and
down_proj RowParallelLinear with input_is_parallel=True; RMSNorm; RoPE; a
ColumnParallelLinear lm_head and parallel_cross_entropy, masked and averaged), trained with
neuronx_distributed_config + initialize_parallel_model + initialize_parallel_optimizer
(AdamW under ZeRO-1, gradient clipping at 1.0), checkpointed with save_checkpoint and
resumed with load_checkpoint.

Run under torchrun. NXD_CPU_MODE=1: CPU tensors over gloo (NxD's CPU mode); otherwise
kiln's device in lazy mode over the "xla" process group. Global rank 0 writes a JSON
report (losses, grad norms, resumed losses, an error if asked to load a checkpoint that
does not fit, the errors of loading ZeRO-1 optimizer state into a plain optimizer and the
other way round) and each DP-rank-0 rank writes its final local parameters.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kiln.xla.core.xla_model as xm
from kiln.neuronx_distributed.modules.rms_norm import RMSNorm
from kiln.neuronx_distributed.parallel_layers import (
    ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, parallel_state,
)
from kiln.neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy
from kiln.neuronx_distributed.trainer import (
    initialize_parallel_model, initialize_parallel_optimizer, load_checkpoint, neuronx_distributed_config,
    save_checkpoint,
)
from kiln.neuronx_distributed.utils import cpu_mode

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=8)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--ffn", type=int, default=64)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps, and resume")
p.add_argument("--ckpt", default=None)
p.add_argument("--load-check", default=None, help="try to load this checkpoint at the end, report the error")
p.add_argument("--kind-check", default=None,
               help="save ZeRO-1 and plain optimizer state here and load each into the other kind, report the errors")
p.add_argument("--out", required=True)
args = p.parse_args()


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_size()
        self.heads, self.head_dim = heads // tp, hidden // heads
        self.qkv_proj = ColumnParallelLinear(hidden, 3 * hidden, bias=False, gather_output=False, stride=3)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=False, input_is_parallel=True)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, self.head_dim).transpose(1, 2) for y in self.qkv_proj(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * ffn, bias=False, gather_output=False, stride=2)
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, input_is_parallel=True)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads, ffn):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
        self.self_attn, self.mlp = Attention(hidden, heads), MLP(hidden, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = ParallelEmbedding(a.vocab, a.hidden)
        self.layers = nn.ModuleList(DecoderLayer(a.hidden, a.heads, a.ffn) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.lm_head = ColumnParallelLinear(a.hidden, a.vocab, bias=False, gather_output=False)
        head_dim = a.hidden // a.heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(a.seq).float(), inv)
        self.register_buffer("cos", torch.cat([angles, angles], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([angles, angles], -1).sin(), persistent=False)

    def forward(self, input_ids, labels):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))                       # [B, S, V/tp]: this rank's vocabulary slice
        loss = parallel_cross_entropy(logits.float(), labels)     # per token, vocabulary reduced over TP
        mask = (labels != -100).float()
        return (loss * mask).sum() / mask.sum()


def build():
    torch.manual_seed(0)                                          # the same full model at every TP degree
    return TinyLlama(args)


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[:, -1] = -100                                      # one ignored position per row
        out.append((tokens[:, :-1], labels))
    return out


def make(cfg):
    model = initialize_parallel_model(cfg, build)
    opt = initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), lr=args.lr,
                                            weight_decay=0.01)
    return model, opt


def train(model, opt, data, steps, device, save_dir=None):
    dp, dp_rank = parallel_state.get_data_parallel_size(), parallel_state.get_data_parallel_rank()
    rows = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)    # TP peers: same rows
    losses, norms, times = [], [], []
    for step in steps:
        start = time.perf_counter()
        ids, labels = data[step]
        loss = model(input_ids=ids[rows].to(device), labels=labels[rows].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        xm.mark_step()
        losses.append(loss.detach())
        norms.append(opt.grad_norm.detach())
        times.append(time.perf_counter() - start)
        if save_dir is not None and step + 1 == args.save_at:
            save_checkpoint(save_dir, f"step_{step + 1}", model=model, optimizer=opt,
                                user_content={"step": step + 1})
    losses = torch.stack(losses).cpu()
    dist.all_reduce(losses, group=parallel_state.get_data_parallel_group())
    return (losses / dp).tolist(), [float(n) for n in torch.stack(norms).cpu()], times


def _load_error(directory, tag, model, opt):
    try:
        load_checkpoint(directory, tag=tag, model=model, optimizer=opt)
    except Exception as e:                                        # noqa: BLE001  the test checks which
        return f"{type(e).__name__}: {e}"
    return None


def kind_checks(model, opt, directory):
    """ZeRO-1 optimizer state loaded into a plain optimizer, and plain state into a ZeRO-1 one."""
    plain = torch.optim.AdamW(model.parameters(), lr=args.lr)
    save_checkpoint(directory, "zero1", model=model, optimizer=opt)
    save_checkpoint(directory, "plain", model=model, optimizer=plain)
    errors = {"zero1_into_plain": _load_error(directory, "zero1", model, plain),
              "plain_into_zero1": _load_error(directory, "plain", model, opt)}
    # one TP rank's model file damaged (a partial copy): every rank raises, none waits for the
    # others in a barrier (until 12-03 the ranks whose files were good waited there)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "zero1", "model", "dp_rank_00_tp_rank_01_pp_rank_00.pt"), "wb") as f:
            f.write(b"garbage")
    dist.barrier()
    errors["damaged"] = _load_error(directory, "zero1", model, opt)
    return errors


def memory_per_rank(model, opt):
    """Each rank's resident memory (now and peak) and what it holds of the model and optimizer."""
    import resource
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    mine = {"rank": dist.get_rank(), "rss_mb": rss_kb / 1024,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "param_bytes": sum(q.numel() * q.element_size() for q in model.parameters()),
            "optimizer_state_bytes": opt.optimizer.state_bytes()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def main():
    if cpu_mode():
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        import kiln.xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend
        dist.init_process_group("xla")
        device = xm.xla_device()
    cfg = neuronx_distributed_config(
        tensor_parallel_size=args.tp,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0})
    model, opt = make(cfg)
    data = batches()
    report = {"tp": parallel_state.get_tensor_model_parallel_size(), "dp": parallel_state.get_data_parallel_size()}
    report["losses"], report["grad_norms"], report["step_s"] = train(model, opt, data, range(args.steps), device,
                                                                   args.ckpt)
    report["optimizer_state_bytes"] = opt.optimizer.state_bytes()
    report["ranks"] = memory_per_rank(model, opt)
    if args.save_at is not None:                                  # resume from the checkpoint, in a fresh model
        model2, opt2 = make(cfg)
        user_content = load_checkpoint(args.ckpt, model=model2, optimizer=opt2)
        report["resumed_from"] = user_content["step"]
        report["resumed"], _, _ = train(model2, opt2, data, range(user_content["step"], args.steps), device)
    if args.load_check is not None:
        try:
            load_checkpoint(args.load_check, model=model, optimizer=opt)
            report["load_error"] = None
        except Exception as e:                                    # noqa: BLE001  the test checks which
            report["load_error"] = f"{type(e).__name__}: {e}"
    if args.kind_check is not None:
        report["kind_errors"] = kind_checks(model, opt, args.kind_check)
    if parallel_state.get_data_parallel_rank() == 0:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
                   os.path.join(os.path.dirname(args.out), f"params_tp{tp_rank}.pt"))
    if dist.get_rank() == 0:
        report["partition"] = {n: [getattr(q, "partition_dim", -1), getattr(q, "partition_stride", 1)]
                               for n, q in model.named_parameters() if getattr(q, "tensor_model_parallel", False)}
        with open(args.out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
