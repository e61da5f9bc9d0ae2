"""``neuronx_distributed.pipeline.scheduler``: NxD's pipeline schedules and tasks
(:mod:`kiln.distributed.schedule`; the interleaved schedule is a clear error)."""
from kiln.distributed.schedule import (  # noqa: F401
    BackwardPostprocessTask, BackwardPreprocessTask, BackwardStepTask, ForwardPostprocessTask,
    ForwardPreprocessTask, ForwardStepTask, InferenceSchedule, PipelineTask, PipeSchedule, ReduceGradsTask,
    Train1F1BSchedule, TrainInterleavedSchedule,
)
