"""Running a pipeline rank's schedule: microbatches, the tasks, the loss.

:class:`PipelineRunner` is the part of :class:`kiln.distributed.pipeline.NxDPPModel` that
executes a schedule on this rank's stage: it splits the batch into microbatches (dim 0,
equal sizes, as NxD), receives and sends activations and gradients through a
:class:`~kiln.distributed.pipeline_comm.PeerLink`, runs the stage forward and backward
(the last stage backpropagates ``loss / num_microbatches``, so the accumulated gradients
are those of the mean loss over the batch), then reduces the gradients and returns the
mean microbatch loss on the last pipeline rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.distributed import schedule as sched
from kiln.distributed.pipeline_cut import PipelineError, PipelineInputError


def find_loss(output, spec):
    """The loss in a stage's output, by NxD's ``output_loss_value_spec`` (True marks the
    loss in a tuple or dict of the same shape). Without a spec the output must be the loss."""
    if spec is None:
        if isinstance(output, torch.Tensor):
            return output
        raise PipelineError(
            f"the model's forward returned a {type(output).__name__}, not a loss tensor: pass "
            "output_loss_value_spec to say which value is the loss (e.g. (True, False) for (loss, logits))")
    if spec is False:
        return None
    if spec is True:
        if not isinstance(output, torch.Tensor):
            raise PipelineError(f"output_loss_value_spec marks a {type(output).__name__} as the loss; it must be a tensor")
        return output
    if isinstance(spec, (tuple, list)) and isinstance(output, (tuple, list)) and len(spec) == len(output):
        pairs = zip(output, spec)
    elif isinstance(spec, dict) and hasattr(output, "keys") and set(spec) == set(output.keys()):
        pairs = ((output[k], v) for k, v in spec.items())
    else:
        raise PipelineError(f"output_loss_value_spec {spec!r} does not match the model's output "
                            f"({type(output).__name__})")
    for value, part in pairs:
        found = find_loss(value, part)
        if found is not None:
            return found
    raise PipelineError(f"output_loss_value_spec {spec!r} marks no value as the loss")


def split_microbatches(kwargs: dict, names: list, n: int, device) -> list[dict]:
    """``kwargs`` cut on dim 0 into ``n`` equal microbatches, moved to ``device``."""
    sizes = set()
    for name in names:
        value = kwargs[name]
        if not isinstance(value, torch.Tensor):
            raise PipelineInputError(f"pipeline input {name!r} must be a tensor, not {type(value).__name__}")
        sizes.add(value.shape[0] if value.dim() else None)
    if len(sizes) > 1 or None in sizes:
        raise PipelineInputError(f"pipeline inputs must share their batch size (dim 0); got {sorted(map(str, sizes))}")
    batch = sizes.pop() if sizes else n
    if batch % n:
        raise PipelineInputError(f"Input batch size {batch} must be divisible by num_microbatches {n}")
    size = batch // n
    return [{name: kwargs[name][k * size:(k + 1) * size].to(device) for name in names} for k in range(n)]


class PipelineRunner:
    """Executes schedules for one pipeline rank (mixed into NxDPPModel, which provides
    ``_stage``, ``_link``, ``num_microbatches``, the pipeline rank and size and the options)."""

    def _reset_run(self, training: bool):
        self.training_run = training
        self._header = None
        self._mb_inputs, self._mb_grad_inputs = {}, {}
        self._mb_outputs, self._mb_grad_outputs, self._mb_grads = {}, {}, {}
        self._losses = {}

    def _execute(self, kwargs: dict, training: bool):
        names = self._stage.model_inputs
        self._microbatches = split_microbatches(kwargs, names, self.num_microbatches, self._device)
        self._reset_run(training)
        schedule = self.train_scheduler if training else self.eval_scheduler
        handlers = {
            sched.ForwardPreprocessTask: self._fwd_preprocess, sched.ForwardStepTask: self._fwd_step,
            sched.ForwardPostprocessTask: self._fwd_postprocess,
            sched.BackwardPreprocessTask: self._bwd_preprocess, sched.BackwardStepTask: self._bwd_step,
            sched.BackwardPostprocessTask: self._bwd_postprocess, sched.ReduceGradsTask: self._reduce_grads,
        }
        try:
            for step in schedule.steps():
                for task in step:
                    handlers[type(task)](task.mb)
                    if task.graph_break and not self.fuse_microbatches and \
                            isinstance(task, (sched.ForwardStepTask, sched.BackwardStepTask)):
                        self._mark_step()
        finally:
            self._link.wait_sends()
        losses = [self._losses[mb] for mb in sorted(self._losses)]
        self._microbatches = None
        self._reset_run(training)
        return self._process_loss(losses)

    # -- the tasks -------------------------------------------------------------------------
    def _fwd_preprocess(self, mb):
        values, grad_inputs = [], []
        if self._stage.received:
            values, grad_inputs, self._header = self._link.recv_forward(self._header if mb else None)
        feed = self._microbatches[mb]
        self._mb_inputs[mb] = values + [feed[name] for name in self._stage.model_inputs]
        if self.training_run:
            self._mb_grad_inputs[mb] = grad_inputs

    def _fwd_step(self, mb):
        outputs = self._stage.module(*self._mb_inputs.pop(mb))
        if self._is_last_stage:
            self._losses[mb] = find_loss(outputs, self.output_loss_value_spec)
        else:
            self._mb_outputs[mb] = outputs

    def _fwd_postprocess(self, mb):
        if self._is_last_stage:
            return
        grad_outputs = self._link.send_forward(list(self._mb_outputs.pop(mb)), with_header=mb == 0)
        if self.training_run:
            self._mb_grad_outputs[mb] = grad_outputs

    def _bwd_preprocess(self, mb):
        if not self._is_last_stage:
            self._mb_grads[mb] = self._link.recv_backward(self._mb_grad_outputs[mb])

    def _bwd_step(self, mb):
        if self._is_last_stage:
            loss = self._losses[mb]
            if not loss.requires_grad:
                raise PipelineError("the pipeline's loss does not require grad: no parameter of the model "
                                    "reaches it (were all parameters frozen?)")
            (loss / self.num_microbatches).backward()
            return
        outputs, grads = self._mb_grad_outputs.pop(mb), self._mb_grads.pop(mb)
        if outputs:
            torch.autograd.backward(outputs, grad_tensors=grads)

    def _bwd_postprocess(self, mb):
        self._link.send_backward(self._mb_grad_inputs.pop(mb))

    def _reduce_grads(self, mb):
        """Average over data parallel ranks (NxD does this here unless ZeRO-1 or its optimizer
        wrapper will), then sum the gradients of weights shared with other pipeline ranks."""
        if not (self.use_zero1_optimizer or self.use_optimizer_wrapper) and self._dp_size > 1:
            for param in self.local_parameters():
                if param.requires_grad and param.grad is not None:
                    param.grad.div_(self._dp_size)
                    dist.all_reduce(param.grad, group=self._dp_group)
        for param, group in self.shared_parameters():
            if param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=group)

    # -- the loss ------------------------------------------------------------------------
    def _process_loss(self, losses):
        last = self._is_last_stage
        if last and self.return_mb_loss:
            return losses
        loss = None
        if last:
            stacked = torch.stack([item.detach() for item in losses])
            loss = stacked.sum(0) / len(losses)
        if self.broadcast_and_average_loss:
            # float32 on every rank, so the broadcast matches whatever dtype the loss has
            if not last:
                loss = torch.zeros((), dtype=torch.float32, device=self._device)
            else:
                loss = loss.float()
                if self._dp_size > 1:
                    loss = loss / self._dp_size
                    dist.all_reduce(loss, group=self._dp_group)
            dist.broadcast(loss, self._pp_ranks[-1], group=self._pp_group)
        if loss is None:
            return None
        return loss.detach().cpu() if self.return_loss_on_cpu else loss.detach()
