"""SIGTERM → save and stop: noticing the signal, and agreeing on the step across processes."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from typing import TYPE_CHECKING, Optional

from engine.errors import exit_now
from engine.runtime.per_thread import given

if TYPE_CHECKING:  # (processes.py imports this module through distributed.py)
    from engine.runtime.processes import RunProcesses


class Preempted(Exception):
    """SIGTERM (or Ctrl-C's SIGINT) arrived; a checkpoint at `step` was saved and completed.
    exit_code: 143 for SIGTERM, 130 for SIGINT, as a shell reports a process ended by them."""

    def __init__(self, step: int, signum: int = signal.SIGTERM):
        name = signal.Signals(signum).name
        super().__init__(
            f"{'preempted' if signum == signal.SIGTERM else 'stopped'} by {name}: saved a checkpoint "
            f"at step {step}; re-run the same command to resume"
        )
        self.step, self.exit_code = step, 128 + int(signum)


_noted: list[int] = []  # signals that arrived before the training loop watched for them
_thread_stops: dict[int, threading.Event] = {}  # a thread's own stop (a sweep trial on a thread: thread_stop)
_startup_handlers: dict = {}
_startup: dict = {"phase": None, "cleanups": []}  # what start-up is doing; what to undo if it ends there


def note_signals() -> None:
    """From start-up until the training loop watches (end_startup): a SIGTERM or SIGINT ends
    the process at once, whatever the main thread is in (loading data, an XLA compile, a
    restore), with one line and 143/130: nothing new was trained, so there is nothing to
    save. Python runs signal handlers only between bytecodes of the main thread, so a thread
    woken through the signal wakeup fd does it."""
    if threading.current_thread() is not threading.main_thread() or _startup_handlers:
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        _startup_handlers[sig] = signal.signal(sig, _note)
    thread = threading.Thread(target=_end_at_once, args=(reader,), name="startup-signals", daemon=True)
    _startup.update(phase="starting", sockets=(reader, writer), thread=thread)
    thread.start()


def _note(signum, frame):
    _noted.append(signum)


def _end_at_once(reader: socket.socket) -> None:
    while data := reader.recv(1):
        phase = _startup["phase"]
        if phase is None or data[0] not in (signal.SIGTERM, signal.SIGINT):
            continue  # the training loop (or JAX's notifier) handles signals now
        for cleanup in _startup["cleanups"]:
            with contextlib.suppress(OSError):
                cleanup()
        how = "preempted by SIGTERM" if data[0] == signal.SIGTERM else "stopped by SIGINT"
        exit_now(f"{how} while {phase}: nothing new to save; re-run the same command to resume", 128 + data[0])


def starting(phase: Optional[str], cleanup=None) -> None:
    """Names what start-up does now (for that one line; None: unchanged); `cleanup` runs if a
    signal ends it."""
    if _startup["phase"] is not None:  # only while note_signals watches
        _startup["phase"] = phase or _startup["phase"]
        if cleanup is not None:
            _startup["cleanups"].append(cleanup)


@contextlib.contextmanager
def thread_stop(event: threading.Event):
    """While inside, a training loop on this thread stops once `event` is set as on SIGTERM
    (it saves the step reached and raises Preempted): a sweep trial trained on a thread of the
    sweep's process (engine/sweep/submesh.py), which signals cannot single out."""
    with given(_thread_stops, event):
        yield


def end_startup() -> None:
    """The training loop takes over: signals are noted again (and saved for), not fatal."""
    _startup.update(phase=None, cleanups=[])
    if threading.current_thread() is threading.main_thread() and _startup_handlers:
        signal.set_wakeup_fd(-1)


def release_signals() -> None:
    """The handlers from before note_signals (several processes: jax.distributed then takes SIGTERM)."""
    end_startup()
    for sig, handler in _startup_handlers.items():
        signal.signal(sig, handler)
    _startup_handlers.clear()


def stop_noting() -> None:
    """The command is over: the handlers from before note_signals, and its thread ended (joined)
    rather than left blocked until the interpreter exits."""
    if threading.current_thread() is not threading.main_thread() or "thread" not in _startup:
        return
    release_signals()
    reader, writer = _startup.pop("sockets")
    writer.close()  # the thread's recv() sees the end of the stream and returns
    _startup.pop("thread").join()
    reader.close()


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point.

    With several processes, jax.distributed's own SIGTERM notifier feeds that sync point, so
    no Python handler is installed over it."""

    def __init__(self, processes: Optional["RunProcesses"] = None):
        """`processes`: the run's (engine/runtime/processes.py; a sub-mesh trial's may be some of the
        job's, who agree on a sweep's stop with RunProcesses.any_of). None: one process."""
        self.processes = processes
        self.requested = bool(_noted)  # a signal from start-up, noted after the last check
        self.signum = _noted[0] if _noted else signal.SIGTERM  # what asked to stop
        self.multi_process = processes is not None and processes.count > 1
        self.thread_stop = _thread_stops.get(threading.get_ident())
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
        so every step of the call is reported to it (several with train.steps_per_call). A sweep
        trial on some of a job's processes (its stop: the sweep's, per thread) asks its processes
        after each call instead, through the store: JAX's sync point is the whole job's."""
        if self.multi_process and self.thread_stop is not None:
            assert self.processes is not None  # (multi_process)
            self.requested = self.processes.any_of(self.thread_stop.is_set())
            return self.requested
        if self.multi_process:
            from jax.experimental import multihost_utils

            return any([multihost_utils.reached_preemption_sync_point(step) for step in range(first, last + 1)])
        if self.thread_stop is not None and self.thread_stop.is_set():
            self.requested = True
        return self.requested

    def close(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
