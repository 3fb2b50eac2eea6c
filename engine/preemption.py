"""SIGTERM → save and stop: noticing the signal, and agreeing on the step across processes."""
from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint at `step` was saved and completed (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"preempted by SIGTERM: saved a checkpoint at step {step}; re-run the same command "
                         f"to resume")
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point.

    With several processes, jax.distributed's own SIGTERM notifier feeds that sync point, so
    no Python handler is installed over it."""

    def __init__(self):
        self.requested = False
        self.multi_process = jax.process_count() > 1
        self._previous = None
        if not self.multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def should_stop(self, first: int, last: int) -> bool:
        """After steps first..last (one call): stop now? JAX's sync point is one exact step,
        so every step of the call is reported to it (several with train.steps_per_call)."""
        if self.multi_process:
            return any([multihost_utils.reached_preemption_sync_point(step) for step in range(first, last + 1)])
        return self.requested

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
