"""A sweep as one SLURM job array: an sbatch script with one array task per pending run;
each task trains its run by index (`launch.py sweep FILE --run-task I`)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.errors import UsageError
from engine.rundir import STATUS, write_json
from engine.sweep.local import pending_runs, run_one, write_index
from engine.sweep.spec import LAUNCH, RunSpec, Sweep


def sbatch_script(sweep: Sweep, runs: list[RunSpec]) -> str:
    """An sbatch script with one array task per run; each task trains its run by index."""
    resources = {"partition": None, "time": None, "cpus_per_task": None, "gres": None, "mem": None,
                 "nodes": None, "ntasks": None, "account": None, "qos": None}
    resources.update(sweep.slurm)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=sweep-{sweep.path.stem}", f"#SBATCH --array=0-{len(runs) - 1}",
             f"#SBATCH --output={sweep.directory}/slurm-%A_%a.out"]
    for key, value in resources.items():
        if value is not None:
            lines.append(f"#SBATCH --{key.replace('_', '-')}={value}")
    names = " ".join(run.name for run in runs)
    lines += [f"cd {Path.cwd()}",
              f"exec {sys.executable} {LAUNCH} sweep {sweep.path} --run-task \"$SLURM_ARRAY_TASK_ID\" "
              f"--task-runs '{names}'"]
    return "\n".join(lines) + "\n"


def submit_slurm(sweep: Sweep, retry_failed: bool) -> int:
    todo = pending_runs(sweep, retry_failed)
    if not todo:
        print("nothing to submit: every run is finished")
        return 0
    script = sweep.directory / "sweep.sbatch"
    script.write_text(sbatch_script(sweep, todo))
    for run in todo:
        sweep.workdir(run).mkdir(parents=True, exist_ok=True)
        write_json(sweep.workdir(run) / STATUS, {"status": "submitted"})
    write_index(sweep)
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UsageError(f"sbatch refused {script}: {result.stderr.strip()}")
    print(f"submitted job array {result.stdout.strip()} ({len(todo)} runs): {script}")
    return 0


def run_task(sweep: Sweep, index: int, names: list[str]) -> int:
    """Inside a SLURM array task: train run `names[index]`."""
    by_name = {run.name: run for run in sweep.runs}
    code = run_one(sweep, by_name[names[index]])
    write_index(sweep)
    return 0 if code == 0 else 1
