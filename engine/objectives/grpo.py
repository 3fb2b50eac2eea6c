"""train.objective=grpo's step part (its record: engine/config/grpo_objective.py): the update on a
batch of rollouts, TRL's GRPOTrainer's loss (engine/lm/grpo_math.py) on the log-probabilities the
policy gives the sampled completions (engine/lm/rollouts.py's layout: left-padded prompts, the
completion after them, the pads a segment of their own).

A rollout batch (`rollout_batch`) holds, per completion (prompts x num_generations rows):
`prompt_tokens` int32 [rows, P], `prompt_mask` bool [rows, P], `completion_tokens` int32 [rows, C],
`completion_mask` bool [rows, C], `old_logps` float32 [rows, C] (the sampler's, recorded as each
token was drawn), `advantages` float32 [rows] (group-normalised rewards, computed on the host),
`rewards` float32 [rows] and `zero_std` float32 [rows] (1 where the completion's group had equal
rewards: TRL's frac_reward_zero_std counts groups, a group's rows count 1/G each). The step sums
GRPO_SUMS over the rows and tokens; the record (grpo_objective.grpo_record) divides them.

β (grpo.beta) is a step input (hparams[GRPO_BETA]); with β = 0 no reference runs (TRL loads none).
The reference: a LoRA state's base with the adapters off, or the full fine-tuning state's
REFERENCE copy of the start (engine/objectives/dpo_part.py reference_variables, DPO's)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from engine.config.grpo_objective import GRPO_BETA
from engine.lm import grpo_math
from engine.lm.rollouts import logprobs_of, update_inputs
from engine.objectives import RolloutPart, StepPart
from engine.objectives.dpo_part import reference_variables
from engine.state.train_state import AUX_COLLECTION, UNTRAINED, aux_totals, model_variables

ROLLOUT_ARRAYS = ("prompt_tokens", "prompt_mask", "completion_tokens", "completion_mask", "old_logps", "advantages")


def policy_logps(module, variables, batch, temperature: float, mutable) -> tuple[jax.Array, dict]:
    """(each completion token's log-probability under `variables` [rows, C] (0 off the mask), the
    collections made): one forward pass over prompt + completion (rollouts.update_inputs' layout)."""
    tokens, extra = update_inputs(batch["prompt_tokens"], batch["prompt_mask"], batch["completion_tokens"])
    (losses, _), collections = module.apply(
        variables, tokens, train=False, temperature=temperature, mutable=mutable, **extra
    )
    return logprobs_of(losses, batch["prompt_tokens"].shape[1], batch["completion_mask"]), collections


def make_grpo_loss_fn(module, grpo) -> Callable:
    """loss(params, model_state, batch, rng, train, hparams) → (loss, (metric sums, model_state)) on
    a rollout batch, as engine/objectives/lm.py make_loss_fn's: `loss_sum` and `count` are
    grpo_math.loss_sum_and_count's (so accumulated micro-batches give the batch's loss by
    grpo.loss_type), GRPO_SUMS the sums TRL's metrics are made of. No dropout (TRL's sampling and
    its ratio at the first update assume none)."""
    width = grpo.max_completion_tokens

    def loss_fn(params, model_state, batch, rng, train: bool, hparams=None):
        del rng
        rows = batch["advantages"].shape[0]
        row_weights = batch.get("mask", jnp.ones((rows,), jnp.float32)).astype(jnp.float32)
        mask = batch["completion_mask"].astype(jnp.float32) * row_weights[:, None]
        mutable = [*(c for c in model_state if train and c not in UNTRAINED), AUX_COLLECTION]
        logps, collections = policy_logps(
            module, model_variables(params, model_state), batch, grpo.temperature, mutable
        )
        beta = hparams[GRPO_BETA] if hparams and GRPO_BETA in hparams else grpo.beta
        ref_logps = None
        if grpo.beta > 0:  # (the config's: with 0 the state keeps no reference)
            ref_logps, _ = policy_logps(
                module, reference_variables(params, model_state), batch, grpo.temperature, [AUX_COLLECTION]
            )
            ref_logps = jax.lax.stop_gradient(ref_logps)
        old_logps = batch["old_logps"].astype(jnp.float32)
        advantages = batch["advantages"].astype(jnp.float32)
        losses, ratio, kl = grpo_math.per_token_losses(
            logps, old_logps, advantages, grpo.epsilon, grpo.epsilon_high, ref_logps, beta
        )
        loss_sum, count = grpo_math.loss_sum_and_count(losses, mask, grpo.loss_type, width)
        clip = grpo_math.clip_metrics(jax.lax.stop_gradient(ratio), advantages, mask, grpo.epsilon, grpo.epsilon_high)
        tokens = jnp.sum(mask)
        rewards = batch.get("rewards", jnp.zeros((rows,), jnp.float32)).astype(jnp.float32)
        aux = aux_totals(collections.get(AUX_COLLECTION, {}))
        metrics = {
            "loss_sum": loss_sum,
            "correct": jnp.zeros((), jnp.float32),
            "count": count,
            "aux_loss": aux["aux_loss"] * count,
            "routed": aux["routed"],
            "dropped": aux["dropped"],
            "completions": jnp.sum(row_weights),
            "completion_tokens": tokens,
            "kl_sum": jnp.sum(jax.lax.stop_gradient(kl) * mask) if kl is not None else jnp.zeros((), jnp.float32),
            "clip_region_sum": clip["clip_ratio/region_mean"] * tokens,
            "ratio_sum": jnp.sum(jax.lax.stop_gradient(ratio) * mask),
            "reward_sum": jnp.sum(rewards * row_weights),
            "reward_square_sum": jnp.sum(jnp.square(rewards) * row_weights),
            "zero_std_sum": jnp.sum(batch.get("zero_std", jnp.zeros((rows,), jnp.float32)) * row_weights),
            "truncated_sum": jnp.sum(batch.get("truncated", jnp.zeros((rows,), jnp.float32)) * row_weights),
        }
        new_state = {k: v for k, v in collections.items() if k != AUX_COLLECTION}
        new_model_state = {**model_state, **new_state} if train else model_state
        return loss_sum / jnp.maximum(count, 1.0) + aux["aux_loss"], (metrics, new_model_state)

    return loss_fn


def part(cfg) -> StepPart:
    """train.objective=grpo's step part: the update's loss on rollout batches, and the rollouts the
    run samples them with (engine/objectives/grpo_driver.py)."""
    from engine.objectives import grpo_driver

    grpo = cfg.grpo

    def loss_fn(module, family, num_sources: int = 0) -> Callable:
        del family, num_sources
        return make_grpo_loss_fn(module, grpo)

    rollouts = RolloutPart(
        data=grpo_driver.fitted,
        spec=grpo_driver.rollout_spec,
        rows=lambda cfg: cfg.train.global_batch_size * cfg.grpo.num_generations,
        build=grpo_driver.Rollouts,
    )
    return StepPart(loss_fn, rollouts=rollouts)
