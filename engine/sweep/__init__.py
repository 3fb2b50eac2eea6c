"""`launch.py sweep SWEEP.yaml`: config sweeps (see spec.py for the file format)."""
from __future__ import annotations

import sys

from engine.errors import UsageError
from engine.report import report
from engine.sweep.local import run_pending, write_index
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
    write_index(sweep)
    if backend == "slurm":
        return submit_slurm(sweep, retry_failed)
    code = run_pending(sweep, parallel, retry_failed)
    try:
        report([sweep.directory], metric=sweep.metric, mode=sweep.mode, out=sweep.directory)
    except UsageError as e:  # no run has logged the metric yet (all failed early, or stopped): say so, keep the code
        print(f"no report: {e}", file=sys.stderr)
    return code
