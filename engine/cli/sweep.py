"""`launch.py sweep SWEEP.yaml [--parallel K | --devices-per-trial N] [--backend slurm] [--retry-failed]`:
every config of a sweep file (grid, zip, random, or an Optuna search); re-running resumes what is
unfinished."""

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
    p.add_argument(
        "--devices-per-trial",
        type=int,
        metavar="N",
        help="train the trials in this process, each on its own sub-mesh of N of its devices, as many at once as "
        "the devices hold (a freed sub-mesh takes the next trial)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="train nothing: compile every distinct program of the sweep for --target (launch.py plan)",
    )
    p.add_argument("--target", metavar="TOPOLOGY", help="with --plan: a TPU slice, e.g. v5p-128 or v5e:4x4")
    p.add_argument("--slices", type=int, default=1, metavar="N", help="with --plan: slices of that shape")
    p.add_argument("--run-task", type=int, help=argparse.SUPPRESS)  # inside a SLURM array task
    p.add_argument("--task-runs", help=argparse.SUPPRESS)
    p.add_argument("--run-group", help=argparse.SUPPRESS)  # a vectorised group, in the sweep's child
    return p


def trains(argv: list[str]) -> bool:
    return "--run-group" in argv  # a vectorised group trains in this process


def runs_jax(args) -> bool:
    # a sweep's own process (its runs are children) never loads jax; with sub-meshes it trains them itself
    return bool(args.run_group or args.plan or args.devices_per_trial)


def run(args, argv: list[str]) -> int:
    from engine.errors import UsageError
    from engine.sweep import main as sweep_main

    if args.parallel < 1:
        raise UsageError(f"--parallel {args.parallel} must be at least 1")
    if args.plan or args.target:
        if not (args.plan and args.target):
            raise UsageError("--plan and --target go together: launch.py sweep SWEEP.yaml --plan --target v5p-128")
        from engine.plan.sweeps import plan_sweep
        from engine.sweep import load_sweep, validate_runs

        sweep = load_sweep(args.sweep_file)
        validate_runs(sweep)
        if args.devices_per_trial is not None:  # each run on a sub-mesh of the target
            from engine.plan.sweeps import plan_submeshes

            if args.slices != 1:
                raise UsageError("--devices-per-trial plans sub-meshes of one slice: drop --slices")
            return plan_submeshes(sweep, args.target, args.devices_per_trial)
        return plan_sweep(sweep, args.target, args.slices)
    if args.devices_per_trial is not None and (args.parallel != 1 or args.backend != "local"):
        raise UsageError("--devices-per-trial trains every trial in this process: drop --parallel and --backend")
    return sweep_main(
        args.sweep_file,
        args.parallel,
        args.backend,
        args.retry_failed,
        args.run_task,
        args.task_runs,
        args.run_group,
        args.devices_per_trial,
    )


COMMAND = Command(parser, run, trains=trains, runs_jax=runs_jax)
