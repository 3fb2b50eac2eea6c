"""No silent wait: a thread in every training process that notices when the run stops making
progress (a hung collective, a stalled file system, a data reader blocked on a dead mount),
writes every thread's Python stack to stderr and to `WORKDIR/hang-<time>.txt`, and ends the
process (exit 1) with one line naming the phase.

Each phase has its own limit (config `watchdog`, seconds, 0 = no limit): `compile` (loading
data and compiling), `restore`, `step` (between two iterations of the training loop),
`eval` and `save`. The loop calls `beat()` once per iteration, and each step's metrics that
arrive from the device count too (`watch`); phases nest (`with
watchdog.phase("save"): ...`), and leaving one restarts the clock of the phase around it.

In a job of several processes the first watchdog to fire is often not the hung process's: its
peers wait for it in a collective (or a checkpoint's barrier) and the process hosting the
coordination service takes every other down when it exits. So a watchdog that fires asks its
peers for their state first (a census: the workdir's `hang-census.json`, naming the asker and
the time), and each peer's watchdog thread, which `stat`s that one path once a second whatever
its main thread does (no listing of the workdir: cheap on a shared file system), answers with
`hang-status-<time>-process<K>.txt` (the step its loop last began, how long it went without
progress) before the asker exits: the elastic supervisor then blames the process behind.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from engine.errors import exit_now
from engine.runtime.per_thread import given
from engine.runtime.rundir import write_atomic

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
CENSUS = "hang-census.json"  # a firing watchdog's request for its peers' state (the newest asker's)
STATUS = "hang-status-"  # a peer's answer (a .txt file, read as a hang file is)
CENSUS_SECONDS = 3.0  # how long a firing watchdog waits for the answers (peers poll once a second)


_on_hang: dict[int, Callable[[str], None]] = {}  # thread → what a hang of the run it trains does instead of exiting


@contextlib.contextmanager
def hang_here(callback: Callable[[str], None]) -> Iterator[None]:
    """While inside, a run that starts on this thread does not end the process when its watchdog
    fires: the watchdog writes its hang file, calls callback(why) on its own thread and stops (the
    run's thread stays where it hung). A sweep trial on a sub-mesh within its process
    (engine/sweep/submesh.py): the trial fails alone, the other sub-meshes train on."""
    with given(_on_hang, callback):
        yield


class Watchdog:
    def __init__(
        self, limits: dict[str, int], workdir: Path, process_index: int = 0, who: str = "", processes: int = 1
    ):
        self.limits, self.workdir, self.process_index = limits, Path(workdir), process_index
        self.who = who  # "evaluator": its stacks go to hang-evaluator-<time>.txt
        self.processes = processes  # the job's: above 1, a firing watchdog asks the others' state first
        self.started = time.time()  # (censuses of an earlier start are not answered)
        self.answered: set[tuple[int, int]] = set()  # (the census files answered: inode, mtime)
        self.phases, self.since = ["compile"], time.monotonic()
        self.in_flight: list = []
        self.ready = 0
        self.step: Optional[int] = None
        self.stopped = threading.Event()
        self.on_hang = _on_hang.get(threading.get_ident())  # (set on the thread the run is built on)
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
            if self.processes > 1:
                self._answer_census()
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

    def _state(self, phase: str, waited: float, limit: int) -> str:
        """The headline of a hang file or a census answer (engine/elastic/accounting.py reads it)."""
        return (
            f"no progress for {waited:.0f}s while {WHAT.get(phase, phase)} (watchdog.{phase}={limit}); "
            f"process {self.process_index}, pid {os.getpid()}"
            + (f"; {REACHED} {self.step}" if self.step is not None else "")
        )

    def _answer_census(self) -> None:
        """Answers a peer's census (its watchdog fired) with this process's state, once per census:
        one stat of the census file while there is none or it is the one answered last."""
        path = self.workdir / CENSUS
        try:
            stat = path.stat()
        except OSError:
            return
        seen = (stat.st_ino, stat.st_mtime_ns)  # (each census is a new file renamed into place)
        if seen in self.answered:
            return
        try:
            census = json.loads(path.read_text())
            asker, asked = census["process"], census["asked"]
        except (OSError, ValueError, KeyError, TypeError):  # (a census is renamed into place whole)
            return
        self.answered.add(seen)
        if asked < self.started or asker == self.process_index:
            return
        phase = self.phases[-1]
        state = self._state(phase, time.monotonic() - self.since, self.limits.get(phase, 0))
        name = f"{STATUS}{time.strftime('%Y%m%d-%H%M%S')}-process{self.process_index}.txt"
        with contextlib.suppress(OSError):  # (a full disk: the asker's own file is the report)
            write_atomic(self.workdir / name, f"{state}\n(answering the census of process {asker}'s watchdog)\n")

    def _census(self) -> None:
        """Asks the peers' watchdogs for their state and waits up to CENSUS_SECONDS for the answers."""
        asked, before = time.time(), set(self.workdir.glob(f"{STATUS}*.txt"))
        try:
            write_atomic(self.workdir / CENSUS, json.dumps({"process": self.process_index, "asked": asked}))
        except OSError:
            return
        deadline = time.monotonic() + CENSUS_SECONDS
        while time.monotonic() < deadline:
            if len(set(self.workdir.glob(f"{STATUS}*.txt")) - before) >= self.processes - 1:
                return
            time.sleep(0.1)

    def _hung(self, phase: str, waited: float, limit: int) -> None:
        """Every thread's stack to stderr and hang-<time>.txt, one line, (with peers: their census) exit 1."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = (
            f"hang-{self.who + '-' if self.who else ''}{stamp}"
            + (f"-process{self.process_index}" if self.process_index else "")
            + ".txt"
        )
        headline = self._state(phase, waited, limit)
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
        if self.processes > 1 and not self.who:
            self._census()
        if self.on_hang is not None:
            try:
                self.on_hang(f"{headline}; the stacks are in {where}")
                return
            except Exception as e:  # (its records could not be written: a full disk) the process ends, as alone
                headline += f" (and recording it as the sweep trial's failed: {type(e).__name__}: {e})"
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
