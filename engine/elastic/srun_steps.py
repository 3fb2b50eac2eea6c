"""`launch.py train --elastic` in a SLURM allocation: the job's driver, restarting it as srun steps on the tasks left.

Run in an sbatch script or under salloc (not itself under srun), the driver starts the training
as one step of all the allocation's tasks (`srun -n N`; every task finds the job through SLURM's
environment, engine/runtime/distributed.py). When a task dies, srun says which task ended how
("task 1: Killed"); the driver reads that from srun's stderr (which it relays), stops the others
(scancel --signal=KILL at once, as the local launcher does; srun's --kill-on-bad-exit would
give them SIGTERM and SLURM's KillWait, often 30 s), and starts a new step of the tasks left, excluding the allocation's
nodes SLURM reports down or drained (`sinfo`), in the one supervisor loop
(engine/elastic/supervisor.py: the shrink plan checked at start, the accounting, `split: "recovery"`
records, the give-up message and exit 1 after fault.max_restarts or below fault.min_processes,
growing back once sinfo says the nodes are up). Requires fault.elastic=true. Imports no jax.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from engine.elastic.accounting import ATTEMPT, SETTLE_SECONDS
from engine.elastic.grow import GROW_EXIT, WhenBack
from engine.elastic.supervisor import supervise
from engine.errors import UsageError
from engine.runtime.launcher import SELF, free_port
from engine.runtime.settings import cpu_devices_in

# srun's line for a task that ended badly: "srun: error: node1: task 1: Killed",
# "srun: error: node1: tasks 2-3: Exited with exit code 1"
TASK_LINE = re.compile(r"\btasks? ([\d,\-]+): (.+?)\s*$")
EXIT = re.compile(r"Exited with exit code (\d+)")
STEP_NAME = "engine-elastic-{}"  # the name of the step of each start (ENGINE_ELASTIC_ATTEMPT)
PRECOMPILE_NAME = "engine-precompile-{}"  # the step of a smaller job's dry run (fault.precompile), by its tasks
# srun (or the step daemon) stopping the step's other tasks after a failure
STOPPING = re.compile(r"Terminating StepId|STEP \S+ ON \S+ CANCELLED|Force Terminated")
# how srun names a task killed by a signal (strsignal's words: "Killed", "Segmentation fault", ...)
SIGNAL_NAMES = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}
# sinfo's states of a node that is gone (not "draining": it still runs the allocation's steps;
# nor a bare "*", not responding for now, which SLURM turns into "down" after SlurmdTimeout)
DOWN = ("down", "drained", "fail", "failing")


def check_driver(cfg, env: Optional[Mapping[str, str]] = None) -> int:
    """The allocation's task count, after checking that this process may drive an elastic SLURM
    job (UsageError naming the fix otherwise)."""
    environ = os.environ if env is None else env
    if not cfg.fault.elastic:
        raise UsageError(
            "--elastic drives a SLURM job that restarts itself on the tasks left, which needs fault.elastic=true; "
            "add fault.elastic=true (with fault.min_processes and fault.max_restarts), or drop --elastic"
        )
    if not environ.get("SLURM_JOB_ID"):
        raise UsageError(
            "--elastic runs inside a SLURM allocation (an sbatch script, or salloc -n N python launch.py train "
            "--elastic ...); with --local-processes N, fault.elastic=true alone restarts the job"
        )
    if environ.get("SLURM_STEP_ID"):
        raise UsageError(
            "--elastic is the job's driver and starts the srun steps itself: run it in the sbatch script or under "
            "salloc, not under srun (or drop --elastic to run as one task of a plain srun step)"
        )
    tasks = int(environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS") or 1)
    if tasks < 2:
        raise UsageError(
            f"--elastic: the allocation has {tasks} task; ask for several (salloc -n 2, or #SBATCH --ntasks=N)"
        )
    return tasks


def task_devices(given: Optional[int], env: Optional[Mapping[str, str]] = None) -> int:
    """Each task's devices, for the shrink plan: --devices-per-process when given, else
    SLURM_GPUS_PER_TASK, else XLA_FLAGS' --xla_force_host_platform_device_count (CPU), else 1."""
    environ = os.environ if env is None else env
    if given:
        return given
    gpus = environ.get("SLURM_GPUS_PER_TASK", "").rsplit(":", 1)[-1]
    if gpus.isdigit():
        return int(gpus)
    return cpu_devices_in(environ.get("XLA_FLAGS", "")) or 1


class SrunSteps:
    """The job's tasks as srun steps of the allocation (a Membership)."""

    unit, how = "tasks", " as a new srun step"

    def __init__(self) -> None:
        self.exclude: list[str] = down_nodes() or []

    def start(self, args: list[str], processes: int, env: dict[str, str], seen: list) -> int:
        return run_step(args, processes, self.exclude, env, seen)

    def precompile(self, args: list[str], processes: int, devices: int, log: Path) -> "SrunDryRun":
        return SrunDryRun(args, processes, self.exclude, log)

    def when_back(self, workdir: Path, full: int) -> WhenBack:
        return WhenBack(workdir, full, nodes_up)

    def after_failure(self) -> str:
        self.exclude = down_nodes() or []  # (none excluded when sinfo cannot say)
        return f", excluding the nodes SLURM reports down: {','.join(self.exclude)}" if self.exclude else ""

    def after_growth(self) -> None:
        self.exclude = []


class SrunDryRun:
    """A smaller job's dry run as an `srun --overlap` step of the allocation's tasks (fault.precompile):
    on the nodes the restart will run on, sharing their CPUs with the step training, with a
    coordinator port of its own (JAX_COORDINATOR_PORT; JAX's default for SLURM is one port per
    job, which the training step holds)."""

    def __init__(self, args: list[str], tasks: int, exclude: list[str], log: Path):
        self.name = PRECOMPILE_NAME.format(tasks)
        step = srun_command(args, tasks, exclude, self.name)
        at = step.index(SELF[0])  # (srun's own flags before it; nice 19 as the local precompiles)
        command = [step[0], "--overlap", *step[1:at], "nice", "-n", "19", *step[at:]]
        env = dict(os.environ, JAX_COORDINATOR_PORT=str(free_port()))
        self.log = log
        with open(log, "w") as out:
            self.step = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, text=True
            )

    def wait(self) -> list[int]:
        return [self.step.wait()]

    def kill(self) -> None:
        if self.step.poll() is None:
            _signal_step(_step_id(self.name), "KILL")  # (SIGKILL to srun alone leaves its tasks to SLURM)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.step.pid, signal.SIGKILL)
        self.step.wait()


def run_slurm_job(args: list[str], cfg, tasks: int, devices: int) -> int:
    """The elastic job as srun steps (the supervisor loop, supervisor.py); its exit code."""
    return supervise(SrunSteps(), args, cfg, tasks, devices)


def srun_command(args: list[str], tasks: int, exclude: list[str], name: str) -> list[str]:
    """The srun line of one step of the job (named `name`). Not --kill-on-bad-exit: the driver stops
    the step itself (`_wait`), as SLURM's stop of such a step cannot be hurried past its KillWait."""
    flags = ["-n", str(tasks), f"--job-name={name}", "--label"]
    if exclude:
        flags.append(f"--exclude={','.join(exclude)}")
    return ["srun", *flags, *SELF, *args]


def run_step(
    args: list[str], tasks: int, exclude: list[str], extra: dict[str, str], seen: list[tuple[int, int, float]]
) -> int:
    """Runs one srun step of `launch.py args` (with `extra` in its environment); returns the job's exit
    code (0, 1 after a failure, 2 when every failed task says usage error, 128+n when this driver
    got signal n). `seen` receives (task, return code, time) of the tasks srun says failed."""
    name = STEP_NAME.format(extra.get(ATTEMPT, 0))
    step = subprocess.Popen(
        srun_command(args, tasks, exclude, name), env=dict(os.environ, **extra), stderr=subprocess.PIPE, text=True
    )
    output = StepOutput()
    relay = threading.Thread(target=output.relay, args=(step.stderr,), daemon=True)
    relay.start()
    preempted: list[int] = []

    def forward(signum, frame):  # a preemption (scancel, Ctrl-C) of the driver: the tasks save and stop
        preempted.append(signum)
        step.send_signal(signal.SIGTERM)  # srun passes it on to every task

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _wait(step, output, name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=10)  # srun's last lines name the failed tasks
    causes = output.causes()
    seen.extend(cause for cause in causes if cause[1] != GROW_EXIT)  # (a task that left to grow back did not fail)
    if preempted:
        return 128 + int(preempted[0])
    if code == GROW_EXIT and not seen:  # every task left to grow back
        return code
    if code == 0 or not seen:
        return code
    return 2 if all(c == 2 for _, c, _ in seen) else 1


def _wait(step: subprocess.Popen, output: "StepOutput", name: str) -> int:
    """srun's exit code. Once a task has failed, the others are SIGKILLed at once (as on the local
    launcher, engine/elastic/accounting.py: with a peer gone their SIGTERM save cannot complete):
    scancel's signal to the step, found by its name. When no task was killed by a signal, the others
    first get SETTLE_SECONDS to end on their own (accounting.py's `lost`: a failure every task meets)."""
    killed = False
    while True:
        try:
            return step.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if output.failed() and not killed and output.settled():
                output.stopping = True  # the failures srun reports from here on are the stop's consequence
                killed = _signal_step(_step_id(name), "KILL")


def _step_id(name: str) -> str:
    """The id (job.step) of this job's running step named `name` ("" when squeue does not list it)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    listing = subprocess.run(
        ["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True, timeout=30
    )
    ids = [line.split()[0] for line in listing.stdout.splitlines() if line.split()[1:] == [name]]
    return ids[0] if ids else ""


def _signal_step(step_id: str, sig: str) -> bool:
    """Sends SIG to the step's tasks (True when scancel took it, or there is no step to signal)."""
    if not step_id:
        return True  # the step has ended (or cannot be found): nothing to signal
    return subprocess.run(["scancel", f"--signal={sig}", step_id], capture_output=True, timeout=30).returncode == 0


class StepOutput:
    """What srun's stderr says of a step: the tasks that ended badly (task, return code, time, whether
    the step was being stopped by then)."""

    def __init__(self) -> None:
        self.reported: list[tuple[int, int, float, bool]] = []
        self.stopping = False

    def relay(self, stream) -> None:
        """Copies srun's stderr to ours, noting what it says."""
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            self.reported.extend((task, code, time.time(), self.stopping) for task, code in parse_task_line(line))
            self.stopping = self.stopping or bool(STOPPING.search(line))

    def failed(self) -> bool:
        """Whether srun reported a task that failed (not one that left to grow back)."""
        return any(code != GROW_EXIT for _, code, _, _ in self.reported)

    def settled(self) -> bool:
        """Whether the step's other tasks may be stopped now: a task was killed by a signal, or
        SETTLE_SECONDS passed since the first failure srun reported."""
        reported = [report for report in self.reported if report[1] != GROW_EXIT]
        signalled = any(code < 0 for _, code, _, _ in reported)
        return signalled or time.time() - reported[0][2] >= SETTLE_SECONDS

    def causes(self) -> list[tuple[int, int, float]]:
        """The tasks that failed before srun stopped the step (the others' ends are its consequence)."""
        causes = [(task, rc, when) for task, rc, when, stopping in self.reported if not stopping]
        return causes or [(task, rc, when) for task, rc, when, _ in self.reported]


def parse_task_line(line: str) -> list[tuple[int, int]]:
    """(task, return code: -n for signal n) of the tasks one srun line says ended badly."""
    found = TASK_LINE.search(line) if "srun" in line else None
    if not found:
        return []
    how = found.group(2)
    exited = EXIT.search(how)
    if exited:
        code = int(exited.group(1))
    elif how in SIGNAL_NAMES:
        code = -int(SIGNAL_NAMES[how])
    else:
        return []
    tasks: list[int] = []
    for part in found.group(1).split(","):
        first, _, last = part.partition("-")
        tasks += range(int(first), int(last or first) + 1)
    return [(task, code) for task in tasks]


def nodes_up() -> bool:
    """Whether every node of the allocation is up (not when sinfo cannot say): the job may grow back."""
    return down_nodes() == []


def down_nodes(env: Optional[Mapping[str, str]] = None) -> Optional[list[str]]:
    """The allocation's nodes SLURM reports down, drained or not responding (from sinfo); None when
    sinfo cannot say."""
    environ = os.environ if env is None else env
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodes:
        return []
    try:
        listing = subprocess.run(
            ["sinfo", "-h", "-N", "-n", nodes, "-o", "%N %T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        sys.stderr.write(f"warning: elastic: sinfo did not say which nodes are down ({e})\n")
        return None
    down = set()
    for line in listing.stdout.splitlines():
        name, _, state = line.partition(" ")
        if any(part in DOWN for part in state.lower().rstrip("*~#!%$@^-").split("+")):
            down.add(name)
    return sorted(down)
