"""A search trial judged as it trains: the run sends each train and eval record it logs to the
sweep process through a pipe and waits for the answer (go on, or stop: it then saves and exits
143, as on SIGTERM). So the pruner decides at exactly the record it judged, however fast the
run steps; the sweep never reads a metrics file that races ahead of it.

Imports no jax: the sweep's process uses it too."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
from typing import Callable, Optional

ENV = "ENGINE_JUDGE_FDS"  # "r,w": the run reads answers from r and writes records to w
GO, STOP = b"go\n", b"stop\n"


class Judged:
    """The run's side: ask() after each record; a stop answer is a SIGTERM to this process."""

    def __init__(self, read_fd: int, write_fd: int):
        self.answers, self.records = os.fdopen(read_fd, "rb", buffering=0), os.fdopen(write_fd, "wb", buffering=0)

    @classmethod
    def from_env(cls) -> Optional["Judged"]:
        own = _by_thread.get(threading.get_ident())
        if own is not None:  # a trial on a thread of the sweep's own process
            return own
        fds = os.environ.pop(ENV, "")  # (popped: processes this one starts are not judged)
        if not fds:
            return None
        read_fd, write_fd = (int(fd) for fd in fds.split(","))
        return cls(read_fd, write_fd)

    def ask(self, record: dict) -> None:
        """Sends `record`, waits for the verdict; a sweep that went away (a closed pipe) lets the run go on."""
        try:
            self.records.write(json.dumps(record).encode() + b"\n")
            answer = self.answers.readline()
        except (BrokenPipeError, OSError):
            return
        if answer == STOP:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves the step reached and exits 143

    def close(self) -> None:
        self.answers.close()
        self.records.close()


class Judge:
    """The sweep's side: the pipes' ends the run inherits, and one record at a time."""

    def __init__(self):
        self._answers_r, self._answers_w = os.pipe()
        self._records_r, self._records_w = os.pipe()
        self._buffer = b""

    def child_env(self, env: dict) -> dict:
        return {**env, ENV: f"{self._answers_r},{self._records_w}"}

    @property
    def child_fds(self) -> tuple[int, int]:
        return self._answers_r, self._records_w

    def started(self) -> None:
        """The run holds its ends: the sweep closes its copies (so the run's exit is an end of file)."""
        os.close(self._answers_r)
        os.close(self._records_w)

    def next_record(self, timeout: float):
        """The run's next record; None if none came within `timeout`; EOFError once the run exited."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._records_r], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._records_r, 65536)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def answer(self, go: bool) -> bool:
        """False when the run ended before it could read the answer."""
        try:
            os.write(self._answers_w, GO if go else STOP)
        except BrokenPipeError:
            return False
        return True

    def close(self) -> None:
        for fd in (self._answers_w, self._records_r):
            os.close(fd)


class InProcess(Judged):
    """A trial trained on a thread of the sweep's process (engine/sweep/submesh.py): each record
    goes to `verdict` on the trial's thread, whose False stops the run as a stop answer does
    (`stop` is the event engine.runtime.preemption.thread_stop watches)."""

    def __init__(self, verdict: Callable[[dict], bool], stop: threading.Event):
        self.verdict, self.stop = verdict, stop

    def ask(self, record: dict) -> None:
        if not self.verdict(record):
            self.stop.set()

    def close(self) -> None:
        return None


_by_thread: dict[int, Judged] = {}


@contextlib.contextmanager
def judged_here(judged: Judged):
    """While inside, a run that starts on this thread is judged by `judged`."""
    ident = threading.get_ident()
    _by_thread[ident] = judged
    try:
        yield
    finally:
        _by_thread.pop(ident, None)
