"""No silent wait: a thread in every training process that notices when the run stops making
progress (a hung collective, a stalled file system, a data reader blocked on a dead mount),
writes every thread's Python stack to stderr and to `WORKDIR/hang-<time>.txt`, and ends the
process (exit 1) with one line naming the phase.

Each phase has its own limit (config `watchdog`, seconds, 0 = no limit): `compile` (loading
data and compiling), `restore`, `step` (between two iterations of the training loop),
`eval` and `save`. The loop calls `beat()` once per iteration; phases nest (`with
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

WHAT = {"compile": "loading data and compiling", "restore": "restoring a checkpoint", "step": "training (no step)",
        "eval": "evaluating", "save": "saving a checkpoint"}


class Watchdog:
    def __init__(self, limits: dict[str, int], workdir: Path, process_index: int = 0, exit=os._exit):
        self.limits, self.workdir, self.process_index, self.exit = limits, Path(workdir), process_index, exit
        self.phases, self.since = ["compile"], time.monotonic()
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
            self.phases.pop()
            self.since = time.monotonic()

    def beat(self) -> None:
        """Progress in the current phase: its clock starts again."""
        self.since = time.monotonic()

    def enter(self, name: str) -> None:
        """Moves on to phase `name` (compile → restore → step), not nested."""
        self.phases[-1], self.since = name, time.monotonic()

    def close(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            phase = self.phases[-1]
            limit, waited = self.limits.get(phase, 0), time.monotonic() - self.since
            if limit and waited > limit:
                self._hung(phase, waited, limit)
                return

    def _hung(self, phase: str, waited: float, limit: int) -> None:
        """Every thread's stack to stderr and hang-<time>.txt, one line, exit 1."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = f"hang-{stamp}" + (f"-process{self.process_index}" if self.process_index else "") + ".txt"
        headline = (f"no progress for {waited:.0f}s while {WHAT.get(phase, phase)} (watchdog.{phase}={limit}); "
                    f"process {self.process_index}, pid {os.getpid()}")
        stderr = sys.__stderr__
        stderr.write(f"{headline}\nevery thread's Python stack:\n")
        stderr.flush()
        faulthandler.dump_traceback(file=stderr, all_threads=True)
        where = "stderr only (the workdir is not writable)"
        try:
            with open(self.workdir / name, "w") as f:
                f.write(headline + "\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = str(self.workdir / name)
        except OSError:
            pass  # the stacks went to stderr above
        stderr.write(f"error: {headline}; the stacks are in {where}. A hung collective (a peer stopped?), "
                     f"a stalled file system or data reader are the usual causes; raise watchdog.{phase} if this "
                     f"phase is just slow\n")
        stderr.flush()
        self.exit(1)
