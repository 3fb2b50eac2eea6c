"""`launch.py sweep SWEEP.yaml --plan --target TOPOLOGY`: every distinct program of a sweep planned
for a TPU target: one run of each set of runs that share a compiled program, or with
`vectorize:` each group the sweep would train as one program (its trials side by side)."""

from __future__ import annotations

import json

from engine.config import program_settings
from engine.plan.compiled import Planned, plan
from engine.plan.tpu import parse_target
from engine.plan.verdict import verdict
from engine.runtime.units import human_bytes


def plan_sweep(sweep, target_name: str, slices: int) -> int:
    """Plans each program; prints one row each; 0 when every one fits, 1 otherwise."""
    from engine.sweep.local import units

    target = parse_target(target_name, slices)
    programs: dict[str, list] = {}
    for unit in units(sweep, sweep.runs):
        key = json.dumps(program_settings(sweep.config(unit[0])), sort_keys=True, default=str) + f"x{len(unit)}"
        programs.setdefault(key, unit)
    rows = []
    for unit in programs.values():
        cfgs = [sweep.config(run) for run in unit]
        planned = plan(cfgs[0], target, group=cfgs if len(cfgs) > 1 else ())
        rows.append((unit, planned))
        print(
            f"{unit[0].name}{f' (+{len(unit) - 1} vectorised)' if len(unit) > 1 else ''}: {_row(planned)}", flush=True
        )
    fitting = sum(planned.fits for _, planned in rows)
    print(f"plan: {len(rows)} distinct program(s) of {len(sweep.runs)} runs on {target.name}; {fitting} fit")
    return 0 if fitting == len(rows) else 1


def plan_submeshes(sweep, target_name: str, per_trial: int) -> int:
    """`--devices-per-trial N` with --plan: each run of the sweep (a search: its probes, the ends
    of its ranges and each choice) compiled for a sub-mesh of N devices of the target, an N-chip
    slice of its chip (the sub-mesh's own shape: what its program sees); one row per run (its
    memory per device and step time at 50% MFU, or why it does not fit) and how the sub-meshes
    hold the runs. 0 when every run fits its sub-mesh, 1 otherwise."""
    from engine.errors import UsageError
    from engine.plan.tpu import Target, slice_shape
    from engine.sweep.spec import search_probes

    target = parse_target(target_name)
    devices = target.chips * target.chip.devices_per_chip
    if per_trial < 1 or devices % per_trial or per_trial % target.chip.devices_per_chip:
        raise UsageError(
            f"--devices-per-trial {per_trial} does not cut {target.name}'s {devices} devices into whole chips; "
            f"use a divisor of {devices} (a multiple of {target.chip.devices_per_chip})"
        )
    chips = per_trial // target.chip.devices_per_chip
    part = Target(target.chip, slice_shape(target.chip, chips, f"{target.chip.name} x {chips} chips"))
    runs = search_probes(sweep.search) if sweep.search else sweep.runs
    seen: dict[str, Planned] = {}
    fitting = 0
    for run in runs:
        cfg = sweep.config(run)
        key = json.dumps(program_settings(cfg), sort_keys=True, default=str)
        if key not in seen:
            seen[key] = plan(cfg, part)
        planned = seen[key]
        fitting += planned.fits
        print(f"{run.name}: {_row(planned)}", flush=True)
    meshes = devices // per_trial
    print(
        f"plan: {len(runs)} runs on {meshes} sub-meshes of {per_trial} devices ({part.topology_name}) of "
        f"{target.name}: {min(meshes, len(runs))} at a time, {len(seen)} distinct program(s); {fitting} fit"
    )
    return 0 if fitting == len(runs) else 1


def _row(planned: Planned) -> str:
    step = planned.step_seconds(0.5)
    time = f", step {step * 1e3:,.1f} ms at 50% MFU" if step else ""
    return (
        f"{verdict(planned)}; ICI {human_bytes(planned.per_step(False))}/step, "
        f"DCN {human_bytes(planned.per_step(True))}/step{time}"
    )
