"""The smaller jobs an elastic job can go on as: the mesh overrides of each process count.

The axis that shrinks is the outermost data axis: the mesh's other axes keep their sizes,
mesh.data (and mesh.dcn_data) take the devices left; the global batch, the data order and the
random numbers do not depend on the process count (engine/data/pipeline.py), so each device's
share of the batch grows. Whether every smaller job from N-1 processes down to
fault.min_processes has such a layout is checked before the first start (`shrink_plan`), under
every launcher (engine/elastic/supervisor.py, pods.py). Imports no jax.
"""

from __future__ import annotations

import math

from engine.errors import UsageError
from engine.parallel.axes import BATCH_AXES, CONFIG_AXES
from engine.parallel.strategies import strategy_of


def shrink_plan(cfg, processes: int, devices: int) -> dict[int, list[str]]:
    """For every process count from fault.min_processes to processes - 1: the mesh overrides of a
    job on that many processes (the data axis shrinks). UsageError naming the fix when one has none."""
    fault = cfg.fault
    if processes < 2:
        raise UsageError("fault.elastic=true needs a job of several processes (--local-processes 2 or more)")
    if fault.min_processes >= processes:
        raise UsageError(
            f"fault.elastic=true: fault.min_processes={fault.min_processes} leaves no smaller job for "
            f"{processes} processes to go on with; set fault.min_processes below {processes}"
        )
    strategy = strategy_of(cfg)  # (train.sync's answers: engine/parallel/strategies.py)
    sizes = {axis: getattr(cfg.mesh, axis) for axis in CONFIG_AXES}
    derived = [axis for axis, size in sizes.items() if size == -1 and axis != "data"]
    if derived:
        raise UsageError(
            f"fault.elastic=true: mesh.{derived[0]}=-1 would take the devices a lost process leaves, but only "
            f"the data axis shrinks; set mesh.{derived[0]} to a size and mesh.data=-1"
        )
    others = math.prod(size for axis, size in sizes.items() if axis != "data")
    batch_others = math.prod(sizes[axis] for axis in BATCH_AXES if axis in sizes and axis != "data")
    counts = range(fault.min_processes, processes)
    plans = {}
    for count in counts:
        problem, overrides = _layout(cfg, count, processes, devices, others, batch_others)
        if problem:
            raise UsageError(
                f"fault.elastic=true: the job cannot go on with {count} processes ({count * devices} devices), "
                f"where the data axis is the one that shrinks: {problem}. Fix: {_fix(cfg, counts, devices, others)}"
            )
        plans[count] = overrides
        strategy.check_resize(cfg, count, processes, count * devices // others)  # (DiLoCo: 2 replicas or more)
    return plans


def _layout(cfg, count: int, processes: int, devices: int, others: int, batch_others: int):
    """(what stops a job of `count` processes, "" if nothing; its mesh overrides)."""
    total = count * devices
    if total % others:
        return f"the mesh's other axes use {others} devices, which do not divide {total}", []
    data = total // others
    overrides = [f"mesh.data={data}"] if cfg.mesh.data != -1 else []
    dcn = cfg.mesh.dcn_data
    if dcn > 1:
        if (dcn * count) % processes or data % (dcn * count // processes):
            return f"mesh.dcn_data={dcn} over {processes} processes has no counterpart over {count}", []
        overrides.append(f"mesh.dcn_data={dcn * count // processes}")
    shards = data * batch_others
    train = cfg.train
    batches = {
        "train.global_batch_size": train.global_batch_size,
        "the microbatch train.global_batch_size / train.grad_accum_steps": train.global_batch_size
        // train.grad_accum_steps,
        "eval.batch_size": cfg.eval.batch_size or train.global_batch_size,
    }
    for name, value in batches.items():
        if value % shards:
            return f"{name} = {value} is not divisible by its {shards} batch shards", []
    return "", overrides


def _fix(cfg, counts: range, devices: int, others: int) -> str:
    """What makes every smaller job possible (or a higher fault.min_processes)."""
    if any((count * devices) % others for count in counts):
        return (
            f"keep the non-data mesh axes within one process (a product dividing --devices-per-process={devices}), "
            f"or raise fault.min_processes"
        )
    batch_others = math.prod(getattr(cfg.mesh, a) for a in BATCH_AXES if a in CONFIG_AXES and a != "data")
    shards = [count * devices // others * batch_others for count in [*counts, counts.stop]]
    multiple = math.lcm(*shards) * cfg.train.grad_accum_steps
    return (
        f"make train.global_batch_size (and eval.batch_size) a multiple of {multiple}, which every job from "
        f"fault.min_processes={counts.start} to {counts.stop} processes divides into its batch shards, or raise "
        f"fault.min_processes"
    )
