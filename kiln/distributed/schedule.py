"""Pipeline schedules: the order in which one pipeline rank runs its microbatches.

A schedule is an iterable of *steps*; a step is a list of tasks. Every task names a
microbatch and says what to do with it on this rank: receive a stage's inputs
(``ForwardPreprocessTask``), run the stage forward (``ForwardStepTask``), send its
outputs on (``ForwardPostprocessTask``), receive the gradients of those outputs
(``BackwardPreprocessTask``), run the stage backward (``BackwardStepTask``), send the
gradients of its inputs back (``BackwardPostprocessTask``); and, once a batch is done,
reduce the gradients (``ReduceGradsTask``). The task names and the 1F1B order are NxD's
(``neuronx_distributed.pipeline.scheduler``), so a schedule printed by kiln reads like
one printed by NxD.

1F1B keeps at most ``stages - stage`` microbatches' activations alive on a rank: a
warm-up of forwards, then one forward and one backward alternately, then the remaining
backwards. In the steady state a rank receives the gradient it needs next *before* it
sends the forward output it just made, so two neighbours never both wait to send.
"""
from __future__ import annotations

from kiln.errors import KilnError


class ScheduleError(KilnError, ValueError):
    """A schedule that cannot be built with these settings."""


class PipelineTask:
    """One thing to do for microbatch ``mb`` of model chunk ``model_chunk``."""

    def __init__(self, mb: int, model_chunk: int = 0, graph_break: bool = True):
        self.mb = mb
        self.model_chunk = model_chunk
        self.graph_break = graph_break

    def __eq__(self, other) -> bool:
        return (type(self) is type(other) and self.mb == other.mb
                and self.model_chunk == other.model_chunk and self.graph_break == other.graph_break)

    def __hash__(self):
        return hash((type(self).__name__, self.mb, self.model_chunk))

    def __repr__(self):
        return f"{type(self).__name__}_microbatch_{self.mb}_modelchunk_{self.model_chunk}"


class ForwardPreprocessTask(PipelineTask):
    """Take the microbatch's model inputs and receive the stage inputs from the previous rank."""


class ForwardStepTask(PipelineTask):
    """Run the stage forward (the last stage also keeps the microbatch's loss)."""


class ForwardPostprocessTask(PipelineTask):
    """Send the stage outputs to the next rank."""


class BackwardPreprocessTask(PipelineTask):
    """Receive the gradients of the stage outputs from the next rank."""


class BackwardStepTask(PipelineTask):
    """Run the stage backward (the last stage starts from loss / num_microbatches)."""


class BackwardPostprocessTask(PipelineTask):
    """Send the gradients of the stage inputs to the previous rank."""


class ReduceGradsTask(PipelineTask):
    """After the last microbatch: average gradients over data parallel ranks (unless an
    optimizer wrapper or ZeRO-1 does it) and sum the gradients of weights shared between
    pipeline ranks."""

    def __init__(self, graph_break: bool = True):
        super().__init__(-1, -1, graph_break)

    def __repr__(self):
        return "ReduceGradsTask"


class PipeSchedule:
    """The schedule of pipeline rank ``stage_id`` of ``stages`` for ``num_microbatches``."""

    def __init__(self, num_microbatches: int, stages: int, stage_id: int):
        if num_microbatches < 1:
            raise ScheduleError(f"num_microbatches must be at least 1, not {num_microbatches}")
        if not 0 <= stage_id < stages:
            raise ScheduleError(f"pipeline rank {stage_id} is outside 0..{stages - 1}")
        self.num_microbatches = num_microbatches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def steps(self):
        raise NotImplementedError

    def __iter__(self):
        return iter(self.steps())


class InferenceSchedule(PipeSchedule):
    """Forward only: each microbatch is received, run and sent on, in order."""

    def steps(self):
        for mb in range(self.num_microbatches):
            yield [ForwardPreprocessTask(mb), ForwardStepTask(mb), ForwardPostprocessTask(mb)]


class Train1F1BSchedule(PipeSchedule):
    """Non-interleaved 1F1B (PP4, 6 microbatches)::

        PP0   F0  F1  F2              F3  B0  F4  B1  F5  B2      B3     B4    B5
        PP1       F0  F1          F2  B0  F3  B1  F4  B2  F5  B3      B4    B5
        PP2           F0      F1  B0  F2  B1  F3  B2  F4  B3  F5  B4     B5
        PP3               F0  B0  F1  B1  F2  B2  F3  B3  F4  B4  F5  B5
    """

    def __init__(self, num_microbatches: int, stages: int, stage_id: int):
        super().__init__(num_microbatches, stages, stage_id)
        self.num_warmup_steps = min(stages - stage_id - 1, num_microbatches)
        self.num_steady_state_microbatches = num_microbatches - self.num_warmup_steps
        self.num_remaining_microbatches = self.num_warmup_steps

    def step_to_microbatch(self, step: int) -> tuple[int, bool]:
        """(microbatch, is_forward) of step ``step`` (0 .. 2 * num_microbatches - 1)."""
        warm, steady = self.num_warmup_steps, self.num_steady_state_microbatches
        if step < warm:
            return step, True
        if step < warm + 2 * steady:
            k = step - warm
            return (k // 2 + warm, True) if k % 2 == 0 else (k // 2, False)
        return steady + (step - warm - 2 * steady), False

    def steps(self):
        has_next, has_prev = not self.is_last_stage, not self.is_first_stage
        previous_mb = -1
        for step in range(2 * self.num_microbatches):
            mb, forward = self.step_to_microbatch(step)
            tasks: list = []
            if forward:
                tasks.append(ForwardPreprocessTask(mb))
                tasks.append(ForwardStepTask(mb))
                if mb < self.num_warmup_steps and has_next:
                    tasks.append(ForwardPostprocessTask(mb))       # warm-up sends at once
            else:
                if has_next:
                    tasks.append(BackwardPreprocessTask(mb))       # receive before sending
                    if mb < self.num_steady_state_microbatches:
                        tasks.append(ForwardPostprocessTask(previous_mb))
                tasks.append(BackwardStepTask(mb))
                if has_prev:
                    tasks.append(BackwardPostprocessTask(mb))
            previous_mb = mb
            yield tasks
        yield [ReduceGradsTask()]


class TrainInterleavedSchedule(PipeSchedule):
    """NxD's interleaved schedule (virtual_pipeline_size > 1). kiln does not run it."""

    def __init__(self, num_microbatches, num_model_chunks, stages, stage_id, **kwargs):
        raise ScheduleError(
            f"virtual_pipeline_size={num_model_chunks}: kiln runs the non-interleaved 1F1B schedule "
            "only; use virtual_pipeline_size=1 (one stage per pipeline rank)")
