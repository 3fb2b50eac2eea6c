"""fault.elastic on the local launcher (--local-processes N): the supervisor loop over local processes.

Each start is the local launcher's job (engine/runtime/launcher.py) with a fresh coordinator port;
after a failure the survivors are SIGKILLed at once (grace 0: accounting.py says why) once those
that failed without a signal had SETTLE_SECONDS to be joined by the others. A process that died
can run again on the same machine at once, so a shrunk job is asked to grow back at its first
persistent checkpoint. The loop itself: supervisor.py. Imports no jax.
"""

from __future__ import annotations

from pathlib import Path

from engine.elastic.accounting import SETTLE_SECONDS
from engine.elastic.grow import request
from engine.elastic.precompile import DryRun, local_dry_run
from engine.elastic.supervisor import supervise


class LocalProcesses:
    """The job's processes on this machine (a Membership)."""

    unit, how = "processes", ""

    def __init__(self, devices: int):
        self.devices = devices

    def start(self, args: list[str], processes: int, env: dict[str, str], seen: list) -> int:
        from engine.runtime.launcher import run_local_job

        return run_local_job(args, processes, self.devices, env, seen, grace=0, settle=SETTLE_SECONDS)

    def precompile(self, args: list[str], processes: int, devices: int, log: Path) -> DryRun:
        return local_dry_run(args, processes, devices, log)

    def when_back(self, workdir: Path, full: int) -> None:
        request(workdir, full, "the lost processes can run again on this machine")  # (at once: nothing to stop)

    def after_failure(self) -> str:
        return ""

    def after_growth(self) -> None:
        return None


def run_elastic_job(args: list[str], cfg, processes: int, devices: int) -> int:
    """The local job under fault.elastic; its exit code."""
    return supervise(LocalProcesses(devices), args, cfg, processes, devices)
