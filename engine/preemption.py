"""SIGTERM → save and stop: noticing the signal, and agreeing on the step across processes."""
from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):
    """SIGTERM (or Ctrl-C's SIGINT) arrived; a checkpoint at `step` was saved and completed.
    exit_code: 143 for SIGTERM, 130 for SIGINT, as a shell reports a process ended by them."""

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        name = signal.Signals(signum).name
        super().__init__(f"{'preempted' if signum == signal.SIGTERM else 'stopped'} by {name}: saved a checkpoint "
                         f"at step {step}; re-run the same command to resume")
        self.step, self.exit_code = step, 128 + int(signum)


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point.

    With several processes, jax.distributed's own SIGTERM notifier feeds that sync point, so
    no Python handler is installed over it."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGTERM  # what asked to stop
        self.multi_process = jax.process_count() > 1
        self._previous = {}
        if not self.multi_process and threading.current_thread() is threading.main_thread():
            # Ctrl-C too: save, then exit 130, instead of a KeyboardInterrupt traceback mid-step
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum, frame):
        self.requested, self.signum = True, signum
        if signum == signal.SIGINT:  # a second Ctrl-C aborts at once (a hung step, a stuck wait)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def should_stop(self, first: int, last: int) -> bool:
        """After steps first..last (one call): stop now? JAX's sync point is one exact step,
        so every step of the call is reported to it (several with train.steps_per_call)."""
        if self.multi_process:
            return any([multihost_utils.reached_preemption_sync_point(step) for step in range(first, last + 1)])
        return self.requested

    def close(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
