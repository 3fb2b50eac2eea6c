"""The restarted job's side of fault.elastic: its recovery records, and the tests' fault injection.

The launcher (engine/runtime/elastic.py) starts a restarted job with ENGINE_ELASTIC_ATTEMPT=k and
the failures so far in ENGINE_ELASTIC_FAILURES. Process 0 of that job writes, after its first step,
one `split: "recovery"` record per failure that metrics.jsonl does not hold yet (time of the
failure, the lost process, how it died, the step reached, the step restored, the tier used, the
seconds lost from the failure to this first step, the processes now), and says it on the console.
The time from the failure to this process's start is counted as the summary's badput_recovery.

ENGINE_TEST_KILL_AT=process:step[:start[:local]],... (tests only) makes that process SIGKILL itself once
it has dispatched that step, in that start of the job (ENGINE_ELASTIC_ATTEMPT; 0 when not given; `local`:
engine/runtime/restart.py). ENGINE_TEST_HANG_AT (the same form) makes it sleep for ever there instead:
a hung process, which its watchdog ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import jax

from engine.runtime.elastic import ATTEMPT, FAILURES, RECOVERY, failure_record, pending

KILL, HANG = "ENGINE_TEST_KILL_AT", "ENGINE_TEST_HANG_AT"


def attempt() -> int:
    """Which start of an elastic job this is (0: the first, or no elastic launcher)."""
    return int(os.environ.get(ATTEMPT, "0") or 0)


def kill_step() -> Optional[tuple[int, bool]]:
    """The step after which this process kills itself (ENGINE_TEST_KILL_AT), or hangs
    (ENGINE_TEST_HANG_AT: True), and which; None when neither names it (tests only)."""
    for hang, variable in enumerate((KILL, HANG)):
        for entry in filter(None, os.environ.get(variable, "").split(",")):
            process, step, *start = (int(part) for part in entry.split(":")[:3])
            if process == jax.process_index() and (start[0] if start else 0) == attempt():
                return step, bool(hang)
    return None


def kill_if_due(at: Optional[tuple[int, bool]], done: int) -> None:
    """SIGKILL this process once `done` reaches `at` (the tests' lost process: no clean-up), or
    sleep for ever (the tests' hung process: its watchdog ends it)."""
    if at is None or done < at[0]:
        return
    while at[1]:
        time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)


class Recovery:
    """The failures this start of the job recovers from (process 0's; none elsewhere)."""

    def __init__(self, failures: list[dict], start: int, meta: dict):
        self.failures, self.start, self.meta = failures, start, meta

    @classmethod
    def begin(cls, cfg, start: int, meta: dict) -> Optional["Recovery"]:
        """This start's recovery (after the restore; None when there is nothing to record)."""
        chief = jax.process_index() == 0
        if cfg.fault.elastic and ATTEMPT not in os.environ and jax.process_count() > 1 and chief:
            print(
                "note: fault.elastic restarts jobs started with --local-processes, or driven by `launch.py train "
                "--elastic` in a SLURM allocation (Kubernetes: not yet); here a lost process ends the job",
                file=sys.stderr,
            )
        failures = json.loads(os.environ.get(FAILURES, "") or "[]")
        unrecorded = pending(Path(cfg.workdir), failures) if chief and failures else []
        return cls(unrecorded, start, meta) if unrecorded else None

    def seconds_before(self, started: float) -> float:
        """From the earliest failure recovered from to this process's start."""
        return max(started - min(f["time"] for f in self.failures), 0.0)

    def write(self, writer, first_step_at: Optional[float]) -> None:
        """The records, to metrics.jsonl and the console (`writer`: the run's MetricWriter)."""
        tier = self.meta.get("tier", "none") if self.start else "none"
        source = self.meta.get("restored_from", "no checkpoint: from step 0")
        for failure in self.failures:
            lost = (first_step_at - failure["time"]) if first_step_at else None
            record = failure_record(
                failure,
                step_restored=self.start,
                tier=tier,
                restored_from=source,
                seconds_lost=lost,
                processes_now=jax.process_count(),
                recovered=True,
            )
            writer.write(self.start, RECOVERY, record)
            took = f"{lost:.1f}s" if lost is not None else "unknown time"
            writer.message(
                f"recovered: process {failure['process']} {failure['how']} at step {failure['step'] or 0}; "
                f"restored step {self.start} from {source}; {jax.process_count()} processes now; {took} lost"
            )
