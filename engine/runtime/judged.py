"""A search trial's side of its sweep's judgement: the run sends each train and eval record it
logs through a pipe (ENGINE_JUDGE_FDS) and waits for the answer: go on, or stop (a SIGTERM to
itself: it saves and exits 143). A trial on a thread of the sweep's own process is judged in
process instead (InProcess). The sweep's side is engine/sweep/judge.py. Imports no jax."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from typing import Callable, Optional

from engine.runtime.per_thread import given

ENV = "ENGINE_JUDGE_FDS"  # "r,w": the run reads answers from r and writes records to w
GO, STOP = b"go\n", b"stop\n"


class Judged:
    """The run's side: ask() after each record; a stop answer is a SIGTERM to this process."""

    def __init__(self, read_fd: int, write_fd: int):
        self.answers, self.records = os.fdopen(read_fd, "rb", buffering=0), os.fdopen(write_fd, "wb", buffering=0)

    @classmethod
    def from_env(cls) -> Optional["Judged"]:
        own = cls.on_thread()
        if own is not None:  # a trial on a thread of the sweep's own process
            return own
        fds = os.environ.pop(ENV, "")  # (popped: processes this one starts are not judged)
        if not fds:
            return None
        read_fd, write_fd = (int(fd) for fd in fds.split(","))
        return cls(read_fd, write_fd)

    @staticmethod
    def on_thread(workdir: Optional[str] = None) -> Optional["Judged"]:
        """The judge judged_here set on this thread (for the run in `workdir`: a vectorised group's
        trial), or None."""
        own = _by_thread.get(threading.get_ident())
        if isinstance(own, dict):
            return own.get(str(workdir))
        return own

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


_by_thread: dict[int, Judged | dict[str, Judged]] = {}


@contextlib.contextmanager
def judged_here(judged: Judged | dict[str, Judged]):
    """While inside, a run that starts on this thread is judged by `judged` (a dict: each
    vectorised group trial's by its workdir, as its config names it)."""
    with given(_by_thread, judged):
        yield
