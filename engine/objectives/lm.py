"""train.objective=lm's step part: the family's loss, `make_loss_fn` (its record is
engine/config/objective.py LM)."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from engine.objectives import StepPart
from engine.state.train_state import AUX_COLLECTION, UNTRAINED, aux_totals, model_variables, split_variables


def part(cfg) -> StepPart:
    del cfg

    def loss_fn(module, family, num_sources: int = 0):
        return make_loss_fn(module, family.task, family.hparams, num_sources)

    return StepPart(loss_fn)


def make_loss_fn(module: nn.Module, task, hparam_names: tuple[str, ...] = (), num_sources: int = 0) -> Callable:
    """loss(params, model_state, batch, rng, train, hparams) → (mean loss, (metric sums, new model_state)).

    The model family's task says what the module takes from the batch and how its output
    becomes a loss per target; `hparam_names` are the family's shape-independent
    hyperparameters, passed to the module call by name in training.

    Metric sums (`loss_sum`, `correct`, `count`) are summed over (weighted) examples, so
    they add up exactly across microbatches, devices and eval batches. The task may weight
    targets itself (packed token data: padding and document boundaries count 0). With a
    mixture of `num_sources` data sources (the batch's `source` row ids), `source_tokens`
    sums the counted targets of each source.
    """

    def loss_fn(params, model_state, batch, rng, train: bool, hparams=None):
        inputs, targets, extra = task.model_inputs(batch)
        weights = batch.get("mask", jnp.ones(targets.shape[:1], jnp.float32))
        weights = jnp.broadcast_to(weights.reshape(weights.shape + (1,) * (targets.ndim - 1)), targets.shape)
        target_weights = task.target_weights(batch)
        if target_weights is not None:
            weights = weights * target_weights
        variables = model_variables(params, model_state)
        mutable = [*(c for c in model_state if train and c not in UNTRAINED), AUX_COLLECTION]
        model_hparams = {name: hparams[name] for name in hparam_names} if train and hparams else {}
        out, collections = module.apply(
            variables,
            inputs,
            train=train,
            example_ids=batch.get("example_id"),
            rngs={"dropout": rng} if train else None,
            mutable=mutable,
            **model_hparams,
            **extra,
        )
        new_model_state = {**model_state, **split_variables(collections)[1]} if train else model_state
        aux = aux_totals(collections.get(AUX_COLLECTION, {}))
        losses, hits = task.losses(out, targets)  # float32 per target, argmax == target
        count = jnp.sum(weights)
        loss_sum = jnp.sum(losses * weights)
        correct = jnp.sum(hits * weights)
        # aux_loss (weighted by count, as the loss is, so microbatches and devices add up): the
        # model's own terms of the objective (a mixture of experts' load balancing); routed and
        # dropped: its token-to-expert assignments and those over an expert's capacity
        metrics = {
            "loss_sum": loss_sum,
            "correct": correct,
            "count": count,
            "aux_loss": aux["aux_loss"] * count,
            "routed": aux["routed"],
            "dropped": aux["dropped"],
        }
        if num_sources and train and "source" in batch:
            per_row = jnp.sum(weights.reshape(weights.shape[0], -1), axis=1)
            metrics["source_tokens"] = jax.ops.segment_sum(per_row, batch["source"], num_segments=num_sources)
        return loss_sum / jnp.maximum(count, 1.0) + aux["aux_loss"], (metrics, new_model_state)

    return loss_fn
