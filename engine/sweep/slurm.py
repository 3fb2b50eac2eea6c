"""A sweep as one SLURM job array: an sbatch script with one array task per pending run, or
with `vectorize` per group of runs that share a compiled program; each task trains its run
or group by index (`launch.py sweep FILE --run-task I`)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from engine.errors import UsageError
from engine.runtime.launcher import SELF
from engine.runtime.rundir import STATUS, write_atomic, write_json
from engine.sweep.local import pending_runs, run_unit, units, write_index
from engine.sweep.spec import Sweep, check_slurm_values


def sbatch_script(sweep: Sweep, tasks: list, tasks_file: Path) -> str:
    """An sbatch script with one array task per entry of `tasks` (a run, or a group of runs);
    task i trains the i-th entry of `tasks_file` (a JSON list of lists of run names). No run
    name or config value appears in the script itself, and every path and option in it is
    shell-quoted."""
    check_slurm_values(sweep.slurm, f"sweep file {sweep.path}")
    resources = {
        "partition": None,
        "time": None,
        "cpus_per_task": None,
        "gres": None,
        "mem": None,
        "nodes": None,
        "ntasks": None,
        "account": None,
        "qos": None,
    }
    resources.update(sweep.slurm)
    quote = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={quote('sweep-' + sweep.path.stem)}",
        f"#SBATCH --array=0-{len(tasks) - 1}",
        f"#SBATCH --output={quote(str(sweep.directory / 'slurm-%A_%a.out'))}",
    ]
    for key, value in resources.items():
        if value is not None:
            lines.append(f"#SBATCH --{key.replace('_', '-')}={quote(str(value))}")
    lines += [
        f"cd {quote(str(Path.cwd()))}",
        f"exec {' '.join(map(quote, SELF))} sweep {quote(str(sweep.path))} "
        f'--run-task "$SLURM_ARRAY_TASK_ID" --task-runs {quote(str(tasks_file))}',
    ]
    return "\n".join(lines) + "\n"


def submit_slurm(sweep: Sweep, retry_failed: bool) -> int:
    todo = pending_runs(sweep, retry_failed)
    if not todo:
        print("nothing to submit: every run is finished")
        return 0
    if shutil.which("sbatch") is None:  # before anything is written or marked submitted
        raise UsageError(
            "--backend slurm submits with SLURM's sbatch, which is not on PATH; run the sweep on a SLURM login "
            "node, or use --backend local"
        )
    script, tasks_file = sweep.directory / "sweep.sbatch", sweep.directory / "sweep.tasks.json"
    tasks = units(sweep, todo)  # each run alone, or (vectorize) groups of runs sharing a program
    write_atomic(tasks_file, json.dumps([[run.name for run in task] for task in tasks]))
    script.write_text(sbatch_script(sweep, tasks, tasks_file))
    for run in todo:
        sweep.workdir(run).mkdir(parents=True, exist_ok=True)
        write_json(sweep.workdir(run) / STATUS, {"status": "submitted"})
    write_index(sweep)
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UsageError(f"sbatch refused {script}: {result.stderr.strip()}")
    print(f"submitted job array {result.stdout.strip()} ({len(todo)} runs in {len(tasks)} tasks): {script}")
    return 0


def run_task(sweep: Sweep, index: int, tasks_file: str) -> int:
    """Inside a SLURM array task: train the run (or vectorised group) at `index` of `tasks_file`."""
    try:
        tasks = json.loads(Path(tasks_file).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--task-runs {tasks_file} is not a readable JSON list of run names: {e}") from None
    by_name = {run.name: run for run in sweep.runs}
    count = len(tasks) if isinstance(tasks, list) else 0
    task = tasks[index] if 0 <= index < count else None
    names = [task] if isinstance(task, str) else task  # a name alone: written before groups were
    if not names or not isinstance(names, list) or not all(isinstance(name, str) and name in by_name for name in names):
        raise UsageError(f"array task {index} has no run in {tasks_file} ({count} tasks listed)")
    code = run_unit(sweep, [by_name[name] for name in names], dict(os.environ))
    write_index(sweep)
    return 0 if code == 0 else 1
