"""SIGTERM → save and stop: noticing the signal, and agreeing on the step across processes."""
from __future__ import annotations

import signal
import threading
from typing import Optional


class Preempted(Exception):
    """SIGTERM (or Ctrl-C's SIGINT) arrived; a checkpoint at `step` was saved and completed, or
    (`phase`: during start-up) nothing new was trained and `step` is the newest checkpoint.
    exit_code: 143 for SIGTERM, 130 for SIGINT, as a shell reports a process ended by them."""

    def __init__(self, step: Optional[int], signum: int = signal.SIGTERM, phase: str = ""):
        name = signal.Signals(signum).name
        how = f"{'preempted' if signum == signal.SIGTERM else 'stopped'} by {name}"
        if phase:
            newest = f"the newest checkpoint is at step {step}" if step else "no checkpoint was written yet"
            text = f"{how} while {phase}: nothing new to save ({newest}); re-run the same command to resume"
        else:
            text = f"{how}: saved a checkpoint at step {step}; re-run the same command to resume"
        super().__init__(text)
        self.step, self.exit_code = step, 128 + int(signum)


_noted: list[int] = []  # signals that arrived before the training loop watched for them
_startup_handlers: dict = {}


def note_signals() -> None:
    """From start-up until the training loop watches: SIGTERM and SIGINT are noted instead of
    ending the process, so a stop while compiling or restoring ends with one line and 143/130
    (stop_if_noted). A second Ctrl-C aborts."""
    if threading.current_thread() is threading.main_thread() and not _startup_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            _startup_handlers[sig] = signal.signal(sig, _note)


def _note(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in _noted:
        raise KeyboardInterrupt
    _noted.append(signum)


def release_signals() -> None:
    """The handlers from before note_signals (several processes: jax.distributed then takes SIGTERM)."""
    for sig, handler in _startup_handlers.items():
        signal.signal(sig, handler)
    _startup_handlers.clear()


def stop_if_noted(phase: str, step: Optional[int] = None) -> None:
    """Preempted (nothing new saved) when SIGTERM or SIGINT arrived during start-up."""
    if _noted:
        raise Preempted(step, _noted[0], phase)


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point.

    With several processes, jax.distributed's own SIGTERM notifier feeds that sync point, so
    no Python handler is installed over it."""

    def __init__(self):
        self.requested = bool(_noted)  # a signal from start-up, noted after the last check
        self.signum = _noted[0] if _noted else signal.SIGTERM  # what asked to stop
        import jax

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
            from jax.experimental import multihost_utils

            return any([multihost_utils.reached_preemption_sync_point(step) for step in range(first, last + 1)])
        return self.requested

    def close(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
