"""What `launch.py train --local-processes N` checks before it starts any process: the config
loads and validates, the job's batches split over its N x M devices, checkpoint.local_dir can be
created, and N is a count this host can hold. Each refusal is a UsageError (one line, exit 2),
said once by the launcher instead of by every process after each has started JAX (issue 57: 12
processes, 2.95 GB and 23 s before each refused the batch). Imports no jax."""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path

from engine.errors import UsageError
from engine.parallel.axes import BATCH_AXES, CONFIG_AXES
from engine.parallel.strategies import strategy_of

# a local process's share of the host: measured on CPU, mnist_mlp's processes take about 0.25 GiB each
# (12 took 2.95 GB); more processes than PROCESSES_PER_CPU per core only queue for the cores
PROCESS_BYTES = 256 * 2**20
PROCESSES_PER_CPU = 8


def job_config(config: str, overrides: list[str], workdir):
    """The job's config, loaded and validated as each process will (its notes are the processes'
    to say: read quietly here); UsageError when it does not load."""
    from engine.config import load_config

    with contextlib.redirect_stderr(io.StringIO()):
        return load_config(config, overrides, workdir)


def check_local_job(cfg, processes: int, devices: int) -> None:
    """UsageError naming the fix when a local job of `processes` x `devices` cannot start."""
    check_count(processes, devices)
    check_batches(cfg, processes * devices)
    check_local_dir(cfg.checkpoint.local_dir)


def host_limit() -> tuple[int, str]:
    """(the most local processes this host holds, why: its cores and available memory)."""
    cpus = os.cpu_count() or 1
    limit, why = cpus * PROCESSES_PER_CPU, f"{cpus} CPU core(s) x {PROCESSES_PER_CPU}"
    available = _available_memory()
    if available is not None and available // PROCESS_BYTES < limit:
        limit = max(int(available // PROCESS_BYTES), 1)
        why = f"{available / 2**30:.1f} GiB of memory available, about {PROCESS_BYTES / 2**30:.2f} GiB a process"
    return limit, why


def check_count(processes: int, devices: int) -> None:
    if processes < 1 or devices < 1:
        raise UsageError("--local-processes and --devices-per-process must be at least 1")
    limit, why = host_limit()
    if processes > limit:
        raise UsageError(
            f"--local-processes {processes}: this host holds at most {limit} local processes ({why}); "
            f"use --local-processes {limit} or fewer, and more --devices-per-process for a larger mesh"
        )


def check_batches(cfg, devices: int) -> None:
    """The mesh covers `devices` and the train, micro and eval batches split over its batch axes (as
    each process checks after it started: engine/parallel/mesh.py, engine/run/blueprint.py). DiLoCo's
    replica axis and multi-slice layouts are left to the processes."""
    mesh = cfg.mesh
    if strategy_of(cfg).replicas_from(cfg) or mesh.dcn_data > 1 or mesh.num_devices != -1:
        return
    sizes = {axis: getattr(mesh, axis) for axis in CONFIG_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    layout = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
    for axis, size in sizes.items():
        if size == -1:
            if devices % fixed:
                raise UsageError(
                    f"mesh {layout}: the other axes use {fixed} devices, which does not divide the job's "
                    f"{devices} devices (--local-processes x --devices-per-process); choose sizes whose product "
                    f"divides {devices}"
                )
            sizes[axis] = devices // fixed
    if math.prod(sizes.values()) != devices:
        raise UsageError(
            f"mesh {layout} uses {math.prod(sizes.values())} devices but the job has {devices} "
            f"(--local-processes x --devices-per-process); make {' * '.join('mesh.' + a for a in CONFIG_AXES)} = "
            f"{devices} (or set one of them to -1)"
        )
    axes = [axis for axis in BATCH_AXES if axis in sizes]
    shards = math.prod(sizes[axis] for axis in axes)
    where = f"{'*'.join(axes)}={'*'.join(str(sizes[a]) for a in axes)}={shards} over {devices} devices"
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    batches = {
        "train.global_batch_size": batch,
        "the microbatch train.global_batch_size / train.grad_accum_steps": batch // accum,
        "eval.batch_size": cfg.eval.batch_size or batch,
    }
    for name, value in batches.items():
        if value % shards:
            raise UsageError(
                f"{name}={value} is not divisible by {where}; use a multiple of "
                f"{shards * (accum if name != 'eval.batch_size' else 1)}"
            )


def check_local_dir(local_dir: str) -> None:
    """checkpoint.local_dir exists as a folder or can be created (each process would create it)."""
    if not local_dir:
        return
    path = Path(local_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"checkpoint.local_dir={local_dir} cannot be created ({e.strerror or e}); set it to a folder on "
            "node-local storage this user can write, e.g. checkpoint.local_dir=/dev/shm/checkpoints"
        ) from None


def _available_memory() -> float | None:
    """The host's available memory in bytes (Linux's MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
