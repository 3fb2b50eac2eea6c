"""The elastic job's one supervisor loop, over a membership (local processes, SLURM steps).

fault.elastic: when a process of the job fails (a nonzero exit, a signal, or the watchdog's exit
on a hang) the others are stopped, and the job is started again on the processes left (each start
with a fresh coordinator), resuming from the newest checkpoint of either tier, until it succeeds,
fewer than fault.min_processes would remain or fault.max_restarts restarts are used. The loop
here is every launcher's: the shrink plan checked before the first start (shrink.py), the
background precompiles of the smaller sizes (precompile.py, fault.precompile), the hang
attribution and the accounting (accounting.py), the failures so far written to the workdir for
the restarted job's records, and growing back to the full size at a persistent checkpoint once
the lost places are there again (grow.py).

What differs between launchers is a `Membership`: how one start of the job runs to its end and
says which processes failed (`start`), what it calls its processes, where the next start may run
(`after_failure`: SLURM excludes the nodes reported down), and when the lost places are back
(`when_back`: a local process can run again at once; a SLURM node once sinfo says it is up).
Kubernetes pods have no process that sees every worker: each pod's supervisor (pods.py) meets the
others through a rendezvous (rendezvous.py) and its round leader runs the same accounting. A new
launcher is one module with a Membership. Imports no jax.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional, Protocol

from engine.elastic.accounting import ATTEMPT, JOB, after_failure, restarts, write_failures
from engine.elastic.grow import GROW_EXIT, grew_from, note_growth, start_env, withdraw
from engine.elastic.precompile import DryRun, Precompiles, check_precompile
from engine.elastic.shrink import shrink_plan


class Stoppable(Protocol):
    def stop(self) -> None: ...


class Membership(Protocol):
    """Where the job's processes run, for the supervisor loop."""

    unit: str  # what its processes are called in messages ("processes", "tasks")
    how: str  # how a start runs, in messages ("" or " as a new srun step")

    def start(self, args: list[str], processes: int, env: dict[str, str], seen: list) -> int:
        """Runs one start of the job (`launch.py args` on `processes` processes, `env` added) to
        its end; its exit code (0, 1 after a failure, 2 for a usage error every process met,
        GROW_EXIT when every process left to grow back, 128+n when the supervisor got signal n).
        `seen` receives (process, return code, time) of the processes that failed."""
        ...

    def precompile(self, args: list[str], processes: int, devices: int, log: Path) -> Optional[DryRun]:
        """fault.precompile: starts the dry run `launch.py args` of a job of `processes` beside the
        one training, its output to the file `log` (precompile.py)."""
        ...

    def when_back(self, workdir: Path, full: int) -> Optional[Stoppable]:
        """While a smaller start runs: asks it to grow back once the lost places are there again."""
        ...

    def after_failure(self) -> str:
        """Before a restart after a failure: what the message says of where it runs ("" or ", ...")."""
        ...

    def after_growth(self) -> None:
        """Before the start grown back to the full size."""
        ...


def supervise(membership: Membership, args: list[str], cfg, full: int, devices: int) -> int:
    """The elastic job on `membership`: started again on the processes left after each failure;
    its exit code (1 with one message naming every failure when it cannot go on)."""
    plans = shrink_plan(cfg, full, devices)
    check_precompile(cfg)
    workdir, fault = Path(cfg.workdir), cfg.fault
    withdraw(workdir)  # (a request of an earlier job; UsageError when it is not a file)
    note_growth(cfg)
    precompiles = Precompiles(args, plans, devices, cfg, membership.precompile)
    failures: list[dict] = []
    alive, attempt, full_since, grew = full, 0, 0, None
    job, stopped = {"started": time.time(), "recovery": 0.0}, None  # (the summary covers the whole job)
    while True:
        hangs = set(workdir.glob("hang-*.txt"))
        seen: list[tuple[int, int, float]] = []
        gap = time.time() - stopped if stopped else 0.0  # (this start's own: its process 0 measures it too)
        env = {ATTEMPT: str(attempt), JOB: json.dumps(job), **start_env(alive, full, grew, cfg)}
        write_failures(workdir, failures)
        withdraw(workdir)
        back = membership.when_back(workdir, full) if alive < full and fault.grow_back else None
        precompiles.start(alive)
        code = membership.start([*args, *plans.get(alive, [])], alive, env, seen)
        precompiles.stop()
        if back is not None:
            back.stop()
        attempt, grew = attempt + 1, None
        job["recovery"] += gap
        stopped = min((when for _, _, when in seen), default=time.time())
        if code == GROW_EXIT:
            grew, alive, full_since = grew_from(alive, full), full, attempt
            membership.after_growth()
            sys.stderr.write(
                f"elastic: growing back to {full} {membership.unit}{membership.how}, from the checkpoint just saved\n"
            )
            continue
        ended, alive = after_failure(code, seen, hangs, failures, alive, attempt - 1, cfg, full_since)
        if ended is not None:
            withdraw(workdir)
            return ended
        where = membership.after_failure()
        count = restarts(failures, full_since)
        sys.stderr.write(
            f"elastic: restarting the job on {alive} processes{membership.how} (restart {count} of at most "
            f"fault.max_restarts={fault.max_restarts} since the job last ran at its full size{where}), from the "
            "newest checkpoint\n"
        )
