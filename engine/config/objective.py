"""The training objective's keys checked together: train.objective, its config section and
data.name, by the objective's record (engine/objectives), then the record's own checks."""

from __future__ import annotations

import dataclasses

from engine.errors import UsageError
from engine.objectives import OBJECTIVES, claimed_sources, objective_of


def check_objective(cfg) -> None:
    """UsageError naming the key and the fix when train.objective, the objectives' sections and
    data.name disagree, or the objective's own checks fail."""
    objective, data = objective_of(cfg), cfg.data.name
    name = objective.name
    if objective.data_sources is not None and data not in objective.data_sources:
        raise UsageError(
            f"train.objective={name} trains on data.name={' or '.join(objective.data_sources)}, but "
            f"data.name={data}; set data.name={objective.data_sources[0]}, or train.objective=lm"
        )
    owner = claimed_sources().get(data, name)
    if owner != name:
        raise UsageError(
            f"data.name={data} is train.objective={owner}'s data, which train.objective={name} cannot train on; "
            f"set train.objective={owner}"
        )
    for other in OBJECTIVES.values():
        section = other.section
        if section is None or section == objective.section or not hasattr(cfg, section):
            continue
        given = getattr(cfg, section)
        changed = [
            f"{section}.{f.name}={getattr(given, f.name)}"
            for f in dataclasses.fields(given)
            if getattr(given, f.name) != getattr(type(given)(), f.name)
        ]
        if changed:
            raise UsageError(
                f"{', '.join(changed)} set with train.objective={name}, which has no use for it; set "
                f"train.objective={other.name}, or leave the {section} section out"
            )
    objective.check(cfg)
