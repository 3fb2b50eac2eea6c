"""`launch.py sweep SWEEP.yaml`: config sweeps (see spec.py for the file format)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engine.errors import UsageError
from engine.observe.ranking import report
from engine.runtime.rundir import STATUS, write_json
from engine.sweep.local import REPORTS, run_pending, write_index
from engine.sweep.search import run_search, study_report
from engine.sweep.slurm import run_task, submit_slurm
from engine.sweep.spec import RunSpec, Sweep, format_value, load_sweep, validate_runs

__all__ = ["RunSpec", "Sweep", "format_value", "load_sweep", "validate_runs", "main"]


def run_group_task(sweep: Sweep, names_file: str) -> int:
    """Inside a sweep's child process: trains the runs named in `names_file` (a JSON list) as
    one vectorised group; a run whose loss diverged is marked failed here, alone."""
    from engine.run.group import fit_group

    started = time.time()
    try:
        names = json.loads(Path(names_file).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--run-group {names_file} is not a readable JSON list of run names: {e}") from None
    by_name = {run.name: run for run in sweep.runs}
    missing = [name for name in names if name not in by_name]
    if missing or not names:
        raise UsageError(f"--run-group {names_file}: no run of {sweep.path.name} is called {missing or names}")
    runs = [by_name[name] for name in names]

    def failed(cfg, error: str) -> None:  # recorded at once: the group may yet be stopped or fail
        write_json(
            Path(cfg.workdir) / STATUS,
            {"status": "failed", "exit_code": 1, "error": error, "seconds": round(time.time() - started, 2)},
        )

    fit_group([sweep.config(run) for run in runs], started, on_stop=failed)
    return 0


def main(
    sweep_file: str,
    parallel: int,
    backend: str,
    retry_failed: bool,
    task: int | None = None,
    task_runs: str | None = None,
    group: str | None = None,
    devices_per_trial: int | None = None,
) -> int:
    sweep = load_sweep(sweep_file)
    if task is not None:
        return run_task(sweep, task, task_runs or "")
    if group is not None:
        return run_group_task(sweep, group)
    validate_runs(sweep)  # one bad value stops the sweep before anything runs
    REPORTS.set()
    sweep.directory.mkdir(parents=True, exist_ok=True)
    if not sweep.search:  # a search's index is written as its trials end
        write_index(sweep)
    if devices_per_trial is not None:  # every trial in this process, on sub-meshes of its devices
        from engine.sweep.submesh import run_submeshes, writes_report

        code = run_submeshes(sweep, devices_per_trial, retry_failed)
        if not writes_report():  # (another process of the job's)
            return code
    elif sweep.search:
        if backend == "slurm" or parallel != 1:
            raise UsageError(
                "a search sweep runs one trial per sweep process: start several `launch.py sweep` "
                "processes on the same file (they share the study) instead of --parallel or "
                "--backend slurm"
            )
        code = run_search(sweep)
    elif backend == "slurm":
        return submit_slurm(sweep, retry_failed)
    else:
        code = run_pending(sweep, parallel, retry_failed)
    try:
        report([sweep.directory], metric=sweep.metric, mode=sweep.mode, out=sweep.directory)
    except UsageError as e:  # no run has logged the metric yet (all failed early, or stopped): say so, keep the code
        print(f"no report: {e}", file=sys.stderr)
    if sweep.search:
        study_report(sweep)
    return code
