"""Optimizer and learning-rate schedule, built by name from the config."""
from __future__ import annotations

import optax

from engine.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_learning_rate_factor
    if cfg.schedule == "constant":
        if cfg.warmup_steps:
            return optax.linear_schedule(0.0, peak, cfg.warmup_steps)
        return optax.constant_schedule(peak)
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, cfg.warmup_steps, max(total_steps, cfg.warmup_steps + 1),
                                                  end)
    # warmup_linear
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, cfg.warmup_steps),
         optax.linear_schedule(peak, end, max(total_steps - cfg.warmup_steps, 1))],
        [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    if cfg.name == "sgd":
        tx = optax.sgd(schedule)
    elif cfg.name == "momentum":
        tx = optax.sgd(schedule, momentum=cfg.momentum)
    elif cfg.name == "adam":
        tx = optax.adam(schedule, b1=cfg.momentum, b2=cfg.b2, eps=cfg.eps)
    else:
        tx = optax.adamw(schedule, b1=cfg.momentum, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.grad_clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), tx)
    return tx
