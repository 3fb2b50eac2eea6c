"""`launch.py sweep SWEEP.yaml [--parallel K | --devices-per-trial N [--local-processes P
--devices-per-process M]] [--backend slurm] [--retry-failed]`: every config of a sweep file (grid,
zip, random, or an Optuna search); re-running resumes what is unfinished. With --devices-per-trial
in a job of several processes (--local-processes, or any multi-host launch: every process runs
the command) the job's devices are cut into sub-meshes (engine/sweep/submesh.py)."""

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
        "--local-processes",
        type=int,
        metavar="P",
        help="with --devices-per-trial: a job of P processes on this host (as for train), each running the sweep's "
        "sub-meshes that hold its devices",
    )
    p.add_argument("--devices-per-process", type=int, default=1, metavar="M", help="with --local-processes")
    # a job's process: distributed.* settings (launch.py ... --local-processes appends them)
    p.add_argument("job", nargs="*", help=argparse.SUPPRESS)
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
    # (the launcher of a job's processes does not)
    return bool(args.run_group or args.plan or (args.devices_per_trial and not args.local_processes))


def _local_job(args, argv: list[str]) -> int:
    """`--devices-per-trial N --local-processes P`: P processes, each running this sweep command."""
    from engine.cli.local_check import check_count
    from engine.cli.train import without_local_flags
    from engine.errors import UsageError
    from engine.runtime.launcher import run_local_job
    from engine.sweep.submesh import check_layout

    if args.devices_per_trial is None:
        raise UsageError(
            "--local-processes runs a sweep's trials on sub-meshes of the job: add --devices-per-trial N, or drop "
            "--local-processes (the trials' own configs may then set a job of their own)"
        )
    check_count(args.local_processes, args.devices_per_process)
    check_layout(args.devices_per_trial, args.devices_per_process, args.local_processes)
    return run_local_job(["sweep", *without_local_flags(argv)], args.local_processes, args.devices_per_process)


def _join_job(settings: list[str]) -> None:
    """A process of a multi-process job joins it (the settings launch.py appends, distributed.KEY=VALUE;
    else a cluster environment's, as for train); a process alone does nothing."""
    import dataclasses

    from engine.config.schema import DistributedConfig
    from engine.errors import UsageError
    from engine.runtime.distributed import initialize

    fields = {f.name: f.type for f in dataclasses.fields(DistributedConfig)}
    given: dict = {}
    for item in settings:
        key, _, value = item.partition("=")
        name = key.removeprefix("distributed.")
        if not key.startswith("distributed.") or name not in fields or not value:
            raise UsageError(f"launch.py sweep takes no override {item!r}: put overrides in the sweep file")
        given[name] = int(value) if fields[name] in (int, "int") else value
    initialize(DistributedConfig(**given))


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
    if args.local_processes:
        return _local_job(args, argv)
    if args.job and args.devices_per_trial is None:
        raise UsageError(f"launch.py sweep takes no override {args.job[0]!r}: put overrides in the sweep file")
    if args.devices_per_trial is not None:
        _join_job(args.job)
    code = sweep_main(
        args.sweep_file,
        args.parallel,
        args.backend,
        args.retry_failed,
        args.run_task,
        args.task_runs,
        args.run_group,
        args.devices_per_trial,
    )
    if args.devices_per_trial is not None:
        from engine.errors import exit_now
        from engine.sweep.submesh import stuck

        if stuck():  # (its results and report are written)
            exit_now("sweep: a hung trial's thread is still stuck; the sweep process ends here", code)
    return code


COMMAND = Command(parser, run, trains=trains, runs_jax=runs_jax)
