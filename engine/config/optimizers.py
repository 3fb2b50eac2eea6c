"""The optimizers and learning-rate schedules `optimizer.name` and `optimizer.schedule` choose
from: a table the config reads for its choices (without jax: a sweep's process checks configs)
and engine/optim/optimizer.py builds from.

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
    optax_name: str  # the optax function that builds it, e.g. "adamw" ("contrib.muon": in optax.contrib)
    hparams: dict[str, str] = field(default_factory=dict)  # its argument → the optimizer.* field giving it
    fixed: dict[str, Any] = field(default_factory=dict)  # arguments that are not numbers of the state
    mask_arg: str = ""  # its argument taking a weight-decay mask ("" = no weight decay)


OPTIMIZERS: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind("sgd"),
    "momentum": OptimizerKind("sgd", {"momentum": "momentum"}),
    "adam": OptimizerKind("adam", {"b1": "momentum", "b2": "b2", "eps": "eps"}),
    "adamw": OptimizerKind(
        "adamw", {"b1": "momentum", "b2": "b2", "eps": "eps", "weight_decay": "weight_decay"}, mask_arg="mask"
    ),
    # Lion (Chen et al. 2023): sign of an interpolated momentum; its paper's b2 is 0.99
    "lion": OptimizerKind("lion", {"b1": "momentum", "b2": "b2", "weight_decay": "weight_decay"}, mask_arg="mask"),
    # Adafactor (Shazeer & Stern 2018): factored second moments, relative step sizes
    "adafactor": OptimizerKind("adafactor", {"weight_decay_rate": "weight_decay"}, mask_arg="weight_decay_mask"),
    # Muon (Jordan et al. 2024): orthogonalised momentum for 2-D parameters, Adam for the others
    "muon": OptimizerKind(
        "contrib.muon", {"beta": "momentum", "weight_decay": "weight_decay"}, mask_arg="weight_decay_mask"
    ),
}

# optimizer.weight_decay_on: which parameters decay (by their leaf name)
NO_DECAY_LEAVES = ("scale", "bias")  # norms' scales and biases: LLM recipes do not decay them
WEIGHT_DECAY_ON = ("all", "matrices")


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


def wsd(step, hp, xp):
    """Warmup-stable-decay: linear warm-up, the peak rate, then a linear decay to end_factor over
    the last decay_fraction of the run."""
    peak = hp["peak_learning_rate"]
    total = hp["decay_steps"]
    begin = xp.maximum(total * (1.0 - hp["decay_fraction"]), hp["warmup_steps"])
    progress = xp.clip((step - begin) / xp.maximum(total - begin, 1.0), 0.0, 1.0)
    decayed = peak + (peak * hp["end_factor"] - peak) * progress
    return xp.where(step < hp["warmup_steps"], _warming(step, hp, xp), decayed)


# (step, the state's schedule numbers, array namespace) → learning rate
SCHEDULES: dict[str, Callable] = {
    "constant": constant,
    "warmup_cosine": warmup_cosine,
    "warmup_linear": warmup_linear,
    "wsd": wsd,
}

# optimizer.* the schedule reads
SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "end_learning_rate_factor", "decay_fraction")


def state_number_fields() -> tuple[str, ...]:
    """optimizer.* fields whose values are numbers in the train state (any optimizer's)."""
    used = {name for kind in OPTIMIZERS.values() for name in kind.hparams.values()}
    return (*SCHEDULE_FIELDS, *sorted(used), "grad_clip_norm")
