"""`launch.py --dry-run`: the layout and cost of a run, without allocating or training."""
from __future__ import annotations

import math

import jax

from engine.config import Config
from engine.setup import Run, build_run


def _bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def dry_run_report(run: Run) -> str:
    cfg = run.cfg
    lines = [f"mesh: {dict(run.mesh.shape)} over {run.mesh.size} {jax.devices()[0].platform} device(s); "
             f"backend={cfg.mesh.backend}"]
    header = ("parameter", "shape", "logical axes", "PartitionSpec", "bytes")
    # A scanned model's layers are one parameter per kind, stacked on a `layers` axis: one row each.
    rows = [(p.path + (f" (x{p.shape[0]} layers)" if p.logical[:1] == ("layers",) else ""), str(p.shape),
             str(tuple(p.logical)) if p.logical else "-", str(tuple(p.spec)), _bytes(p.nbytes))
            for p in run.model.param_layouts]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(col.ljust(w) for col, w in zip(row, widths)))
    total_params = sum(math.prod(p.shape) for p in run.model.param_layouts)
    state = run.abstract_state
    lines.append(f"parameters: {total_params:,} ({_bytes(sum(p.nbytes for p in run.model.param_layouts))})")
    lines.append(f"per device: params {_bytes(per_device_bytes(state.params))}, "
                 f"optimizer state {_bytes(per_device_bytes(state.opt_state))}, "
                 f"model state {_bytes(per_device_bytes(state.model_state))}"
                 + (" (pmap keeps a full copy on every device)" if cfg.mesh.backend == "pmap" else ""))
    m = run.compiled.memory
    if m is not None:
        lines.append(f"compiled step memory per device: arguments {_bytes(m.argument_size_in_bytes)}, "
                     f"outputs {_bytes(m.output_size_in_bytes)}, temporaries {_bytes(m.temp_size_in_bytes)}, "
                     f"aliased (donated) {_bytes(m.alias_size_in_bytes)}")
    flops = run.cost.flops_per_device_step
    lines.append(f"model FLOPs per step ({run.cost.source}): {flops:.4g} per device, {flops * run.mesh.size:.4g} in "
                 f"all; compile time {run.compiled.compile_seconds:.2f}s")
    return "\n".join(lines)


def dry_run(cfg: Config) -> None:
    print(dry_run_report(build_run(cfg)))
