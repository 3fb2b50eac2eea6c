"""`launch.py sweep SWEEP.yaml`: config sweeps (see spec.py for the file format)."""
from __future__ import annotations

import sys

from engine.errors import UsageError
from engine.report import report
from engine.sweep.local import run_pending, write_index
from engine.sweep.search import run_search, study_report
from engine.sweep.slurm import run_task, submit_slurm
from engine.sweep.spec import RunSpec, Sweep, format_value, load_sweep, validate_runs

__all__ = ["RunSpec", "Sweep", "format_value", "load_sweep", "validate_runs", "main"]


def main(sweep_file: str, parallel: int, backend: str, retry_failed: bool, task: int | None = None,
         task_runs: str | None = None) -> int:
    sweep = load_sweep(sweep_file)
    if task is not None:
        return run_task(sweep, task, task_runs or "")
    validate_runs(sweep)  # one bad value stops the sweep before anything runs
    sweep.directory.mkdir(parents=True, exist_ok=True)
    if not sweep.search:  # a search's index is written as its trials end
        write_index(sweep)
    if sweep.search:
        if backend == "slurm" or parallel != 1:
            raise UsageError("a search sweep runs one trial per sweep process: start several `launch.py sweep` "
                             "processes on the same file (they share the study) instead of --parallel or "
                             "--backend slurm")
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
