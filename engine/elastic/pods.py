"""`launch.py train --rendezvous etcd://HOST:PORT/PREFIX|DIR`: one pod's supervisor of an elastic job on Kubernetes.

On Kubernetes no one process sees every worker: each pod runs this supervisor, which trains
nothing itself. The supervisors meet through a rendezvous (engine/elastic/rendezvous.py:
heartbeats, rounds formed by the lowest live member) whose state etcd or a directory every pod
mounts holds (stores.py). For each round a supervisor is in, it starts
the training as one process (rank = its place among the round's members; the coordinator the
round names, on the leader's pod; the shrink plan's mesh overrides for the round's size, as the
local launcher does: engine/elastic/shrink.py), with ENGINE_ELASTIC_ATTEMPT = the round (rank 0's
supervisor writes the round's failures to the workdir, accounting.write_failures). While it runs,
the supervisor watches its round's other members:
one whose heartbeat stops (its pod died), or whose process was killed by a signal, has its
process SIGKILLed at once (with a peer gone its SIGTERM save cannot complete); one whose process
failed on its own gets SETTLE_SECONDS first (accounting.py's `lost`: a failure every process meets is
the job's). Then it joins the next round.

The next round's leader does the accounting, the local supervisor's (accounting.account, with the
hang attribution from each member's report): a member of round r missing from round r+1 (its pod
stopped heartbeating) is a lost process, or the processes that failed on their own (`lost`); the
failures so far travel in the round. When fault.max_restarts or fault.min_processes stops the job
(accounting.limit_message), or every
process failed on its own, the round file says so and every supervisor exits 1 with the same
message. The child's exit 0 (done) and 2 (a usage error) end the job; 143/130 (a preemption)
end this pod's supervisor with it. Grow back (engine/elastic/grow.py): while a round smaller
than --processes runs and a live pod not in it is ready for the next, rank 0's supervisor asks the
job to stop at its next persistent checkpoint; everyone then forms a larger round.
fault.precompile (engine/elastic/precompile.py): the round's leader names a coordinator for each
smaller size's dry run; the pods of its first ranks each run their process of it, in the background
once the round's job has logged (the workdir is shared, as the checkpoints need). Imports no jax.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from engine.elastic.accounting import (
    ATTEMPT,
    SETTLE_SECONDS,
    account,
    describe,
    hang_key,
    limit_message,
    step_reached,
    write_failures,
)
from engine.elastic.grow import GROW_EXIT, note_growth, request, start_env, withdraw
from engine.elastic.precompile import Precompiles, check_precompile
from engine.elastic.rendezvous import MEMBER, POLL_SECONDS, Heartbeat, Rendezvous
from engine.elastic.shrink import shrink_plan
from engine.errors import UsageError
from engine.runtime.launcher import SELF, distributed_args, free_port, stop_with

ORDERLY = (0, 2, 130, 143, GROW_EXIT)  # a peer's process that ended so is not a failure: its round ends alike
STOPPED = "was lost (its pod stopped heartbeating)"


class Stopped(Exception):
    """SIGTERM or SIGINT while no process of this pod runs (nothing to save)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} while waiting for a round: nothing to save")
        self.code = 128 + signum


def check_pod(cfg, processes: Optional[int], member: str) -> None:
    """UsageError naming the fix when this pod cannot supervise an elastic job."""
    if not cfg.fault.elastic:
        raise UsageError(
            "--rendezvous supervises one pod of a job that restarts itself on the pods left, which needs "
            "fault.elastic=true; add fault.elastic=true (with fault.min_processes and fault.max_restarts), or drop "
            "--rendezvous"
        )
    if not processes or processes < 2:
        raise UsageError("--rendezvous needs --processes N: the job's full size (2 or more pods, one process each)")
    if not MEMBER.match(member):
        raise UsageError(
            f"--member {member!r}: a member id is letters, digits, '.', '_' and '-' (a pod name); pass --member"
        )


def run_pod_job(args: list[str], cfg, where: str, processes: int, devices: int, member: str, address: str) -> int:
    """This pod's part of the elastic job: its exit code (1 with one message naming every failure
    when the job cannot go on)."""
    plans = shrink_plan(cfg, processes, devices)
    note_growth(cfg)
    check_precompile(cfg)
    job = job_identity(cfg)
    rendezvous = Rendezvous(where, member, address, processes, fewest=cfg.fault.min_processes, job=job)
    heartbeat = Heartbeat(rendezvous.store.backend, member, address)
    heartbeat.start()
    supervisor = Supervisor(args, cfg, rendezvous, plans)
    previous = {sig: signal.signal(sig, supervisor.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return supervisor.run()
    except Stopped as e:
        sys.stderr.write(f"elastic: pod {member}: {e}\n")
        return e.code
    except ConnectionError as e:  # (the rendezvous's store is gone: this pod cannot take part any more)
        sys.stderr.write(f"error: elastic: pod {member}: {e}; its process was stopped\n")
        if supervisor.child is not None and supervisor.child.poll() is None:
            os.killpg(supervisor.child.pid, signal.SIGKILL)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        heartbeat.stop()


def job_identity(cfg) -> dict:
    """What ties the rendezvous directory's rounds to this job: its workdir and a digest of its
    config (a finished job's rounds in the directory would end a new job at once: issue 57)."""
    from engine.config.load import to_yaml

    digest = hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]
    return {"workdir": str(Path(cfg.workdir).absolute()), "config": digest}


class Supervisor:
    """The rounds of one pod: its process of each, watched."""

    def __init__(self, args: list[str], cfg, rendezvous: Rendezvous, plans: dict[int, list[str]]):
        self.args, self.cfg, self.rendezvous, self.plans = args, cfg, rendezvous, plans
        self.me, self.full, self.workdir = rendezvous.member, rendezvous.processes, Path(cfg.workdir)
        self.child: Optional[subprocess.Popen] = None
        self.preempted: list[int] = []

    def on_signal(self, signum, frame) -> None:
        """A preemption of this pod: its process saves with the others' (JAX's sync point) and stops."""
        self.preempted.append(signum)
        if self.child is None or self.child.poll() is not None:
            raise Stopped(signum)
        self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        n = self.rendezvous.latest() + 1
        while True:
            found = self.rendezvous.join(n, self.form)
            if found.get("end"):
                sys.stderr.write(found["end"])
                return int(found["code"])
            n = found["round"]
            code = self.train(found)
            if self.preempted:
                return code if code in (0, 130, 143) else 128 + self.preempted[0]
            if code in (0, 2):
                return code
            n += 1  # (130/143 without a signal here: another pod was preempted, all saved; go on without it)
            how = "to grow back" if code == GROW_EXIT else f"after its process {describe(code)}"
            sys.stderr.write(f"elastic: pod {self.me}: joining round {n} {how}\n")

    def train(self, found: dict) -> int:
        """Runs this pod's process of the round to its end; its exit code (-n: killed by signal n)."""
        n, members = found["round"], found["members"]
        rank, size = members.index(self.me), len(members)
        hangs = set(self.workdir.glob("hang-*.txt"))
        if rank == 0:
            withdraw(self.workdir)
            write_failures(self.workdir, found["failures"])  # (its process 0 records them: engine/runtime/recovery.py)
        command = [
            *SELF,
            *self.args,
            *self.plans.get(size, []),
            *distributed_args(found["coordinator"], size, rank),
        ]
        grow = start_env(size, self.full, found.get("grew"), self.cfg)
        extra = {ATTEMPT: str(n), "PYTHONUNBUFFERED": "1", **grow}
        sys.stderr.write(f"elastic: pod {self.me}: round {n}, process {rank} of {size} (members {members})\n")
        self.child = subprocess.Popen(
            command,
            env=dict(os.environ, **extra),
            start_new_session=True,
            preexec_fn=stop_with(os.getpid(), sig=signal.SIGKILL),
        )
        # fault.precompile: this pod's process of each smaller job's dry run (the first ranks' pods)
        precompiles = Precompiles(self.args, self.plans, 0, self.cfg, PodDryRun.launcher(found, rank))
        precompiles.start(size)
        try:
            killed = self.watch(n, members, rank, {m: self.rendezvous.incarnation(m) for m in members})
            code = self.child.wait()
        finally:
            precompiles.stop()
        keys = [hang_key(path) for path in sorted(set(self.workdir.glob("hang-*.txt")) - hangs)]
        mine = sorted(key[:2] for key in keys if key is not None and key[2] == rank)
        report = {"code": code, "killed": killed, "time": time.time(), "hung": bool(mine)}
        if mine and mine[0][0] != math.inf:  # the step its loop last began: the one behind is the culprit
            report["hung_step"] = int(mine[0][0])
        self.rendezvous.end(n, report)
        return code

    def watch(self, n: int, members: list[str], rank: int, started: dict[str, Optional[str]]) -> bool:
        """Until the process ends: SIGKILLs it when the round is broken; asks the job to grow back
        when a pod returned (rank 0). Whether it was killed. `started`: each member's supervisor's
        start (Heartbeat's incarnation) as the round began."""
        assert self.child is not None
        noticed: dict[str, float] = {}
        asked = not (rank == 0 and len(members) < self.full and self.cfg.fault.grow_back)
        while self.child.poll() is None:
            why = self.broken(n, members, noticed, started)
            if why:
                sys.stderr.write(f"elastic: pod {self.me}: {why}; stopping this pod's process\n")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.child.pid, signal.SIGKILL)
                return True
            if not asked:
                live = self.rendezvous.live()
                back = [m for m in self.rendezvous.ready_members(n + 1) if m in live and m not in members]
                if back:
                    request(self.workdir, self.full, f"a pod returned ({', '.join(back)})")
                    sys.stderr.write(f"elastic: pod {self.me}: {', '.join(back)} ready; asked the job to grow back\n")
                    asked = True
            time.sleep(POLL_SECONDS)
        return False

    def broken(self, n: int, members: list[str], noticed: dict[str, float], started: dict) -> str:
        """Why this pod's process must stop now ("" while the round holds): a member's pod stopped
        heartbeating or restarted (a container restarted in place keeps its name), or its process
        ended badly (after SETTLE_SECONDS when on its own)."""
        reports, live = self.rendezvous.reports(n), self.rendezvous.live()
        for rank, member in enumerate(members):
            report = reports.get(member)
            if member == self.me or (report and report.get("code") in ORDERLY):
                continue
            restarted = self.rendezvous.incarnation(member) not in (None, started.get(member))
            if report is None and (member not in live or restarted):
                return f"{member} (process {rank}) {STOPPED}"
            if report is None:
                continue
            if report["code"] < 0 or report.get("killed"):
                return f"the process of {member} (process {rank}) {describe(report['code'])}"
            first = noticed.setdefault(member, time.monotonic())
            if time.monotonic() - first >= SETTLE_SECONDS:
                return f"the process of {member} (process {rank}) {describe(report['code'])}"
        return ""

    def form(self, n: int, members: list[str], previous: Optional[dict]) -> dict:
        """The leader's round n: its coordinator (on this pod), the failures so far, what it grew
        from; or the job's end (`end`: the message, `code`) when it cannot go on."""
        content: dict[str, Any] = {
            "members": members,
            "coordinator": f"{self.rendezvous.address}:{free_port()}",
            "grew": None,
            # fault.precompile: each smaller size's dry run, its coordinator on this pod too (the first ranks' pods)
            "precompile": {str(k): f"{self.rendezvous.address}:{free_port()}" for k in self.plans if k < len(members)},
        }
        failures = list(previous["failures"]) if previous else []
        since = previous.get("full_since", 0) if previous else 0
        content.update(failures=failures, full_since=since)
        if previous is None:
            return content
        new, message, grew = self.accounting(previous, members, since)
        failures += new
        # (max_restarts counts from the last growth back: a job only grows at a persistent checkpoint,
        # so a pod that fails again and again, rejoining each round at full size, still ends the job)
        content.update(grew=grew, full_since=n if grew else since)
        return {**content, "end": message, "code": 1} if message else content

    def accounting(self, previous: dict, members: list[str], since: int) -> tuple[list[dict], str, Optional[dict]]:
        """(the processes of round `previous` lost, the message that ends the job ("" when it
        restarts), what the new round grew from): accounting.py's, as the local supervisor's."""
        r, before = previous["round"], previous["members"]
        failures = list(previous["failures"])
        reports = self.rendezvous.reports(r)
        when = min((report["time"] for report in reports.values()), default=time.time())
        gone = [(rank, member) for rank, member in enumerate(before) if member not in members]
        if gone:
            step = step_reached(self.workdir)
            new = [_failure(r, rank, _how_gone(reports.get(m)), step, when, len(before)) for rank, m in gone]
            return new, limit_message(self.workdir, failures + new, self.cfg.fault, since, len(members)), None
        seen, hangs = [], []
        for rank, member in enumerate(before):
            report = reports.get(member, {})
            if not report.get("killed") and report.get("code") not in (None, *ORDERLY):  # (not 143: a pod's preemption)
                seen.append((rank, report["code"], report["time"]))
            if report.get("hung"):
                hangs.append((report.get("hung_step", math.inf), rank))
        if not seen:
            grew = all(reports.get(m, {}).get("code") == GROW_EXIT for m in before) and len(members) > len(before)
            return [], "", {"time": when, "processes": len(before), "full": self.full} if grew else None
        hung = {rank: "" for _, rank in sorted(hangs)}  # (the process behind the others first: hung_processes)
        size, fault = len(before), self.cfg.fault
        _, message, _ = account(self.workdir, failures, seen, size, hung, r, fault, since, left=len(members))
        return failures[len(previous["failures"]) :], message, None


class PodDryRun:
    """This pod's process of a smaller job's dry run (fault.precompile): process `rank` of it, at
    the coordinator the round's leader named for its size, at nice 19."""

    def __init__(self, args: list[str], coordinator: str, processes: int, rank: int, log: Path):
        command = [*SELF, *args, *distributed_args(coordinator, processes, rank)]
        self.log = log.with_name(f"{log.stem}-process{rank}{log.suffix}")  # (each pod's own, in the shared workdir)
        with open(self.log, "w") as out:
            self.child = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=stop_with(os.getpid(), 19, sig=signal.SIGKILL),
            )

    @staticmethod
    def launcher(found: dict, rank: int):
        """precompile.Launch for the round `found`: the pods of the first ranks take part."""

        def launch(args: list[str], processes: int, devices: int, log: Path) -> Optional[PodDryRun]:
            coordinator = found.get("precompile", {}).get(str(processes))
            return PodDryRun(args, coordinator, processes, rank, log) if coordinator and rank < processes else None

        return launch

    def wait(self) -> list[int]:
        return [self.child.wait()]

    def kill(self) -> None:
        if self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGKILL)
        self.child.wait()


def _failure(attempt: int, process: int, how: str, step, when: float, processes: int) -> dict:
    """A failure, as accounting.account records one."""
    return dict(attempt=attempt, process=process, how=how, step=step, time=when, processes=processes)


def _how_gone(report: Optional[dict]) -> str:
    """How a member that left the job ended: what it last said of its process, and its pod's stop."""
    if report and not report.get("killed") and report.get("code") not in (None, 0):
        return f"{describe(report['code'])}, then {STOPPED}"
    return STOPPED
