"""Optimizer and learning-rate schedule, built by name from the config.

Hyperparameters that do not change shapes (learning rate, warm-up, decay length, weight
decay, Adam's betas and epsilon, the gradient-clipping norm) are arrays in the train state, not constants in the compiled program,
so runs that differ only in them share one compiled step (and its persistent cache entry).
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

if TYPE_CHECKING:
    from engine.config import OptimizerConfig


def schedule_hparams(cfg: OptimizerConfig, total_steps: int) -> dict[str, np.ndarray]:
    """The learning-rate schedule's numbers, as float32 scalars carried in the train state."""
    return {"peak_learning_rate": np.float32(cfg.learning_rate), "warmup_steps": np.float32(cfg.warmup_steps),
            "decay_steps": np.float32(total_steps), "end_factor": np.float32(cfg.end_learning_rate_factor)}


def learning_rate_at(kind: str, step, hp: dict):
    """The learning rate at `step` for schedule `kind` (constant, warmup_cosine, warmup_linear)."""
    step = jnp.asarray(step, jnp.float32)
    peak, warmup = hp["peak_learning_rate"], hp["warmup_steps"]
    warming = peak * step / jnp.maximum(warmup, 1.0)
    if kind == "constant":
        return jnp.where(step < warmup, warming, peak)
    end = peak * hp["end_factor"]
    progress = jnp.clip((step - warmup) / jnp.maximum(hp["decay_steps"] - warmup, 1.0), 0.0, 1.0)
    if kind == "warmup_cosine":
        decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    else:  # warmup_linear
        decayed = peak + (end - peak) * progress
    return jnp.where(step < warmup, warming, decayed)


def optimizer_hparams(cfg: OptimizerConfig) -> dict[str, float]:
    """Numeric optimizer settings injected into the optimizer state (learning_rate set per step)."""
    hp = {"learning_rate": 0.0}
    if cfg.name == "momentum":
        hp["momentum"] = cfg.momentum
    if cfg.name in ("adam", "adamw"):
        hp.update(b1=cfg.momentum, b2=cfg.b2, eps=cfg.eps)
    if cfg.name == "adamw":
        hp["weight_decay"] = cfg.weight_decay
    if cfg.grad_clip_norm:  # the norm is a number in the state too; whether to clip is the program's
        hp["grad_clip_norm"] = cfg.grad_clip_norm
    return hp


# inject_hyperparams reads each builder's parameter names: those become state arrays
BUILDERS = {
    "sgd": lambda learning_rate: optax.sgd(learning_rate),
    "momentum": lambda learning_rate, momentum: optax.sgd(learning_rate, momentum=momentum),
    "adam": lambda learning_rate, b1, b2, eps: optax.adam(learning_rate, b1=b1, b2=b2, eps=eps),
    "adamw": lambda learning_rate, b1, b2, eps, weight_decay: optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps,
                                                                         weight_decay=weight_decay),
}


def clip_by_global_norm(max_norm) -> optax.GradientTransformation:
    """optax.clip_by_global_norm, for a norm given as a float32 array (a state number): each
    clipped update keeps its dtype, as it does with optax's own for a Python float."""

    def update(updates, state, params=None):
        norm = optax.tree.norm(updates)
        keep = norm < max_norm
        return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm.astype(t.dtype)),
                            updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
    """The optimizer (with optional global-norm clipping), its numbers held in its state."""
    build = BUILDERS[cfg.name]

    def clipped(grad_clip_norm=None, **hparams):
        tx = build(**hparams)
        return optax.chain(clip_by_global_norm(grad_clip_norm), tx) if cfg.grad_clip_norm else tx

    parameters = list(inspect.signature(build).parameters.values())
    if cfg.grad_clip_norm:
        parameters.append(inspect.Parameter("grad_clip_norm", inspect.Parameter.KEYWORD_ONLY))
    clipped.__signature__ = inspect.Signature(parameters)  # inject_hyperparams reads the parameter names
    # float32 whatever the parameters' dtype: in bfloat16, Adam's b2=0.999 would round to 1.0
    return optax.inject_hyperparams(clipped, hyperparam_dtype=jnp.float32)(**optimizer_hparams(cfg))
