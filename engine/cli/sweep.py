"""`launch.py sweep SWEEP.yaml [--parallel K] [--backend slurm] [--retry-failed]`: every config
of a sweep file (grid, zip, random, or an Optuna search); re-running resumes what is unfinished."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py sweep",
        description="Run every config of a sweep file (grid, zip, random search, "
        "Optuna search); re-running resumes what is unfinished.",
    )
    p.add_argument("sweep_file", help="the sweep YAML (see docs/sweeps.md)")
    p.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (local backend)")
    p.add_argument(
        "--backend",
        choices=("local", "slurm"),
        default="local",
        help="local processes, or one SLURM job array (sbatch)",
    )
    p.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    p.add_argument("--run-task", type=int, help=argparse.SUPPRESS)  # inside a SLURM array task
    p.add_argument("--task-runs", help=argparse.SUPPRESS)
    p.add_argument("--run-group", help=argparse.SUPPRESS)  # a vectorised group, in the sweep's child
    return p


def trains(argv: list[str]) -> bool:
    return "--run-group" in argv  # a vectorised group trains in this process


def runs_jax(args) -> bool:
    return bool(args.run_group)  # a sweep's own process (its runs are children) never loads jax


def run(args, argv: list[str]) -> int:
    from engine.errors import UsageError
    from engine.sweep import main as sweep_main

    if args.parallel < 1:
        raise UsageError(f"--parallel {args.parallel} must be at least 1")
    return sweep_main(
        args.sweep_file, args.parallel, args.backend, args.retry_failed, args.run_task, args.task_runs, args.run_group
    )


COMMAND = Command(parser, run, trains=trains, runs_jax=runs_jax)
