"""What an elastic job's supervisor and its trainer processes tell each other (imports nothing of either).

The supervisor (engine/elastic/) starts each start of the job with ENGINE_ELASTIC_ATTEMPT=k (and,
locally, ENGINE_ELASTIC_JOB: the job's start and its earlier starts' recovery seconds), writes the
failures so far to WORKDIR/elastic-failures.json, and asks a smaller job to grow back by
WORKDIR/grow-request.json (ENGINE_ELASTIC_GROW: the full size; ENGINE_ELASTIC_GREW: the stop a
grown start came from). Process 0 of a restarted job (engine/runtime/recovery.py) reads them and
writes one `split: "recovery"` record per failure that metrics.jsonl does not hold yet; every
process that stops to grow back exits GROW_EXIT. Imports no jax.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from engine.runtime.launcher import GROW_EXIT as GROW_EXIT
from engine.runtime.rundir import METRICS, read_records

ATTEMPT = "ENGINE_ELASTIC_ATTEMPT"  # 0 for the first start, k for the k-th restart
JOB = "ENGINE_ELASTIC_JOB"  # JSON {"started", "recovery"}: the job's start, the seconds between its earlier starts
FAILURES_FILE = "elastic-failures.json"  # in the workdir: the failures so far, a JSON list of `failure` dicts
RECOVERY = "recovery"  # the metrics.jsonl split of failure and recovery records
GROW = "ENGINE_ELASTIC_GROW"  # the job's full size, given to a start smaller than it
GREW = "ENGINE_ELASTIC_GREW"  # JSON {"time", "processes"}: the stop of the smaller job this start grew from
REQUEST = "grow-request.json"  # in the workdir: the launcher's request to grow back


def job_so_far(started: float, gap: float) -> tuple[float, float]:
    """(the recovery seconds, the earlier starts' seconds) of the elastic job this start of its
    processes belongs to, up to this process's start `started` (`gap`: this start's own recovery,
    from the failure or the stop to grow back); (gap, 0) outside a local elastic job."""
    job = json.loads(os.environ.get(JOB, "") or "null")
    if not isinstance(job, dict):
        return gap, 0.0
    recovery = job["recovery"] + gap
    return recovery, max(started - job["started"] - recovery, 0.0)


def recorded(workdir: Path) -> set[tuple[int, int]]:
    """(attempt, process) of the failures metrics.jsonl already holds a record of."""
    return {
        (r.get("attempt", -1), r.get("lost_process", -1))
        for r in read_records(Path(workdir) / METRICS)
        if r["split"] == RECOVERY
    }


def pending(workdir: Path, failures: list[dict]) -> list[dict]:
    """The failures without a record yet."""
    done = recorded(workdir)
    return [f for f in failures if (f["attempt"], f["process"]) not in done]


def failure_record(failure: dict, **recovery: Any) -> dict:
    """A metrics.jsonl record's fields for `failure` and how the job recovered (step_restored,
    tier, restored_from, seconds_lost, processes_now, recovered)."""
    return {
        "time": failure["time"],
        "attempt": failure["attempt"],
        "lost_process": failure["process"],
        "how": failure["how"],
        "step_reached": failure["step"],
        "processes_before": failure["processes"],
        "seconds_to_stop": failure.get("seconds_to_stop"),
        **recovery,
    }


def read_failures(workdir: Path) -> list[dict]:
    """The failures so far that the supervisor wrote for this start ([] when none)."""
    path = Path(workdir) / FAILURES_FILE
    return json.loads(path.read_text()) if path.is_file() else []
