"""Pipeline-parallel training, NxD style, over 2 processes (torchrun), for
tests/test_nxd_pipeline.py.

A tiny decoder-like LM (embedding, identical residual blocks, norm, a head tied to the
embedding) is wrapped in NxDPPModel with ``transformer_layer_cls`` and 4 microbatches,
PP=2, and trained a few AdamW steps with the optimizer built from ``local_parameters()``.
The last pipeline rank writes the losses; each rank saves its local parameters. The same
launch also checks the documented cuts of ``auto_partition``, that wrong ``run_train``
keyword arguments are a clear error, ``run_eval`` and ``broadcast_and_average_loss``, and
the same training through ``initialize_parallel_model`` (these on the CPU run only).

Usage: nxd_pp_train.py {gloo|xla} OUT_DIR (gloo: set NXD_CPU_MODE=1, NxD's CPU path)
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, LAYERS, BATCH, SEQ, STEPS, LR = 32, 16, 4, 8, 6, 3, 1e-2


class Block(nn.Module):
    """A decoder layer stand-in: pre-norm residual MLP."""

    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(HIDDEN) for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight            # tied: stage 0 and stage 1 share it

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def build(layers=LAYERS):
    torch.manual_seed(0)
    return TinyLM(layers)


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        yield ids, torch.roll(ids, -1, dims=1)


def reference():
    """The same model trained in one process on the full batches: losses, final state."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids, labels in batches():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        ids, labels = next(batches())
        eval_loss = float(model(input_ids=ids, labels=labels))
    return losses, eval_loss, model.state_dict()


_OUT = []


def say(rank, text):
    """One result line, into this rank's own file (two ranks printing to one pipe can
    interleave within a line)."""
    with open(os.path.join(_OUT[0], f"rank{rank}.txt"), "a") as f:
        f.write(text + "\n")


def _owners(model):
    """The top-level modules (``layers.N`` for layers) whose parameters this rank holds."""
    names = set()
    for name, _ in model.local_named_parameters():
        parts = name.split(".")
        names.add(".".join(parts[:2]) if parts[0] == "layers" else parts[0])
    return ",".join(sorted(names))


def _checks(NxDPPModel, PipelineInputError, rank):
    """auto_partition's documented split; a wrong run_train call; an unsupported option."""
    auto = NxDPPModel(build(3), transformer_layer_cls=Block, num_microbatches=4, auto_partition=True,
                      input_names=["input_ids", "labels"])
    say(rank, f"auto_cuts {','.join(auto.pipeline_cuts)} local {_owners(auto)}")
    explicit = NxDPPModel(build(3), transformer_layer_cls=Block, num_microbatches=4,
                          pipeline_cuts=["layers.1"], input_names=["input_ids", "labels"])
    say(rank, f"cuts_local {_owners(explicit)}")
    torch.manual_seed(5)
    other = TinyLM(3).state_dict()
    explicit.load_state_dict(other)           # the whole model's state dict: each rank takes its part
    mine = explicit.local_state_dict()
    same = all(torch.equal(v, other[k]) for k, v in mine.items())
    say(rank, f"load_state_dict {same} {len(mine)} {sorted(mine) == sorted(dict(explicit.local_named_parameters()))}")
    try:
        explicit.run_train(input_ids=torch.zeros(4, SEQ, dtype=torch.long))
    except PipelineInputError as e:
        say(rank, f"kwargs_error {e}")
    try:
        NxDPPModel(build(), transformer_layer_cls=Block, virtual_pipeline_size=2,
                   pipeline_cuts=["layers.1"], input_names=["input_ids", "labels"])
    except Exception as e:      # noqa: BLE001 - the message is what is checked
        say(rank, f"vpp_error {type(e).__name__}: {e}")


def _train(model, local_parameters, mark_step):
    opt = torch.optim.AdamW(list(local_parameters), lr=LR)
    losses = []
    for ids, labels in batches():
        opt.zero_grad()
        loss = model.run_train(input_ids=ids, labels=labels)
        opt.step()
        mark_step()
        losses.append(loss)
    ids, labels = next(batches())
    return losses, model.run_eval(input_ids=ids, labels=labels)


def _report(tag, rank, model, losses, eval_loss, out):
    if rank == 1:       # the last pipeline rank has the loss; the first gets None
        say(rank, f"{tag}_losses " + " ".join(f"{float(v):.8f}" for v in losses))
        say(rank, f"{tag}_eval {float(eval_loss):.8f}")
    else:
        say(rank, f"{tag}_nonlast {losses} {eval_loss}")
    params = {k: v.detach().cpu() for k, v in model.local_state_dict().items()}
    torch.save(params, os.path.join(out, f"{tag}_rank{rank}.pt"))


def _with_trainer(config, rank, out):
    """The same training through initialize_parallel_model / initialize_parallel_optimizer."""
    import kiln.neuronx_distributed as nxd
    nxd_config = nxd.neuronx_distributed_config(
        pipeline_parallel_size=2, pipeline_config=dict(config, use_optimizer_wrapper=True),
        optimizer_config={"zero_one_enabled": False, "grad_clipping": False})
    model = nxd.initialize_parallel_model(nxd_config, build)
    opt = nxd.initialize_parallel_optimizer(nxd_config, torch.optim.AdamW, model.parameters(), lr=LR)
    losses = []
    for ids, labels in batches():
        opt.zero_grad()
        losses.append(model.run_train(input_ids=ids, labels=labels))
        opt.step()
    ids, labels = next(batches())
    _report("trainer", rank, model.module, losses, model.run_eval(input_ids=ids, labels=labels), out)


def main():
    kind, out = sys.argv[1], sys.argv[2]
    _OUT.append(out)
    import torch.distributed as dist
    if kind == "xla":       # kiln's device, lazy mode (torch-neuronx's style)
        import kiln.xla.core.xla_model as xm
        import kiln.xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend
        from kiln.device import modes
        modes.set_mode("lazy")
        mark_step = xm.mark_step
    else:                   # plain CPU tensors over gloo (run with NXD_CPU_MODE=1)
        mark_step = (lambda: None)
    dist.init_process_group(kind)
    rank = dist.get_rank()
    from kiln.neuronx_distributed.parallel_layers import parallel_state
    from kiln.neuronx_distributed.pipeline import NxDPPModel
    from kiln.distributed.pipeline import PipelineInputError
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    config = dict(transformer_layer_cls=Block, num_microbatches=4, pipeline_cuts=["layers.1"],
                  input_names=["input_ids", "labels"])
    model = NxDPPModel(build(), **config)
    model.move_model_to_device()            # NxD: before building the optimizer
    losses, eval_loss = _train(model, model.local_parameters(), mark_step)
    _report("pp", rank, model, losses, eval_loss, out)
    if kind != "xla":       # the rest is device-independent: once, on the CPU
        _checks(NxDPPModel, PipelineInputError, rank)
        bcast = NxDPPModel(build(), broadcast_and_average_loss=True, **config)
        ids, labels = next(batches())
        say(rank, f"broadcast {float(bcast.run_eval(input_ids=ids, labels=labels)):.8f}")
        _with_trainer(config, rank, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
