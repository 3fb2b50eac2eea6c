"""An elastic job's accounting, the same under every launcher: which processes a failure lost, whether it restarts.

The supervisor (engine/elastic/supervisor.py, for local processes and SLURM steps) and the pods'
round leader (engine/elastic/pods.py) hand what they saw of a start's end to the functions here:
`lost` tells a lost process (killed, hung) from a failure every process met on its own (a NaN stop,
a bug's traceback: all exit 1, which ends the job with exit 1 and a message saying why it was not
restarted); `hung_processes`/`hang_key` attribute a hang from the watchdogs' hang files (the
process whose loop is behind is the culprit); `note_failures` adds the lost processes to the
failures so far; `verdict` says whether the job restarts (fault.max_restarts counts the restarts
since the job last ran at its full size; fault.min_processes the processes left) or gives up
(`give_up`: a `split: "recovery"` record for each failure no job recovered from, one message
naming every failure, exit 1).

Each restarted process gets ENGINE_ELASTIC_ATTEMPT=k; the failures so far are in the workdir's
ELASTIC_FAILURES file (`write_failures`), which process 0 of the job that recovers reads to write
one `split: "recovery"` record per failure after its first step (engine/runtime/recovery.py).

After a failure the survivors are SIGKILLed at once, not given the launcher's SIGTERM grace
(launcher.GRACE_SECONDS, 10 s): with a peer gone, a survivor's SIGTERM save cannot complete (it
is a collective: the preemption sync point and every shard's write need every process), and a
survivor blocked in a step's collective waits there until the SIGKILL anyway. Nothing is lost by
it: every checkpoint of either tier is written to a temporary name and committed when complete,
so the tiers hold the newest step saved before the failure whatever moment the kill comes. The
record's `seconds_to_stop` is that stop (docs/multihost.md). Imports no jax.
"""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from engine.runtime.launcher import ABORT_SETTLE_SECONDS
from engine.runtime.restart_protocol import ATTEMPT as ATTEMPT
from engine.runtime.restart_protocol import FAILURES_FILE, RECOVERY, failure_record, pending
from engine.runtime.restart_protocol import JOB as JOB
from engine.runtime.rundir import METRICS, append_line, read_records, write_atomic
from engine.runtime.watchdog import REACHED, STATUS

# after a process fails without a signal, how long the others may take to end on their own before
# they are stopped: when all do, the failure is the job's own (`lost`), not a lost process
SETTLE_SECONDS = 3.0
AT_ONCE = 0.5  # failures seen this close to the first are of its moment (the launcher polls every 0.2 s)


def describe(code: int) -> str:
    """How a process ended, from its return code."""
    return f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"


Failure = tuple[int, int, float]  # (process, return code, time)


def lost(seen: list[Failure], processes: int, hung: list[int]) -> tuple[list[Failure], str]:
    """(the processes lost, why the job is not restarted: "" when it is), from the failures `seen`
    before the others were stopped ((process, return code, time), in the order seen; -n: killed by
    signal n) among `processes`, and the processes whose watchdog's hang file appeared (`hung`, the
    likeliest culprit first). A hung process is the one lost, ahead of a signal that comes with its
    exit (a peer's SIGABRT once the coordination service misses it may arrive first). Else a lost
    process is one killed by another signal than SIGABRT and SIGTERM (a stop's) within
    ABORT_SETTLE_SECONDS of the first failure (the SIGABRTs seen before it are its peers' aborts, once
    the coordination service or a collective lost it), with those of its moment (AT_ONCE); else the
    first SIGABRT when one came first (at the first failure's moment); else the first failure when
    only a strict subset failed on its own while the others went on (as a lost host's peers wait in a
    collective until stopped), or when the others died of its consequences (a SIGABRT after an exit
    code is the exit's consequence). When every process exited with an
    error code on its own, the failure is the job's (a NaN stop, a bug, a bad input): a restart
    would meet it again."""
    if not seen:
        return [], "no process failed"
    if hung:
        mine = [failure for failure in seen if failure[0] == hung[0]]
        return mine or [(hung[0], 1, seen[0][2])], ""  # (stopped by the launcher before its watchdog's exit)
    signalled = [failure for failure in seen if failure[1] < 0 and -failure[1] != signal.SIGTERM]
    killed = [failure for failure in signalled if failure[2] <= seen[0][2] + AT_ONCE]
    # another signal than SIGABRT outranks the SIGABRTs before it (its peers' aborts once the coordination
    # service or a collective lost it: a killed process's own exit may be seen after them), within
    # the launcher's ABORT_SETTLE_SECONDS of the first failure
    primary = [f for f in signalled if -f[1] != signal.SIGABRT and f[2] <= seen[0][2] + ABORT_SETTLE_SECONDS + AT_ONCE]
    if primary:
        return [failure for failure in primary if failure[2] <= primary[0][2] + AT_ONCE], ""
    if killed and seen[0][1] < 0:  # (SIGABRTs alone: the first; after an exit code, they are its consequence)
        return killed[:1], ""
    if signalled or len({index for index, _, _ in seen}) < processes:
        return seen[:1], ""
    codes = ", ".join(sorted({describe(code) for _, code, _ in seen}))
    return [], (
        f"every one of its {processes} processes {codes} on its own (not killed by a signal, none hung): a failure "
        "the job meets again when restarted, not a lost process, so it was not restarted"
    )


def hung_processes(files: list[Path]) -> list[tuple[int, Path]]:
    """(process, hang file) of the watchdogs' hang files and census answers `files` (not an
    evaluator's), the likeliest culprit first: the process whose loop is behind (its peers went on
    into the next step and wait for it in that step's collectives), then the one whose progress
    stopped first. One entry per process (its file that says so most)."""
    found = sorted((key, path) for path in files if (key := hang_key(path)) is not None)
    first: dict[int, Path] = {}
    for key, path in found:
        first.setdefault(key[2], path)
    return list(first.items())


def hang_key(path: Path) -> Optional[tuple[float, float, int]]:
    """(the step the process's loop last began (inf: none), when its progress stopped (the file's
    time less the seconds it went without), the process) of a watchdog's hang file or census
    answer (engine/runtime/watchdog.py); None for an evaluator's or an unreadable one."""
    try:
        headline = path.read_text(errors="replace").split("\n", 1)[0]
        written = path.stat().st_mtime
    except OSError:
        return None
    process = re.search(r"; process (\d+), pid \d+", headline)
    step = re.search(rf"; {REACHED} (\d+)", headline)
    waited = re.search(r"^no progress for ([\d.]+)s", headline)
    if process is None or path.name.startswith("hang-evaluator"):
        return None
    stalled = written - (float(waited.group(1)) if waited else 0.0)
    return (int(step.group(1)) if step else math.inf), stalled, int(process.group(1))


def after_failure(
    code: int, seen: list, hangs: set, failures: list[dict], alive: int, attempt: int, cfg, full_since: int = 0
):
    """(the job's exit code when it ends with this start, else None; the processes left) after a
    start of the job that ended with `code` and the failures `seen` (the supervisor's launchers);
    `hangs`: the workdir's hang files before the start; `full_since`: the start at which the job
    last ran at its full size (fault.max_restarts counts the restarts since)."""
    workdir = Path(cfg.workdir)
    if code != 1 or not seen or all(c == 2 for _, c, _ in seen):  # done, preempted, or a usage error
        return code, alive
    hung: dict[int, str] = {}
    for index, path in hung_processes(sorted(set(workdir.glob("hang-*.txt")) - hangs)):  # the likeliest first
        hung.setdefault(index, f": {path.name}")
    gone, message, ends = account(workdir, failures, seen, alive, hung, attempt, cfg.fault, full_since, time.time())
    sys.stderr.write(message)
    return (1 if ends else None), alive - gone


def account(
    workdir: Path,
    failures: list[dict],
    seen: list[Failure],
    alive: int,
    hung: dict[int, str],
    attempt: int,
    fault,
    full_since: int,
    stopped: Optional[float] = None,
    left: Optional[int] = None,
) -> tuple[int, str, bool]:
    """Adds the processes that start `attempt` (of `alive` processes) lost among the failures
    `seen` to `failures`; (how many were lost, what to say, whether the job ends). `hung`: the
    processes whose watchdog reported a hang, the likeliest culprit first (process → what names
    its hang file); `stopped`: when the survivors were stopped (the record's seconds_to_stop);
    `left`: the processes the next start would have (alive less the lost ones when None)."""
    step = step_reached(workdir)
    gone, why = lost(seen, alive, list(hung))
    for index, rc, when in gone:
        how = describe(rc)
        if index in hung:
            said = hung[index]
            how = (
                f"hung ({how}; behind its peers by its watchdog's census answer{said})"
                if STATUS in said
                else (f"hung ({how} by its watchdog{said})")
            )
        failures.append(dict(attempt=attempt, process=index, how=how, step=step, time=when, processes=alive))
        if stopped is not None:
            failures[-1]["seconds_to_stop"] = round(stopped - when, 3)
    if why:  # (the lost processes before it, when no job recovered from them, are recorded)
        message = f"error: the job failed at step {step or 0}: {why} (fault.elastic restarts a job after a lost "
        message += "process)\n"
        more = give_up(workdir, failures, "it failed on its own") if pending(workdir, failures) else ""
        return 0, message + more, True
    limit = limit_message(workdir, failures, fault, full_since, alive - len(gone) if left is None else left)
    return len(gone), limit, bool(limit)


def limit_message(workdir: Path, failures: list[dict], fault, full_since: int, left: int) -> str:
    """The give-up message when fault.max_restarts or fault.min_processes stops the job ("" when it restarts)."""
    limit = restart_limit(fault, restarts(failures, full_since) - 1, left)
    return give_up(workdir, failures, limit) if limit else ""


def restarts(failures: list[dict], since: int) -> int:
    """The restarts after failures from start `since` on (one per start that lost processes)."""
    return len({failure["attempt"] for failure in failures if failure["attempt"] >= since})


def restart_limit(fault, used: int, alive: int) -> str:
    """Why the job cannot be restarted again after `used` restarts ("" when it can)."""
    if used >= fault.max_restarts:
        return f"fault.max_restarts={fault.max_restarts} restart(s) used"
    if alive < fault.min_processes:
        return f"{alive} process(es) would remain, fewer than fault.min_processes={fault.min_processes}"
    return ""


def step_reached(workdir: Path) -> Optional[int]:
    """The last training step metrics.jsonl records (None before the first)."""
    steps = [r["step"] for r in read_records(workdir / METRICS) if r["split"] == "train"]
    return max(steps, default=None)


def give_up(workdir: Path, failures: list[dict], limit: str) -> str:
    """Records the failures no job recovered from; the message naming every failure (the caller says it, exit 1)."""
    for failure in pending(workdir, failures) if workdir.is_dir() else []:
        record = failure_record(failure, step_restored=None, tier=None, seconds_lost=None, processes_now=0)
        record = {"step": failure["step"] or 0, "split": RECOVERY, **record, "recovered": False}
        append_line(workdir / METRICS, json.dumps(record) + "\n")
    named = "; ".join(
        f"process {f['process']} of {f['processes']} {f['how']} at step {f['step'] or 0} (start {f['attempt']})"
        for f in failures
    )
    return (
        f"error: the job cannot go on ({limit}); failures: {named}. The newest checkpoint is intact: "
        "running the same command again resumes from it\n"
    )


def write_failures(workdir: Path, failures: list[dict]) -> None:
    """The failures so far, in the workdir (before each start: its process 0 records them, recovery.py)."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(workdir) / FAILURES_FILE, json.dumps(failures) + "\n")
