"""NxD's rank layout on 4 ranks (gloo), for tests/test_nxd_layers.py: TP=2 (DP=2), then
TP=2 x PP=2, then a world that does not divide. Rank 0 prints one ``LAYOUT`` JSON line per
configuration with every rank's getters (gathered), and ``ERROR`` lines.

The same launch trains at PP=2 x TP=2 through the NxD trainer (one run_train) a tiny LM
whose own forward calls sequence-parallel mappings and ``parallel_cross_entropy``; every
rank compares the loss and its gradient shards with the same model in one process (plain
torch layers holding the gathered initial weights) and rank 0 prints one ``PPTP`` line."""
import json
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln.neuronx_distributed.parallel_layers import parallel_state as ps

V, H, FF, B, S = 32, 16, 32, 4, 6


def snapshot():
    me = {"rank": dist.get_rank(), "tp": [ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_size()],
          "dp": [ps.get_data_parallel_rank(), ps.get_data_parallel_size()],
          "pp": [ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_size()],
          "tp_src": ps.get_tensor_model_parallel_src_rank(), "dp_src": ps.get_data_parallel_src_rank(),
          "next": ps.get_pipeline_model_parallel_next_rank(), "prev": ps.get_pipeline_model_parallel_prev_rank(),
          "tp_group_ranks": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
          "dp_group_ranks": dist.get_process_group_ranks(ps.get_data_parallel_group()),
          "pp_group_ranks": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
          "rmsg": ps.rmsg("x")}
    meshes = {"tp": ps.get_tensor_model_parallel_group(as_list=True), "dp": ps.get_data_parallel_group(as_list=True),
              "pp": ps.get_pipeline_model_parallel_group(as_list=True),
              "zero1": ps.get_zero1_sharding_groups()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, me)
    return {"meshes": meshes, "ranks": every}


def _lm_classes():
    from kiln.neuronx_distributed.parallel_layers import (ColumnParallelLinear, ParallelEmbedding, RowParallelLinear,
                                                          mappings, parallel_cross_entropy)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(H)
            self.up = ColumnParallelLinear(H, FF, gather_output=False)
            self.down = RowParallelLinear(FF, H, input_is_parallel=True)

        def forward(self, x):
            return x + self.down(torch.tanh(self.up(self.norm(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = ParallelEmbedding(V, H)
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.norm = nn.LayerNorm(H)
            self.lm_head = ColumnParallelLinear(H, V, bias=False, gather_output=False)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for layer in self.layers:
                x = layer(x)
            x = mappings.scatter_to_sequence_parallel_region(x, 1)     # traced: must stay whole
            x = mappings.gather_from_sequence_parallel_region(x, 1, to_model_parallel=False)
            return parallel_cross_entropy(self.lm_head(self.norm(x)) * 20.0, labels).mean()
    return Block, LM


class _RefBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class _RefLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(_RefBlock() for _ in range(2))
        self.norm, self.lm_head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy((self.lm_head(self.norm(x)) * 20.0).reshape(-1, V), labels.reshape(-1))


def _gathered(name, t, param, tp_group):
    """The full tensor of a TP shard (stride 1), gathered over the TP group."""
    if not getattr(param, "tensor_model_parallel", False):
        return t
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, param.partition_dim)


def pp_tp_training():
    """One run_train at PP=2 x TP=2 against one process: (loss error, worst grad error, how
    many gradients were all zero) on this rank."""
    import kiln.neuronx_distributed as nxd
    Block, LM = _lm_classes()
    cfg = nxd.neuronx_distributed_config(
        tensor_parallel_size=2, pipeline_parallel_size=2,
        pipeline_config={"transformer_layer_cls": Block, "num_microbatches": 2, "pipeline_cuts": ["layers.0"],
                         "input_names": ["input_ids", "labels"]},
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False})
    tp_group = ps.get_tensor_model_parallel_group()

    def build():
        torch.manual_seed(0)
        return LM()
    whole = build()         # every rank: the whole model's shards, to gather the initial weights
    full = {n: _gathered(n, p.detach(), p, tp_group) for n, p in whole.named_parameters()}
    model = nxd.initialize_parallel_model(cfg, build)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    got = model.run_train(input_ids=ids, labels=labels)
    ref = _RefLM()
    ref.load_state_dict(full)
    want = ref(ids, labels)
    want.backward()
    ref_grads = dict(ref.named_parameters())
    loss_err = None if got is None else abs(float(got) - float(want))
    worst, zero = 0.0, 0
    for name, p in model.named_parameters():
        grad = _gathered(name, p.grad, p, tp_group)
        expect = ref_grads[name].grad
        worst = max(worst, float((grad - expect).abs().max() / expect.abs().max()))
        zero += int(not grad.abs().any())
    return loss_err, worst, zero


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    out = {}
    for name, kw in (("tp2", dict(tensor_model_parallel_size=2)),
                     ("tp2pp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))):
        ps.initialize_model_parallel(**kw)
        out[name] = snapshot()
        try:
            ps.initialize_model_parallel(**kw)
        except AssertionError as e:
            out[name]["again"] = str(e)
        ps.destroy_model_parallel()
    for name, kw in (("tp3", dict(tensor_model_parallel_size=3)), ("tp0", dict(tensor_model_parallel_size=0)),
                     ("pp0", dict(pipeline_model_parallel_size=0))):
        try:
            ps.initialize_model_parallel(**kw)
            out[name] = "initialized"
        except (RuntimeError, ValueError, ZeroDivisionError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    if dist.get_rank() == 0:
        print("LAYOUT " + json.dumps(out), flush=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, pp_tp_training())
    if dist.get_rank() == 0:
        print("PPTP " + json.dumps(every), flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
