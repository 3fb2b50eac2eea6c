"""Faults injected from outside the trainer: a thread that watches a job's metrics.jsonl and, once
a train step is logged, sends a signal (SIGKILL: a lost process; SIGSTOP: a frozen one; HANG: a
main thread hung while the process's other threads go on, in a job started with INJECT) to one of
the job's training processes, found by its command line (the workdir, distributed.process_id=K;
under srun, SLURM_PROCID=K) and its environment (ENGINE_ELASTIC_ATTEMPT: which start of an
elastic job); `drop_local_tier` removes what a lost host's local storage held. Nothing in the
engine knows of it: the trainer runs its production step."""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Optional

ATTEMPT = "ENGINE_ELASTIC_ATTEMPT"
HANG = signal.SIGUSR2  # a hung main thread in a process started with INJECT in its environment
INJECT = {"PYTHONPATH": str(Path(__file__).resolve().parent / "inject")}  # (inject/sitecustomize.py)


def _read(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except OSError:  # (the process ended meanwhile)
        return None


def training_process(workdir: Path, process: int, attempt: int = 0) -> Optional[int]:
    """The pid of process `process` of start `attempt` of the job training in `workdir` (not a
    precompile's dry run, not a supervisor), or None while there is none."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        cmdline = _read(entry / "cmdline")
        environ = _read(entry / "environ")
        if not cmdline or environ is None:
            continue
        args = cmdline.decode(errors="replace").split("\0")
        if str(workdir) not in args or "--dry-run" in args or args[0].endswith("srun"):
            continue
        variables = dict(item.split("=", 1) for item in environ.decode(errors="replace").split("\0") if "=" in item)
        index = f"distributed.process_id={process}" in args or (
            "SLURM_STEP_ID" in variables and variables.get("SLURM_PROCID") == str(process)
        )
        if index and int(variables.get(ATTEMPT, "0") or 0) == attempt:
            return int(entry.name)
    return None


def _steps_after(metrics: Path, offset: int) -> list[int]:
    """The train steps metrics.jsonl logged past byte `offset`."""
    try:
        with open(metrics, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # (a line being written)
            continue
        if isinstance(record, dict) and record.get("split") == "train":
            steps.append(record["step"])
    return steps


class FaultAt(threading.Thread):
    """Sends `sig` to process `process` of start `attempt` of the job in `workdir` once that start
    logged train step `step` or later (records written before the process appeared do not count)
    and `ready()` holds, when given (e.g. a checkpoint committed). `done` is set when it sent the
    signal (`pid`: to whom)."""

    def __init__(
        self,
        workdir: Path,
        process: int,
        step: int,
        sig: int = signal.SIGKILL,
        attempt: int = 0,
        timeout: float = 600,
        then=None,
        ready=None,
    ):
        super().__init__(name=f"fault-{process}-{step}", daemon=True)
        self.workdir, self.process, self.step, self.sig = Path(workdir), process, step, sig
        self.attempt, self.timeout, self.then, self.ready = attempt, timeout, then, ready
        self.done, self.stopped = threading.Event(), threading.Event()
        self.pid: Optional[int] = None
        self.start()

    def run(self) -> None:
        metrics = self.workdir / "metrics.jsonl"
        deadline = time.time() + self.timeout
        while self.pid is None:  # the process first: the steps it logs are after this offset
            if self.stopped.is_set() or time.time() > deadline:
                return
            offset = metrics.stat().st_size if metrics.exists() else 0
            self.pid = training_process(self.workdir, self.process, self.attempt)
            self.stopped.wait(0.05)
        while not any(step >= self.step for step in _steps_after(metrics, offset)) or not (
            self.ready is None or self.ready()
        ):
            if self.stopped.wait(0.02) or time.time() > deadline:
                return
        os.kill(self.pid, self.sig)
        if self.then is not None:  # (what else the fault takes: a lost host's local tier)
            self.then()
        self.done.set()

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def drop_local_tier(local_dir: Path, process: int, which: str = "own") -> list[Path]:
    """Removes what process `process`'s host held of the local checkpoint tier under `local_dir`:
    `own` its process_<k> folder (the restore takes its shards from a peer's copy), `all` every
    copy of its shards too (the restore takes the persistent tier). The folders removed."""
    doomed = []
    for run in Path(local_dir).glob("*-*"):
        mine = run / f"process_{process}"
        doomed.append(mine)
        if which == "all":
            doomed += sorted(f for f in run.glob(f"process_*/owner_{process}") if f.parent != mine)
    for folder in doomed:
        shutil.rmtree(folder, ignore_errors=True)
    return doomed
