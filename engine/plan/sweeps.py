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


def _row(planned: Planned) -> str:
    step = planned.step_seconds(0.5)
    time = f", step {step * 1e3:,.1f} ms at 50% MFU" if step else ""
    return (
        f"{verdict(planned)}; ICI {human_bytes(planned.per_step(False))}/step, "
        f"DCN {human_bytes(planned.per_step(True))}/step{time}"
    )
