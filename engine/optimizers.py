"""The optimizers and learning-rate schedules `optimizer.name` and `optimizer.schedule` choose
from: a table the config reads for its choices (without jax: a sweep's process checks configs)
and engine/optim.py builds from.

An optimizer is an optax function and the `optimizer.*` fields its arguments come from; those
numbers become arrays in the optimizer state (optax.inject_hyperparams), so runs that differ
only in them share one compiled program. A schedule is a formula over an array namespace
(`xp`: jax.numpy in the step), of the step and the schedule's numbers in the train state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class OptimizerKind:
    optax_name: str  # the optax function that builds it, e.g. "adamw"
    hparams: dict[str, str] = field(default_factory=dict)  # its argument → the optimizer.* field giving it
    fixed: dict[str, Any] = field(default_factory=dict)  # arguments that are not numbers of the state


OPTIMIZERS: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind("sgd"),
    "momentum": OptimizerKind("sgd", {"momentum": "momentum"}),
    "adam": OptimizerKind("adam", {"b1": "momentum", "b2": "b2", "eps": "eps"}),
    "adamw": OptimizerKind("adamw", {"b1": "momentum", "b2": "b2", "eps": "eps", "weight_decay": "weight_decay"}),
}


def _warming(step, hp, xp):
    return hp["peak_learning_rate"] * step / xp.maximum(hp["warmup_steps"], 1.0)


def _progress(step, hp, xp):
    """0 at the end of warm-up, 1 at the end of the run."""
    warmup = hp["warmup_steps"]
    return xp.clip((step - warmup) / xp.maximum(hp["decay_steps"] - warmup, 1.0), 0.0, 1.0)


def constant(step, hp, xp):
    return xp.where(step < hp["warmup_steps"], _warming(step, hp, xp), hp["peak_learning_rate"])


def warmup_cosine(step, hp, xp):
    peak = hp["peak_learning_rate"]
    end = peak * hp["end_factor"]
    decayed = end + (peak - end) * 0.5 * (1.0 + xp.cos(xp.pi * _progress(step, hp, xp)))
    return xp.where(step < hp["warmup_steps"], _warming(step, hp, xp), decayed)


def warmup_linear(step, hp, xp):
    peak = hp["peak_learning_rate"]
    decayed = peak + (peak * hp["end_factor"] - peak) * _progress(step, hp, xp)
    return xp.where(step < hp["warmup_steps"], _warming(step, hp, xp), decayed)


# (step, the state's schedule numbers, array namespace) → learning rate
SCHEDULES: dict[str, Callable] = {"constant": constant, "warmup_cosine": warmup_cosine, "warmup_linear": warmup_linear}

SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "end_learning_rate_factor")  # optimizer.* the schedule reads


def state_number_fields() -> tuple[str, ...]:
    """optimizer.* fields whose values are numbers in the train state (any optimizer's)."""
    used = {name for kind in OPTIMIZERS.values() for name in kind.hparams.values()}
    return (*SCHEDULE_FIELDS, *sorted(used), "grad_clip_norm")
