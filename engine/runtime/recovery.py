"""The restarted job's side of fault.elastic: its recovery records, and growing back.

The supervisor (engine/elastic/supervisor.py, pods.py) starts a restarted job with ENGINE_ELASTIC_ATTEMPT=k and
the failures so far in the workdir's elastic-failures.json. Process 0 of that job writes, after its first step,
one `split: "recovery"` record per failure that metrics.jsonl does not hold yet (time of the
failure, the lost process, how it died, the step reached, the step restored, the tier used, the
seconds lost from the failure to this first step, the processes now), and says it on the console.
The time from the failure to this process's start is counted as the summary's badput_recovery.
A smaller job asked to grow back stops at a persistent checkpoint (`GrowWatch`, `GrowBack`:
engine/elastic/grow.py); the job grown from it writes one `split: "grow"` record, its
time from the stop counted as badput_recovery too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from engine.runtime.preemption import Preempted
from engine.runtime.processes import current
from engine.runtime.restart_protocol import (
    ATTEMPT,
    GREW,
    GROW,
    GROW_EXIT,
    RECOVERY,
    REQUEST,
    failure_record,
    pending,
    read_failures,
)

GROWN = "grow"  # the metrics.jsonl split of a growth's record


def attempt() -> int:
    """Which start of an elastic job this is (0: the first, or no elastic launcher)."""
    return int(os.environ.get(ATTEMPT, "0") or 0)


class GrowBack(Preempted):
    """Every process stops at a complete persistent checkpoint for the launcher to start the job
    again at its full size (engine/elastic/grow.py); exit code GROW_EXIT."""

    def __init__(self, step: int, processes: int):
        Exception.__init__(
            self,
            f"elastic: stopped at the persistent checkpoint of step {step} (complete) for the job to grow back to "
            f"{processes} processes",
        )
        self.step, self.exit_code = step, GROW_EXIT


class GrowWatch:
    """A smaller elastic job's question at each persistent checkpoint: has the launcher asked it to
    grow back? Process 0 reads the request and tells the others (one collective per persistent
    save), so every process stops at the same step."""

    def __init__(self, processes: int, request: Path):
        self.processes, self.request = processes, request

    @classmethod
    def begin(cls, cfg) -> Optional["GrowWatch"]:
        """The watch of a job started smaller than its full size (ENGINE_ELASTIC_GROW), else None."""
        full = int(os.environ.get(GROW, "0") or 0)
        return cls(full, Path(cfg.workdir) / REQUEST) if full > jax.process_count() else None

    def asked(self) -> bool:
        """Whether to stop here and grow back (the same answer on every process)."""
        asked = jax.process_index() == 0 and self.request.is_file()
        if jax.process_count() == 1:
            return asked
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.int32(asked)))


class Recovery:
    """The failures this start of the job recovers from (process 0's; none elsewhere)."""

    def __init__(self, failures: list[dict], start: int, meta: dict, grew: Optional[dict] = None):
        self.failures, self.start, self.meta, self.grew = failures, start, meta, grew

    @classmethod
    def begin(cls, cfg, start: int, meta: dict) -> Optional["Recovery"]:
        """This start's recovery (after the restore; None when there is nothing to record)."""
        chief = current().chief
        if cfg.fault.elastic and ATTEMPT not in os.environ and jax.process_count() > 1 and chief:
            print(
                "note: fault.elastic restarts jobs started with --local-processes, or driven by `launch.py train "
                "--elastic` in a SLURM allocation, or supervised by `launch.py train --rendezvous DIR` in each "
                "Kubernetes pod; here a lost process ends the job",
                file=sys.stderr,
            )
        failures = read_failures(Path(cfg.workdir)) if chief and ATTEMPT in os.environ else []
        unrecorded = pending(Path(cfg.workdir), failures) if chief and failures else []
        grew = json.loads(os.environ.get(GREW, "") or "null") if chief else None
        return cls(unrecorded, start, meta, grew) if unrecorded or grew else None

    def seconds_before(self, started: float) -> float:
        """From the earliest failure recovered from (or the stop to grow back) to this process's start."""
        times = [f["time"] for f in self.failures] + ([self.grew["time"]] if self.grew else [])
        return max(started - min(times), 0.0)

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
        if self.grew:
            lost = (first_step_at - self.grew["time"]) if first_step_at else None
            record = {
                "time": self.grew["time"],
                "attempt": attempt(),
                "processes_before": self.grew["processes"],
                "processes_now": jax.process_count(),
                "step_restored": self.start,
                "tier": tier,
                "restored_from": source,
                "seconds_lost": lost,
            }
            writer.write(self.start, GROWN, record)
            took = f"{lost:.1f}s" if lost is not None else "unknown time"
            writer.message(
                f"grew back: from {self.grew['processes']} to {jax.process_count()} processes at the persistent "
                f"checkpoint of step {self.start} (from {source}); {took} from the stop to this step"
            )
