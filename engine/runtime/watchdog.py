"""No silent wait: a thread in every training process that notices when the run stops making
progress (a hung collective, a stalled file system, a data reader blocked on a dead mount),
writes every thread's Python stack to stderr and to `WORKDIR/hang-<time>.txt`, and ends the
process (exit 1) with one line naming the phase.

Each phase has its own limit (config `watchdog`, seconds, 0 = no limit): `compile` (loading
data and compiling), `restore`, `step` (between two iterations of the training loop),
`eval` and `save`. The loop calls `beat()` once per iteration, and each step's metrics that
arrive from the device count too (`watch`); phases nest (`with
watchdog.phase("save"): ...`), and leaving one restarts the clock of the phase around it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from engine.errors import exit_now

WHAT = {
    "compile": "loading data and compiling",
    "restore": "restoring a checkpoint",
    "step": "training (no step)",
    "eval": "evaluating",
    "save": "saving a checkpoint",
}


# how a hang file's headline names the step the process's loop last began: the process behind its
# peers (they wait for it in that step's collectives) is the one that hung (engine/elastic/accounting.py)
REACHED = "its loop last began step"


class Watchdog:
    def __init__(self, limits: dict[str, int], workdir: Path, process_index: int = 0, who: str = ""):
        self.limits, self.workdir, self.process_index = limits, Path(workdir), process_index
        self.who = who  # "evaluator": its stacks go to hang-evaluator-<time>.txt
        self.phases, self.since = ["compile"], time.monotonic()
        self.in_flight: list = []
        self.ready = 0
        self.step: Optional[int] = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self.thread.start()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.phases.append(name)
        self.since = time.monotonic()
        try:
            yield
        finally:
            self.since = time.monotonic()  # first: the phase around is never timed from before this one
            self.phases.pop()

    def beat(self, step: Optional[int] = None) -> None:
        """Progress in the current phase: its clock starts again (`step`: the training step the loop
        begins, named in a hang file)."""
        self.since = time.monotonic()
        self.step = step if step is not None else self.step

    def watch(self, in_flight: list) -> None:
        """The arrays the current steps will produce (a log window's metrics, appended to as
        calls are dispatched): each that becomes ready is progress too. The loop runs ahead of
        the device, so a healthy run can wait at a log line for many steps' worth of time."""
        self.in_flight, self.ready = in_flight, 0

    def enter(self, name: str) -> None:
        """Moves on to phase `name` (compile → restore → step), not nested."""
        self.phases[-1], self.since = name, time.monotonic()

    def close(self) -> None:
        """Stops the thread and waits for it: it may be inside JAX (an array's is_ready), where a
        thread still running when the interpreter exits is cancelled and aborts the process."""
        self.stopped.set()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            self._count_ready()
            phase = self.phases[-1]
            limit, waited = self.limits.get(phase, 0), time.monotonic() - self.since
            if limit and waited > limit:
                self._hung(phase, waited, limit)
                return

    def _count_ready(self) -> None:
        in_flight = self.in_flight
        while self.ready < len(in_flight) and getattr(in_flight[self.ready], "is_ready", lambda: True)():
            self.ready += 1
            self.since = time.monotonic()

    def _hung(self, phase: str, waited: float, limit: int) -> None:
        """Every thread's stack to stderr and hang-<time>.txt, one line, exit 1."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = (
            f"hang-{self.who + '-' if self.who else ''}{stamp}"
            + (f"-process{self.process_index}" if self.process_index else "")
            + ".txt"
        )
        headline = (
            f"no progress for {waited:.0f}s while {WHAT.get(phase, phase)} (watchdog.{phase}={limit}); "
            f"process {self.process_index}, pid {os.getpid()}"
            + (f"; {REACHED} {self.step}" if self.step is not None else "")
        )
        stderr = sys.__stderr__ or sys.stderr
        stderr.write(f"{headline}\nevery thread's Python stack:\n")
        stderr.flush()
        faulthandler.dump_traceback(file=stderr, all_threads=True)
        try:
            with open(self.workdir / name, "w") as f:
                f.write(headline + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = str(self.workdir / name)
        except OSError as e:  # the stacks went to stderr above
            where = f"stderr only ({self.workdir / name}: {e.strerror})"
        exit_now(
            f"error: {headline}; the stacks are in {where}. A hung collective (a peer stopped?), a stalled "
            f"file system or data reader are the usual causes; raise watchdog.{phase} if this phase is just slow",
            1,
        )


class Heartbeat:
    """A line on stderr whenever a phase has gone `seconds` without news ("tokenize: still …"):
    no step of a long command (tokenize) is silent for longer, however slow. It only speaks;
    the Watchdog above also stops a run that hangs."""

    def __init__(self, seconds: float):
        self.seconds, self.what, self.since = seconds, "starting", time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tokenize-heartbeat", daemon=True)

    def phase(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()

    def _watch(self) -> None:
        last_said = time.monotonic()
        while not self._done.wait(min(self.seconds, 1.0)):
            now = time.monotonic()
            if now - max(self.since, last_said) >= self.seconds:
                print(f"tokenize: still {self.what} ({now - self.since:,.0f} s)", file=sys.stderr, flush=True)
                last_said = now

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
