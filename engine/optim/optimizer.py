"""Optimizer and learning-rate schedule, built by name from the config (engine/config/optimizers.py's tables).

Hyperparameters that do not change shapes (learning rate, warm-up, decay length, weight
decay, Adam's betas and epsilon, the gradient-clipping norm) are arrays in the train state,
not constants in the compiled program, so runs that differ only in them share one compiled
step (and its persistent cache entry).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

from engine.config.optimizers import NO_DECAY_LEAVES, OPTIMIZERS, SCHEDULES, OptimizerKind

if TYPE_CHECKING:
    from engine.config import OptimizerConfig


def schedule_hparams(cfg: OptimizerConfig, total_steps: int) -> dict[str, np.float32]:
    """The learning-rate schedule's numbers, as float32 scalars carried in the train state."""
    numbers = {
        "peak_learning_rate": np.float32(cfg.learning_rate),
        "warmup_steps": np.float32(cfg.warmup_steps),
        "decay_steps": np.float32(total_steps),
        "end_factor": np.float32(cfg.end_learning_rate_factor),
    }
    if cfg.schedule == "wsd":  # only wsd's state carries it: the other schedules' checkpoints stay as they were
        numbers["decay_fraction"] = np.float32(cfg.decay_fraction)
    return numbers


def learning_rate_at(kind: str, step, hp: dict):
    """The learning rate at `step` for schedule `kind` (engine/config/optimizers.py SCHEDULES)."""
    return SCHEDULES[kind](jnp.asarray(step, jnp.float32), hp, jnp)


def optimizer_hparams(cfg: OptimizerConfig) -> dict[str, float]:
    """Numeric optimizer settings injected into the optimizer state (learning_rate set per step)."""
    hp = {"learning_rate": 0.0, **{arg: getattr(cfg, name) for arg, name in OPTIMIZERS[cfg.name].hparams.items()}}
    if cfg.grad_clip_norm:  # the norm is a number in the state too; whether to clip is the program's
        hp["grad_clip_norm"] = cfg.grad_clip_norm
    return hp


def decay_mask(params):
    """True for the parameters weight decay applies to under optimizer.weight_decay_on=matrices:
    all but norms' scales and biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY_LEAVES, params
    )


def _builder(kind: OptimizerKind, weight_decay_on: str = "all"):
    """optax's function with the state's numbers as named parameters (inject_hyperparams reads
    the names: those become state arrays)."""
    build = functools.reduce(getattr, kind.optax_name.split("."), optax)
    fixed = dict(kind.fixed)
    if weight_decay_on == "matrices" and kind.mask_arg:
        fixed[kind.mask_arg] = decay_mask

    def make(learning_rate, **hparams):
        return build(learning_rate, **hparams, **fixed)

    names = ["learning_rate", *kind.hparams]
    make.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    )
    return make


def clip_by_global_norm(max_norm) -> optax.GradientTransformation:
    """optax.clip_by_global_norm, for a norm given as a float32 array (a state number): each
    clipped update keeps its dtype, as it does with optax's own for a Python float."""

    def update(updates, state, params=None):
        norm = optax.tree.norm(updates)
        keep = norm < max_norm
        return jax.tree.map(
            lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm.astype(t.dtype)), updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The optimizer (with optional global-norm clipping), its numbers held in its state."""
    build = _builder(OPTIMIZERS[cfg.name], cfg.weight_decay_on)

    def clipped(grad_clip_norm=None, **hparams):
        tx = build(**hparams)
        return optax.chain(clip_by_global_norm(grad_clip_norm), tx) if cfg.grad_clip_norm else tx

    parameters = list(inspect.signature(build).parameters.values())
    if cfg.grad_clip_norm:
        parameters.append(inspect.Parameter("grad_clip_norm", inspect.Parameter.KEYWORD_ONLY))
    clipped.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # inject_hyperparams reads it
    # float32 whatever the parameters' dtype: in bfloat16, Adam's b2=0.999 would round to 1.0
    return optax.inject_hyperparams(clipped, hyperparam_dtype=jnp.float32)(**optimizer_hparams(cfg))
