"""NxD's model-parallel RNG tracker: named random streams that ``fork()`` switches to.

Dropout inside a tensor-parallel region must differ between TP ranks (each holds other
columns) yet be reproducible, while dropout outside it must be identical on all TP ranks.
NxD keeps the default stream for the latter and a ``"model-parallel-rng"`` stream seeded
``seed + 2718 + tp_rank`` for the former. On XLA a stream is a seed; here it is the
state of torch's CPU generator, which is also what kiln's device draws from (its random
ops run on the host generator in program order), so the same code forks both.
"""
from __future__ import annotations

import contextlib

import torch

from kiln.distributed import state
from kiln.errors import KilnError

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
MODEL_PARALLEL_RNG_TRACKER_NAME = _MODEL_PARALLEL_RNG_TRACKER_NAME
TP_SEED_OFFSET = 2718


class RNGTrackerError(KilnError):
    """A stream was added twice, with a seed already used, or forked before it was added."""


class XLARNGStatesTracker:
    """Named generator states; ``fork(name)`` runs its block on that stream and saves the
    stream's advanced state on exit, restoring the default stream."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict:
        return {name: s.clone() for name, s in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RNGTrackerError(f"seed {seed} already exists in the RNG tracker; give each stream its own seed")
        if name in self.states_:
            raise RNGTrackerError(f"RNG state {name!r} already exists; call reset() first to re-seed it")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RNGTrackerError(f"RNG state {name!r} is not added: call model_parallel_xla_manual_seed(seed) "
                                  "(or get_xla_rng_tracker().add(name, seed)) first")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


_TRACKER = XLARNGStatesTracker()


def get_xla_rng_tracker() -> XLARNGStatesTracker:
    return _TRACKER


def checkpoint_context_fn():
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint``: the recomputation in
    backward runs with the tracker's streams as the forward found them, so dropout drawn
    under ``fork()`` draws the forward's mask again (checkpoint itself restores only
    torch's global generator, and ``fork`` keeps each stream's state here, advancing it
    on exit). Afterwards the streams are put back as they were before the recomputation:
    it does not advance them a second time. Megatron's ``CheckpointFunction`` does the
    same with its CUDA RNG tracker."""
    tracker = _TRACKER
    forward_states = tracker.get_states()

    @contextlib.contextmanager
    def recompute():
        current = tracker.get_states()
        tracker.set_states({name: s.clone() for name, s in forward_states.items()})
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), recompute()


def model_parallel_xla_manual_seed(seed: int) -> None:
    """Seed the default stream with ``seed`` (identical on every rank: data-parallel and
    replicated work) and the model-parallel stream with ``seed + 2718 + tp_rank``."""
    tp_seed = seed + TP_SEED_OFFSET + state.get_tensor_model_parallel_rank()
    _TRACKER.reset()
    torch.manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)
