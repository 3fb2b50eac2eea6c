"""`launch.py --dry-run`: the layout and cost of a run, without allocating or training."""

from __future__ import annotations

import math

import jax

from engine.config import Config
from engine.parallel.sharding import per_device_bytes
from engine.parallel.stages import describe as describe_pipeline
from engine.parallel.sync import parts_of
from engine.plan import hlo
from engine.run.backends import compile_now
from engine.run.setup import Run, build_run
from engine.runtime.units import human_bytes
from models.family import stacked_layers


def dry_run_report(run: Run) -> str:
    """The mesh, each parameter's layout and bytes, what a device holds, the compiled step's
    memory and collectives, and the model FLOPs."""
    cfg = run.cfg
    lines = [
        f"mesh: {dict(run.mesh.shape)} over {run.mesh.size} {jax.devices()[0].platform} device(s); "
        f"backend={cfg.mesh.backend}"
    ]
    header = ("parameter", "shape", "logical axes", "PartitionSpec", "bytes")
    # A scanned model's layers are one parameter per kind, stacked on a `layers` axis: one row each.
    rows = [
        (
            p.path + (f" (x{p.shape[0]} layers)" if p.logical[:1] == ("layers",) else ""),
            str(p.shape),
            str(tuple(p.logical)) if p.logical else "-",
            str(tuple(p.spec)),
            human_bytes(p.nbytes),
        )
        for p in run.model.param_layouts
    ]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(col.ljust(w) for col, w in zip(row, widths)))
    total_params = sum(math.prod(p.shape) for p in run.model.param_layouts)
    state = run.abstract_state
    lines.append(f"parameters: {total_params:,} ({human_bytes(sum(p.nbytes for p in run.model.param_layouts))})")
    lines.append(
        f"per device: params {human_bytes(per_device_bytes(state.params))}, "
        f"optimizer state {human_bytes(per_device_bytes(state.opt_state))}, "
        f"model state {human_bytes(per_device_bytes(state.model_state))}"
        + (" (pmap keeps a full copy on every device)" if cfg.mesh.backend == "pmap" else "")
    )
    m = run.compiled.memory
    if m is not None:
        lines.append(
            f"compiled step memory per device: arguments {human_bytes(m.argument_size_in_bytes)}, "
            f"outputs {human_bytes(m.output_size_in_bytes)}, temporaries {human_bytes(m.temp_size_in_bytes)}, "
            f"aliased (donated) {human_bytes(m.alias_size_in_bytes)}"
        )
    if run.compiled.program is not None:  # what the layout makes each device send per step
        found = hlo.hlo_collectives(run.compiled.program.as_text(), run.mesh.size)
        lines.append(
            f"collectives in one call of the compiled step (a loop's run once per iteration): {hlo.summary(found)}"
        )
    sync = parts_of(cfg)  # train.sync's lines (DiLoCo: the replicas, and what a round's outer step sends)
    lines += sync.dry_run_lines(
        cfg, run, total_params, lambda p: hlo.summary(hlo.hlo_collectives(p.as_text(), run.mesh.size))
    )
    plan = run.blueprint.stages  # the pipeline the run was built with
    if plan.stages > 1:
        lines.append(describe_pipeline(plan, stacked_layers(run.model.family, cfg.model)))
    flops = run.cost.flops_per_device_step
    lines.append(
        f"model FLOPs per step ({run.cost.source}): {flops:.4g} per device, {flops * run.mesh.size:.4g} in "
        f"all; compile time {run.compiled.compile_seconds:.2f}s"
    )
    return "\n".join(lines)


def dry_run(cfg: Config) -> None:
    run = build_run(cfg, check_memory=False)
    compile_now(run.compiled.eval_step)  # ahead of time as the train step: a precompile caches both
    print(dry_run_report(run))
