"""How kiln's device runs what it records: eager mode or lazy mode.

* **eager** (TorchNeuron's adaptive eager execution; the default): operations queue up
  and run when a value is observed (``item()``, ``print``, ``cpu()``), when
  :attr:`Policy.window` operations are queued, and at the end of every optimizer step.
  A window ending an optimizer step is a training step, which repeats: it is compiled
  the first time it is seen. Any other window is interpreted op by op on CPU kernels
  the first time and compiled the second (a one-off is not worth a compile); once
  compiled, it runs compiled from then on.
  ``torch.use_deterministic_algorithms(True)`` turns queuing off: op by op.
* **lazy** (torch-neuronx's XLA device): nothing runs until :func:`mark_step` or an
  observed value; a whole training step becomes one program, compiled the first time
  it is seen.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from kiln.device import dispatch, metrics, programs, registration

_hooks: list = []


def device(name: str | None = None) -> torch.device:
    """kiln's device, ``torch.device(name, 0)``, registered if it is not yet (once per
    process). ``import torch`` normally registered it already, under ``KILN_DEVICE_NAME``
    (:mod:`kiln.device.autoload`); ``name`` defaults to the registered name, else to
    that variable's. A different name from the registered one is an error."""
    if name is None:
        name = registration.registered_name() or registration.configured_name() or "kiln"
    registration.register(name)
    if not _hooks:
        _hooks.append(register_optimizer_step_post_hook(_after_optimizer_step))
    return torch.device(name, 0)


def _after_optimizer_step(optimizer, args, kwargs):
    if dispatch.POLICY.mode == "eager":
        dispatch.materialize("optimizer step")


def set_mode(mode: str, *, window: int | None = None, compile_after: int | None = None,
             replay: bool | None = None, background: bool | str | None = None,
             overlap: bool | None = None, **options):
    """Choose ``"eager"`` or ``"lazy"``; ``options`` are ``kiln.trace``'s for the graphs
    compiled (default ``optlevel=2``: each partition timed against running it op by op).
    ``replay=False`` records every operation afresh instead of replaying a matching step
    (:mod:`kiln.device.replay`): the same programs, recorded slower. ``background=False``
    makes the flush that compiles a program wait for it, instead of running the program
    op by op while kiln's compile process builds it (:mod:`kiln.device.compile_process`,
    :func:`wait_compiles`); ``"auto"``, the default, compiles in the background except in
    a process group of several ranks (:func:`kiln.device.programs.in_background`).
    ``overlap=True`` (lazy mode) runs a step's compiled program on a worker thread while
    the next step is recorded (:mod:`kiln.device.inflight`); off by default.

    Settings left out keep the values they had, but for ``compile_after``, which belongs
    to the mode: left out, it is the mode's own (lazy mode compiles a program the first
    time it is seen, eager mode's windows the second time)."""
    if mode not in ("eager", "lazy"):
        raise ValueError(f"kiln device mode must be 'eager' or 'lazy', not {mode!r}")
    dispatch.materialize()
    policy = dispatch.POLICY
    policy.mode = mode
    policy.compile_after = compile_after if compile_after is not None else (1 if mode == "lazy" else 2)
    if window is not None:
        policy.window = window
    if background is not None:
        policy.background = background if background == "auto" else bool(background)
    if overlap is not None:
        policy.overlap = bool(overlap)
    if replay is not None:
        policy.replay = bool(replay)
        if not policy.replay:
            dispatch.current().template = None
    if options:
        policy.options = dict(options)
    return policy


def mode() -> str:
    return dispatch.POLICY.mode


def policy():
    return dispatch.POLICY


def mark_step():
    """Run what was recorded since the last step (lazy mode's step boundary)."""
    metrics.count("MarkStep")
    dispatch.materialize(overlap=dispatch.POLICY.overlap and dispatch.POLICY.mode == "lazy")


def synchronize():
    dispatch.materialize()


def wait_compiles(timeout: float | None = None) -> bool:
    """Wait until the programs compiling in the background are ready (they take over at
    their next run); True when none is left compiling."""
    return programs.wait_compiles(timeout)


def forget_compiled():
    """Drop the compiled programs kept in this process (tests; memory)."""
    programs.forget_programs()
