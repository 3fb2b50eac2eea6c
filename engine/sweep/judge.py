"""A search trial judged as it trains: the run sends each train and eval record it logs to the
sweep process through a pipe and waits for the answer (go on, or stop: it then saves and exits
143, as on SIGTERM). So the pruner decides at exactly the record it judged, however fast the
run steps; the sweep never reads a metrics file that races ahead of it.

This is the sweep's side; the trial's (Judged, InProcess) is engine/runtime/judged.py. Imports
no jax: the sweep's process uses it too."""

from __future__ import annotations

import json
import os
import select

from engine.runtime.judged import ENV, GO, STOP


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
