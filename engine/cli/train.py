"""`launch.py [train] --config FILE [--workdir DIR] [--dry-run] [--profile] [key=value ...]`:
train a run, or resume it from its workdir's newest checkpoint."""

from __future__ import annotations

import argparse
import os
import sys

from engine.cli.common import Command, Parser, overrides_argument

LOCAL_FLAGS = ("--local-processes", "--devices-per-process")
POD_FLAGS = ("--rendezvous", "--processes", "--member", "--member-address")  # a pod's supervisor's own


def parser() -> argparse.ArgumentParser:
    from engine.cli import COMMANDS
    from engine.config import shipped_configs

    others = ", ".join(name for name in COMMANDS if name != "train")
    p = Parser(
        prog="launch.py [train]",
        description=f"Train a model from a config file: `launch.py train ...`, or `launch.py ...` with no command "
        f"(the other commands: {others}; `launch.py COMMAND "
        "--help` for each). Overrides are dotted.key=value pairs, e.g. train.steps=500 "
        "optimizer.learning_rate=3e-4 mesh.fsdp=8 model.hidden_sizes=[256,128]; values are "
        "parsed as YAML. Re-running on a workdir with checkpoints resumes from the newest one.",
        epilog="shipped configs (in configs/, by path or bare name): " + ", ".join(shipped_configs()),
    )
    p.add_argument("--config", required=True, help="a YAML config file (or the name of one in configs/)")
    p.add_argument("--workdir", help="output directory (default: the config's workdir, or runs/<config name>)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the mesh, parameter layout, memory and FLOPs per step; do not train",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="trace steps 5..15 of this run with jax.profiler into WORKDIR/profile "
        "(= log.profile_steps=[5,15]; view with TensorBoard's profile plugin or XProf)",
    )
    _multi_process_flags(p.add_argument_group("multi-process (see docs/multihost.md)"))
    overrides_argument(p)
    return p


def _multi_process_flags(group) -> None:
    """The flags of jobs of several processes: local, SLURM's elastic driver, a pod's supervisor."""
    group.add_argument(
        "--local-processes",
        type=int,
        metavar="N",
        help="run N processes on this host (CPU devices, coordinator on 127.0.0.1)",
    )
    group.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        metavar="M",
        help="simulated CPU devices per local process (default 1); with --elastic: each SLURM task's devices "
        "(default: SLURM_GPUS_PER_TASK, else XLA_FLAGS' forced CPU device count, else 1); with --rendezvous: each "
        "pod's (default: XLA_FLAGS' forced CPU device count, else 1)",
    )
    group.add_argument(
        "--elastic",
        action="store_true",
        help="inside a SLURM allocation (sbatch script or salloc; not under srun): drive the job as srun steps of "
        "the allocation's tasks, restarted on the tasks left when one dies (needs fault.elastic=true)",
    )
    group.add_argument(
        "--rendezvous",
        metavar="DIR|etcd://HOST:PORT/PREFIX",
        help="Kubernetes: supervise this pod's process of an elastic job, meeting the other pods through etcd (the "
        "job's keys under PREFIX) or in DIR, a directory every pod mounts (a ReadWriteMany volume); needs "
        "fault.elastic=true and --processes",
    )
    group.add_argument("--processes", type=int, metavar="N", help="with --rendezvous: the job's full size (pods)")
    group.add_argument(
        "--member", metavar="ID", help="with --rendezvous: this pod's id (default: $POD_NAME, else the host name)"
    )
    group.add_argument(
        "--member-address",
        metavar="HOST",
        help="with --rendezvous: where the other pods reach this one (default: this host name's address)",
    )
    group.add_argument("--coordinator-address", help="= distributed.coordinator_address (host:port)")
    group.add_argument("--num-processes", type=int, help="= distributed.num_processes")
    group.add_argument("--process-id", type=int, help="= distributed.process_id")


def trains(argv: list[str]) -> bool:
    """The launcher of local processes trains nothing itself: its children note signals."""
    return not any(arg.split("=")[0] in ("--local-processes", "--elastic", "--rendezvous") for arg in argv)


def runs_jax(args) -> bool:
    return not args.local_processes and not args.elastic and not args.rendezvous


def run(args, argv: list[str]) -> int:
    if args.rendezvous:
        return _pod_job(args, argv)
    if args.elastic:
        return _slurm_job(args, argv)
    if args.local_processes:
        return _local_job(args, argv)
    import jax

    from engine.cli import STARTED
    from engine.config import load_config
    from engine.observe.trackers import check_installed
    from engine.runtime import settings as process
    from engine.runtime.distributed import initialize, parse_tf_config

    profile = ["log.profile_steps=[5,15]"] if args.profile else []
    cfg = load_config(args.config, profile + args.overrides + _distributed_overrides(args), args.workdir)
    check_installed(cfg)  # before anything is written
    tf_config = os.environ.get("TF_CONFIG")
    if tf_config and parse_tf_config(tf_config).kind == "evaluator":
        from engine.run.evaluator import run_evaluator
        from engine.runtime.preemption import release_signals

        release_signals()  # the evaluator ends on SIGTERM as a reader does
        return run_evaluator(cfg, watch=True)
    initialize(cfg.distributed)
    # saves from a background thread need them (without them host staging lets orbax copy first)
    if jax.process_count() > 1 and (cfg.checkpoint.staging == "device" or process.has_distributed_client_barriers()):
        process.use_distributed_client_barriers()
    if args.dry_run:
        from engine.plan.dryrun import dry_run

        dry_run(cfg)
        return 0
    from engine.run.single import NonFiniteLoss, fit

    try:
        result = fit(cfg, started=STARTED)
    except NonFiniteLoss as e:
        sys.stderr.write(f"error: training stopped: {e}\n")
        return 1
    if result.eval_metrics:
        summary = " ".join(f"{k}={v:.4f}" for k, v in result.eval_metrics.items())
        print(f"done: {result.steps or cfg.train.steps} steps; eval {summary}; outputs in {cfg.workdir}")
    return 0


def _local_job(args, argv: list[str]) -> int:
    """`--local-processes N`: the config checked here (engine/cli/local_check.py), then the job."""
    from engine.cli.local_check import check_count, check_local_job, job_config
    from engine.runtime.launcher import run_local_job

    check_count(args.local_processes, args.devices_per_process)
    profile = ["log.profile_steps=[5,15]"] if args.profile else []
    cfg = job_config(args.config, profile + args.overrides, args.workdir)
    check_local_job(cfg, args.local_processes, args.devices_per_process)
    if cfg.fault.elastic:
        from engine.elastic.local_processes import run_elastic_job

        return run_elastic_job(without_local_flags(argv), cfg, args.local_processes, args.devices_per_process)
    return run_local_job(without_local_flags(argv), args.local_processes, args.devices_per_process)


def _slurm_job(args, argv: list[str]) -> int:
    """`--elastic`: this process drives the SLURM job (engine/elastic/srun_steps.py)."""
    from engine.config import load_config
    from engine.elastic.srun_steps import check_driver, run_slurm_job, task_devices
    from engine.errors import UsageError

    if args.local_processes:
        raise UsageError(
            "--elastic drives a SLURM job; a local job (--local-processes N) restarts itself with fault.elastic=true "
            "alone: drop --elastic"
        )
    cfg = load_config(args.config, args.overrides, args.workdir)
    tasks = check_driver(cfg)
    given = args.devices_per_process if any(a.split("=")[0] == "--devices-per-process" for a in argv) else None
    step_args = [a for a in without_local_flags(argv) if a != "--elastic"]
    return run_slurm_job(step_args, cfg, tasks, task_devices(given))


def _pod_job(args, argv: list[str]) -> int:
    """`--rendezvous DIR|etcd://...`: this process supervises one pod of an elastic job (engine/elastic/pods.py)."""
    import socket

    from engine.config import load_config
    from engine.elastic.pods import check_pod, run_pod_job
    from engine.elastic.srun_steps import task_devices
    from engine.errors import UsageError
    from engine.runtime.settings import cpu_devices_in

    if args.local_processes or args.elastic:
        raise UsageError(
            "--rendezvous supervises one pod of a Kubernetes job; with --local-processes N fault.elastic=true alone "
            "restarts the job, and --elastic drives a SLURM one: drop --rendezvous or the other flag"
        )
    cfg = load_config(args.config, args.overrides, args.workdir)
    member = args.member or os.environ.get("POD_NAME") or socket.gethostname()
    check_pod(cfg, args.processes, member)
    address = args.member_address or socket.gethostbyname(socket.gethostname())
    given = args.devices_per_process if any(a.split("=")[0] == "--devices-per-process" for a in argv) else None
    if given is None and cpu_devices_in(os.environ.get("XLA_FLAGS", "")) is None:
        raise UsageError(
            "--rendezvous: pass --devices-per-process M, each pod's accelerators (the shrink plan of the smaller "
            "jobs needs it; a wrong count refuses a smaller round's mesh)"
        )
    devices = task_devices(given, {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
    child = without_flags(without_local_flags(argv), POD_FLAGS)
    return run_pod_job(child, cfg, args.rendezvous, args.processes, devices, member, address)


def _distributed_overrides(args) -> list[str]:
    flags = {
        "coordinator_address": args.coordinator_address,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    return [f"distributed.{key}={value}" for key, value in flags.items() if value is not None]


def without_local_flags(argv: list[str]) -> list[str]:
    """argv less --local-processes/--devices-per-process (and their values)."""
    return without_flags(argv, LOCAL_FLAGS)


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv less the options `flags` (and their values)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in flags:
            skip = "=" not in item
            continue
        out.append(item)
    return out


COMMAND = Command(parser, run, trains=trains, runs_jax=runs_jax)
