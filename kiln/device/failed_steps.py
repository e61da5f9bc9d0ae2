"""A step whose program failed: its tensors as they were before it, never a stale value.

A flush that raises (an index out of range in the step, a program that fails) used to
leave every tensor the step computed pointing at a value of the discarded trace: the next
step failed with "IndexError: list index out of range" (or read another value of the same
index), so a training loop that caught the error and went on to the next batch could not.
Now, as the flush fails:

* a tensor the step updated in place (a parameter, an optimizer's state, a buffer) gets
  back the data it held before the step: nothing is lost, and the step is as if not taken
  (eager would have raised part way, at the failing operation; here the whole step is
  undone, so a parameter is never half-updated). The old data is held weakly: data the
  step only overwrote (``copy_``), which the trace does not read, is not kept alive for
  this, and such a tensor raises like the ones below;
* a tensor the step made (the loss, the gradients, activations) holds :class:`Failed`,
  which raises the step's error, with what to do, wherever its value is asked for.
"""
from __future__ import annotations


class Failed:
    """The data of a tensor whose step's program failed: any use raises."""
    __slots__ = ("error", "__weakref__")

    def __init__(self, error: BaseException):
        self.error = error

    def __getattr__(self, name):
        raise RuntimeError(f"kiln device: {self!r}")

    def __repr__(self):         # what PyTorch prints where it is handed one in a tensor's place
        return (f"this tensor's value was to come from a step whose program failed "
                f"({type(self.error).__name__}: {self.error}); compute it again (the tensors that step "
                "updated in place hold their values from before it)")


def flush(run, trace, *args, **kwargs):
    """``run(trace, ...)`` (:func:`kiln.device.programs.flush`), undoing ``trace``'s
    effects on its tensors where it raises (module doc)."""
    try:
        return run(trace, *args, **kwargs)
    except BaseException as error:
        failed = Failed(error)
        for _, cell in trace.live_outputs():
            before = trace.before.get(id(cell))
            data = before[1]() if before is not None and before[0] is cell else None
            cell.data, cell.value = (data if data is not None else failed), None
        raise
