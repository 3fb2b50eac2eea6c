"""The training objectives (train.objective) as a table, after train.sync's strategies: OBJECTIVES
maps the key to a jax-free `Objective` record, which owns what a run asks of its objective: the
data it trains on, its config section and checks, its step hyperparameters, its metric columns
and records, rows and FLOPs per example, the reference it keeps and its pre-pass. The record
names its step part (the loss and the reference pass, built with jax: engine/objectives) as
"module:function"; engine/objectives `objective_part` imports it when a run is built. The config
layer imports no jax, so the records live here.

`objective_of(cfg)` is the one reader of cfg.train.objective: no module asks which objective
runs, and a new objective is one entry (lm here, dpo and grpo in dpo_objective.py and grpo_objective.py; a
test defines one)."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config.dpo_objective import DPO
from engine.config.grpo_objective import GRPO
from engine.config.objective_record import Objective
from engine.errors import UsageError

LM = Objective(name="lm", part="engine.objectives.lm:part", plain_step=True)  # the record of defaults

# train.objective → its record
OBJECTIVES: dict[str, Objective] = {"lm": LM, "dpo": DPO, "grpo": GRPO}


def objective_names() -> tuple[str, ...]:
    """train.objective's choices: the table's keys (read when a config is checked)."""
    return tuple(OBJECTIVES)


def objective_of(cfg) -> Objective:
    """The record of the config's train.objective (the one place that reads the key)."""
    return OBJECTIVES[cfg.train.objective]


def objective_rows(cfg) -> int:
    """The rows to the module of one example of the config's objective (a DPO pair: two)."""
    return objective_of(cfg).rows_per_example(cfg)


def claimed_sources() -> dict[str, str]:
    """data.name → the objective that alone trains on it (its record's data_sources)."""
    return {source: name for name, o in OBJECTIVES.items() for source in o.data_sources or ()}


def step_hparam_names() -> tuple[str, ...]:
    """The state's hparams that objectives add (evaluation reads them too: DPO's β)."""
    return tuple(name for o in OBJECTIVES.values() for name in o.step_hparams)


def vector_keys() -> tuple[str, ...]:
    """The config keys that objectives take as step inputs (a vectorised sweep may differ in them)."""
    return tuple(key for o in OBJECTIVES.values() for key in o.step_hparams.values())


def config_value(cfg, key: str) -> Any:
    """The value of a dotted config key ("dpo.beta")."""
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_objective(cfg) -> None:
    """UsageError naming the key and the fix when train.objective, the objectives' sections and
    data.name disagree, or the objective's own checks fail."""
    objective, data = objective_of(cfg), cfg.data.name
    name = objective.name
    objective.check(cfg)  # (its own first: it names its data and section best)
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
