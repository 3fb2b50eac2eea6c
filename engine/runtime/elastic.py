"""fault.elastic on the local launcher: a job whose process dies or hangs is restarted on the processes left.

The launcher (launcher.py) runs the job; when a process fails (a nonzero exit, a signal, or the
watchdog's exit on a hang) the others are stopped as always, and with fault.elastic the job is
started again on the processes left (each start with a fresh coordinator port), resuming from the
newest checkpoint of either tier, until it succeeds, fewer than fault.min_processes would remain or
fault.max_restarts restarts are used. Only a lost process restarts it (`lost`): a failure every
process met on its own (a NaN stop, a bug's traceback: all exit 1) ends the job with exit 1 and a
message saying why it was not restarted. The axis that shrinks is the outermost data axis: the mesh's
other axes keep their sizes, mesh.data (and mesh.dcn_data) take the devices left; the global batch,
the data order and the random numbers do not depend on the process count (engine/data/pipeline.py),
so each device's share of the batch grows. Whether every smaller job from N-1 processes down to
fault.min_processes has such a layout is checked before the first start (`shrink_plan`).

Each restarted process gets ENGINE_ELASTIC_ATTEMPT=k and the failures so far in
ENGINE_ELASTIC_FAILURES (JSON); process 0 of the job that recovers writes one `split: "recovery"`
record per failure to metrics.jsonl after its first step (engine/run/recovery.py). Failures no
job recovered from are recorded by the launcher when it gives up. Imports no jax.

After a failure the survivors are SIGKILLed at once, not given the launcher's SIGTERM grace
(launcher.GRACE_SECONDS, 10 s): with a peer gone, a survivor's SIGTERM save cannot complete (it
is a collective: the preemption sync point and every shard's write need every process), and a
survivor blocked in a step's collective waits there until the SIGKILL anyway, so the grace only
added its seconds to the time lost. Nothing is lost by it: every checkpoint of either tier is
written to a temporary name and committed when complete (a killed save leaves none, and a local
step that does not read is set aside), so the tiers hold the newest step saved before the failure
whatever moment the kill comes. The record's `seconds_to_stop` is that stop (measured on this
2-core machine, mnist_mlp 4x2 killed at step 20: seconds_lost 26.9 s with the grace, see
docs/multihost.md for after). fault.precompile: engine/runtime/restart.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from engine.errors import UsageError
from engine.parallel.axes import BATCH_AXES, CONFIG_AXES
from engine.runtime.elastic_grow import GROW_EXIT, grew_from, note_growth, request, start_env, withdraw
from engine.runtime.launcher import ABORT_SETTLE_SECONDS
from engine.runtime.rundir import METRICS, append_line, read_records
from engine.runtime.watchdog import REACHED

ATTEMPT = "ENGINE_ELASTIC_ATTEMPT"  # 0 for the first start, k for the k-th restart
JOB = "ENGINE_ELASTIC_JOB"  # JSON {"started", "recovery"}: the job's start, the seconds between its earlier starts
FAILURES = "ENGINE_ELASTIC_FAILURES"  # the failures so far: a JSON list of `failure` dicts
RECOVERY = "recovery"  # the metrics.jsonl split of failure and recovery records
# after a process fails without a signal, how long the others may take to end on their own before
# they are stopped: when all do, the failure is the job's own (`lost`), not a lost process
SETTLE_SECONDS = 3.0
AT_ONCE = 0.5  # failures seen this close to the first are of its moment (the launcher polls every 0.2 s)


def shrink_plan(cfg, processes: int, devices: int) -> dict[int, list[str]]:
    """For every process count from fault.min_processes to processes - 1: the mesh overrides of a
    job on that many processes (the data axis shrinks). UsageError naming the fix when one has none."""
    fault = cfg.fault
    if processes < 2:
        raise UsageError("fault.elastic=true needs a job of several processes (--local-processes 2 or more)")
    if fault.min_processes >= processes:
        raise UsageError(
            f"fault.elastic=true: fault.min_processes={fault.min_processes} leaves no smaller job for "
            f"{processes} processes to go on with; set fault.min_processes below {processes}"
        )
    if cfg.train.sync == "diloco" and cfg.finetune.base:
        raise UsageError(
            "fault.elastic=true with train.sync=diloco and finetune.base: continuing on fewer DiLoCo replicas is "
            "not built for a frozen base yet; set fault.elastic=false (a lost process then ends the job)"
        )
    sizes = {axis: getattr(cfg.mesh, axis) for axis in CONFIG_AXES}
    derived = [axis for axis, size in sizes.items() if size == -1 and axis != "data"]
    if derived:
        raise UsageError(
            f"fault.elastic=true: mesh.{derived[0]}=-1 would take the devices a lost process leaves, but only "
            f"the data axis shrinks; set mesh.{derived[0]} to a size and mesh.data=-1"
        )
    others = math.prod(size for axis, size in sizes.items() if axis != "data")
    batch_others = math.prod(sizes[axis] for axis in BATCH_AXES if axis in sizes and axis != "data")
    counts = range(fault.min_processes, processes)
    plans = {}
    for count in counts:
        problem, overrides = _layout(cfg, count, processes, devices, others, batch_others)
        if problem:
            raise UsageError(
                f"fault.elastic=true: the job cannot go on with {count} processes ({count * devices} devices), "
                f"where the data axis is the one that shrinks: {problem}. Fix: {_fix(cfg, counts, devices, others)}"
            )
        plans[count] = overrides
        _check_replicas(cfg, count, processes, count * devices // others)
    return plans


def _check_replicas(cfg, count: int, processes: int, data: int) -> None:
    """train.sync=diloco: UsageError when a job of `count` processes (mesh.data = `data`) would hold
    fewer than 2 replicas (its replica axis shrinks with the data axis: diloco_shrink.py)."""
    if cfg.train.sync != "diloco":
        return
    axis = cfg.diloco.replica_axis
    replicas = cfg.mesh.dcn_data * count // processes if axis == "dcn_data" else data
    if replicas < 2:
        raise UsageError(
            f"fault.elastic=true with train.sync=diloco: a job of {count} processes would hold {replicas} "
            f"replica(s) (diloco.replica_axis={axis}), and DiLoCo needs 2 or more; raise fault.min_processes "
            f"above {count}"
        )


def _layout(cfg, count: int, processes: int, devices: int, others: int, batch_others: int):
    """(what stops a job of `count` processes, "" if nothing; its mesh overrides)."""
    total = count * devices
    if total % others:
        return f"the mesh's other axes use {others} devices, which do not divide {total}", []
    data = total // others
    overrides = [f"mesh.data={data}"] if cfg.mesh.data != -1 else []
    dcn = cfg.mesh.dcn_data
    if dcn > 1:
        if (dcn * count) % processes or data % (dcn * count // processes):
            return f"mesh.dcn_data={dcn} over {processes} processes has no counterpart over {count}", []
        overrides.append(f"mesh.dcn_data={dcn * count // processes}")
    shards = data * batch_others
    train = cfg.train
    batches = {
        "train.global_batch_size": train.global_batch_size,
        "the microbatch train.global_batch_size / train.grad_accum_steps": train.global_batch_size
        // train.grad_accum_steps,
        "eval.batch_size": cfg.eval.batch_size or train.global_batch_size,
    }
    for name, value in batches.items():
        if value % shards:
            return f"{name} = {value} is not divisible by its {shards} batch shards", []
    return "", overrides


def _fix(cfg, counts: range, devices: int, others: int) -> str:
    """What makes every smaller job possible (or a higher fault.min_processes)."""
    if any((count * devices) % others for count in counts):
        return (
            f"keep the non-data mesh axes within one process (a product dividing --devices-per-process={devices}), "
            f"or raise fault.min_processes"
        )
    batch_others = math.prod(getattr(cfg.mesh, a) for a in BATCH_AXES if a in CONFIG_AXES and a != "data")
    shards = [count * devices // others * batch_others for count in [*counts, counts.stop]]
    multiple = math.lcm(*shards) * cfg.train.grad_accum_steps
    return (
        f"make train.global_batch_size (and eval.batch_size) a multiple of {multiple}, which every job from "
        f"fault.min_processes={counts.start} to {counts.stop} processes divides into its batch shards, or raise "
        f"fault.min_processes"
    )


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
    """(process, hang file) of the watchdogs' hang files `files` (not an evaluator's), the likeliest
    culprit first: the process whose loop is behind (its peers went on into the next step and wait
    for it in that step's collectives), then the earliest written."""
    found = [(key, path) for path in files if (key := hang_key(path)) is not None]
    return [(key[2], path) for key, path in sorted(found)]


def hang_key(path: Path) -> Optional[tuple[float, float, int]]:
    """(the step the hung process's loop last began (inf: none), when the file was written, the
    process) of a watchdog's hang file; None for an evaluator's or an unreadable one."""
    try:
        headline = path.read_text(errors="replace").split("\n", 1)[0]
        written = path.stat().st_mtime
    except OSError:
        return None
    process = re.search(r"; process (\d+), pid \d+", headline)
    step = re.search(rf"; {REACHED} (\d+)", headline)
    if process is None or path.name.startswith("hang-evaluator"):
        return None
    return (int(step.group(1)) if step else math.inf), written, int(process.group(1))


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


def run_elastic_job(args: list[str], cfg, processes: int, devices: int) -> int:
    """The local job under fault.elastic: started again on the processes left after each failure;
    its exit code (1 with one message naming every failure when it cannot go on)."""
    from engine.runtime.launcher import run_local_job
    from engine.runtime.restart import Precompiles, check_precompile, drop_local_tier

    plans = shrink_plan(cfg, processes, devices)
    check_precompile(cfg)
    withdraw(Path(cfg.workdir))  # (a request of an earlier job; UsageError when it is not a file)
    note_growth(cfg)
    precompiles = Precompiles(args, plans, devices, cfg)
    workdir, fault = Path(cfg.workdir), cfg.fault
    failures: list[dict] = []
    alive, attempt, full_since, grew = processes, 0, 0, None
    job, stopped = {"started": time.time(), "recovery": 0.0}, None  # (the summary covers the whole job)
    while True:
        hangs = set(workdir.glob("hang-*.txt"))
        seen: list[tuple[int, int, float]] = []
        gap = time.time() - stopped if stopped else 0.0  # (this start's own: its process 0 measures it too)
        env = {ATTEMPT: str(attempt), FAILURES: json.dumps(failures), JOB: json.dumps(job)}
        env.update(start_env(alive, processes, grew, cfg))
        withdraw(workdir)
        if alive < processes and fault.grow_back:  # a local process that died can run again at once
            request(workdir, processes, "the lost processes can run again on this machine")
        precompiles.start(alive)
        code = run_local_job([*args, *plans.get(alive, [])], alive, devices, env, seen, grace=0, settle=SETTLE_SECONDS)
        precompiles.stop()
        attempt, grew = attempt + 1, None
        job["recovery"] += gap
        stopped = min((when for _, _, when in seen), default=time.time())
        if code == GROW_EXIT:
            grew, alive, full_since = grew_from(alive, processes), processes, attempt
            sys.stderr.write(f"elastic: growing back to {processes} processes, from the checkpoint just saved\n")
            continue
        ended, alive = after_failure(code, seen, hangs, failures, alive, attempt - 1, cfg, full_since)
        if ended is not None:
            withdraw(workdir)
            return ended
        drop_local_tier(cfg, attempt - 1)  # (tests only)
        sys.stderr.write(
            f"elastic: restarting the job on {alive} processes (restart {restarts(failures, full_since)} of at "
            f"most fault.max_restarts={fault.max_restarts} since the job last ran at its full size), from the "
            "newest checkpoint\n"
        )


def after_failure(
    code: int, seen: list, hangs: set, failures: list[dict], alive: int, attempt: int, cfg, full_since: int = 0
):
    """(the job's exit code when it ends with this start, else None; the processes left) after a
    start of the job (local or SLURM) that ended with `code` and the failures `seen`; `hangs`: the
    workdir's hang files before the start; `full_since`: the start at which the job last ran at its
    full size (fault.max_restarts counts the restarts since)."""
    workdir = Path(cfg.workdir)
    if code != 1 or not seen or all(c == 2 for _, c, _ in seen):  # done, preempted, or a usage error
        return code, alive
    step, new_hangs = step_reached(workdir), sorted(set(workdir.glob("hang-*.txt")) - hangs)
    gone = note_failures(failures, seen, alive, new_hangs, attempt, step)
    if not gone:  # (the lost processes before it, when no job recovered from them, are recorded)
        return (give_up(workdir, failures, "it failed on its own") if pending(workdir, failures) else 1), alive
    alive -= gone
    limit = restart_limit(cfg.fault, restarts(failures, full_since) - 1, alive)
    return (give_up(workdir, failures, limit) if limit else None), alive


def note_failures(failures: list[dict], seen: list, alive: int, hangs: list[Path], attempt: int, step) -> int:
    """Adds the processes lost among the failures `seen` (of a job of `alive`; `hangs`: the hang
    files that appeared) to `failures`; how many were lost (0, with a message saying why, when the
    failure is the job's own and it is not restarted)."""
    hung: dict[int, Path] = {}
    for index, path in hung_processes(hangs):  # the likeliest first (dicts keep order)
        hung.setdefault(index, path)
    gone, why = lost(seen, alive, list(hung))
    if why:
        sys.stderr.write(
            f"error: the job failed at step {step or 0}: {why} (fault.elastic restarts a job after a lost process)\n"
        )
    for index, rc, when in gone:
        how = describe(rc)
        if index in hung:
            how = f"hung ({how} by its watchdog: {hung[index].name})"
        failures.append(dict(attempt=attempt, process=index, how=how, step=step, time=when, processes=alive))
        failures[-1]["seconds_to_stop"] = round(time.time() - when, 3)  # the survivors stopped
    return len(gone)


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


def give_up(workdir: Path, failures: list[dict], limit: str) -> int:
    """Records the failures no job recovered from, says every failure, and returns 1."""
    for failure in pending(workdir, failures) if workdir.is_dir() else []:
        record = failure_record(failure, step_restored=None, tier=None, seconds_lost=None, processes_now=0)
        record = {"step": failure["step"] or 0, "split": RECOVERY, **record, "recovered": False}
        append_line(workdir / METRICS, json.dumps(record) + "\n")
    named = "; ".join(
        f"process {f['process']} of {f['processes']} {f['how']} at step {f['step'] or 0} (start {f['attempt']})"
        for f in failures
    )
    sys.stderr.write(
        f"error: the job cannot go on ({limit}); failures: {named}. The newest checkpoint is intact: "
        "running the same command again resumes from it\n"
    )
    return 1
