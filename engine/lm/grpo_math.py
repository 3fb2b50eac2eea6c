"""GRPO's arithmetic (group-relative policy optimisation) as Hugging Face TRL's GRPOTrainer (1.x)
computes it, on given rewards, log-probabilities and masks: advantages, the clipped per-token
loss, the KL penalty, the loss types' aggregations and TRL's metrics.

Pure jax.numpy, no model: docs/design/grpo.md says where it sits in a GRPO step. The shapes are
one generation batch's: `rewards` [completions] (prompt by prompt, `num_generations` rows each:
row i * G + j is completion j of prompt i, as TRL's and the sampler's order), per-token arrays
[completions, max_completion_tokens] with `mask` 1 on each completion token the loss counts
(TRL's completion_mask: up to and including the end-of-text token).

TRL's names and formulas (trl/trainer/grpo_trainer.py, `_generate_and_score_completions` and
`_compute_loss`):
- advantage = (r - mean of r's group) / (std + 1e-4), the std (Bessel's) of the group
  (scale_rewards=group), of the whole batch (batch), or no division (none);
- per-token loss = -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) + β k3, with ρ = exp(logp - old
  logp) and k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman's estimator of KL(π ‖ ref));
- aggregation (`loss_type`): grpo the mean over completions of each one's mean over its tokens;
  bnpo the sum over tokens / the tokens of this batch; dr_grpo the sum / (completions ×
  max_completion_length); dapo the sum / `num_items` (the tokens of the whole generation batch:
  every device's, every accumulation step's; by default this batch's).
TRL divides every aggregate but dapo's by its gradient-accumulation steps and its bnpo counts the
tokens of one device's micro-batch: a step that takes the whole batch at once (this engine's)
gives TRL's numbers with one device and no accumulation (and for grpo, dr_grpo and dapo, TRL's
numbers on any number of devices and equal micro-batches).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL's loss_type (its others: cispo, sapo, luspo, vespo)
STD_EPSILON = 1e-4  # added to the std before dividing by it (TRL's)
ZERO_STD = 1e-8  # a std at most this is zero: torch.isclose(std, 0)'s tolerance, TRL's test for frac_reward_zero_std


def weighted_rewards(rewards_per_function, weights: Optional[Sequence[float]] = None):
    """Each completion's reward [completions]: the reward functions' [completions, functions]
    summed with `weights` (TRL's reward_weights; None: 1 each). NaN marks a function that does not
    apply to a completion (TRL's None): left out of the sum; NaN where none applies."""
    rewards_per_function = jnp.asarray(rewards_per_function, jnp.float32)
    scale = jnp.ones(rewards_per_function.shape[-1]) if weights is None else jnp.asarray(weights, jnp.float32)
    total = jnp.nansum(rewards_per_function * scale, axis=-1)
    return jnp.where(jnp.all(jnp.isnan(rewards_per_function), axis=-1), jnp.nan, total)


def _std(x, axis=None):
    """The standard deviation of the values that are not NaN, with Bessel's correction; NaN for
    fewer than two (TRL's nanstd)."""
    count = jnp.sum(~jnp.isnan(x), axis=axis)
    variance = jnp.nanmean(jnp.square(x - jnp.nanmean(x, axis=axis, keepdims=True)), axis=axis)
    return jnp.where(count > 1, jnp.sqrt(variance * count / jnp.maximum(count - 1, 1)), jnp.nan)


def group_advantages(rewards, num_generations: int, scale_rewards: str = "group"):
    """(each completion's advantage [completions], whether its std counts as zero [completions])
    from its reward: less its group's mean, divided by the std + STD_EPSILON of the group (group)
    or of the batch (batch), or not divided (none: the std is the group's, for the zero test).
    A NaN reward (no reward function applies) is left out of the mean and the std, and its
    completion's advantage is 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if num_generations < 2 or rewards.shape[0] % num_generations:
        raise ValueError(
            f"{rewards.shape[0]} rewards do not make groups of num_generations={num_generations} (at least 2)"
        )
    groups = rewards.reshape(-1, num_generations)  # [prompts, generations]
    baseline = jnp.repeat(jnp.nanmean(groups, axis=1), num_generations)
    if scale_rewards == "batch":
        std = jnp.broadcast_to(_std(rewards), rewards.shape)
    else:
        std = jnp.repeat(_std(groups, axis=1), num_generations)
    advantages = rewards - baseline
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return jnp.nan_to_num(advantages, nan=0.0), jnp.abs(std) <= ZERO_STD


def k3_kl(logps, ref_logps):
    """Schulman's k3 estimate of KL(policy ‖ reference) per token: exp(d) - d - 1, d = ref - logp
    (0 where they agree, never negative)."""
    delta = ref_logps - logps
    return jnp.exp(delta) - delta - 1.0


def per_token_losses(
    logps,
    old_logps,
    advantages,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    ref_logps=None,
    beta: float = 0.0,
):
    """(per-token loss, ratio ρ, k3 KL or None) [completions, tokens]: the clipped surrogate
    -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) plus β k3 where `ref_logps` are given (β = 0 needs
    none; β may be an array: a step input). `old_logps`: the sampling policy's (with one update
    per batch: stop_gradient(logps), so ρ = 1)."""
    if ref_logps is None and isinstance(beta, (int, float)) and beta != 0.0:
        raise ValueError(f"beta={beta} weighs a KL penalty to the reference: give ref_logps")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = jnp.exp(logps - old_logps)
    advantages = jnp.asarray(advantages, jnp.float32)[:, None]  # one per completion, for each of its tokens
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
    losses = -jnp.minimum(ratio * advantages, clipped * advantages)
    if ref_logps is None:
        return losses, ratio, None
    kl = k3_kl(logps, ref_logps)
    return losses + beta * kl, ratio, kl


def aggregate(per_token_loss, mask, loss_type: str, max_completion_length: Optional[int] = None, num_items=None):
    """The loss of a batch from its per-token losses by TRL's `loss_type` (see the module's
    docstring); `max_completion_length`: dr_grpo's constant (None: the arrays' token axis);
    `num_items`: dapo's token count (None: the tokens of `mask`)."""
    mask = jnp.asarray(mask, jnp.float32)
    total = jnp.sum(per_token_loss * mask)
    if loss_type == "grpo":
        per_sequence = jnp.sum(per_token_loss * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
        return jnp.mean(per_sequence)
    if loss_type == "bnpo":
        return total / jnp.maximum(jnp.sum(mask), 1.0)
    if loss_type == "dr_grpo":
        length = mask.shape[-1] if max_completion_length is None else max_completion_length
        return total / (mask.shape[0] * length)
    if loss_type == "dapo":
        return total / jnp.maximum(jnp.sum(mask) if num_items is None else num_items, 1.0)
    raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


def loss_sum_and_count(per_token_loss, mask, loss_type: str, max_completion_length: Optional[int] = None):
    """(sum, count) of a micro-batch whose quotient is `aggregate`'s loss, split so that sums and
    counts added over micro-batches (engine/run/step.py's accumulation weighs each micro-batch's
    mean by its count) give the whole batch's loss: grpo counts completions, dr_grpo completions
    (each sum / max_completion_length), dapo tokens; bnpo counts 1 a micro-batch, so accumulated
    it is TRL's mean of the micro-batches' token means."""
    mask = jnp.asarray(mask, jnp.float32)
    per_sequence = jnp.sum(per_token_loss * mask, axis=-1)
    rows = jnp.float32(mask.shape[0])
    if loss_type == "grpo":
        return jnp.sum(per_sequence / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)), rows
    if loss_type == "dr_grpo":
        length = mask.shape[-1] if max_completion_length is None else max_completion_length
        return jnp.sum(per_sequence) / length, rows
    if loss_type == "dapo":
        return jnp.sum(per_sequence), jnp.sum(mask)
    if loss_type == "bnpo":
        return jnp.sum(per_sequence) / jnp.maximum(jnp.sum(mask), 1.0), jnp.float32(1.0)
    raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


def masked_mean(values, mask):
    """The mean of `values` over the tokens `mask` counts (0 where it counts none): TRL's
    global_masked_mean."""
    mask = jnp.asarray(mask, jnp.float32)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _sequence_means(values, mask):
    """Each completion's mean of `values` over its counted tokens [completions] (NaN for one that
    counts none, which TRL's nanmin and nanmax then skip)."""
    mask = jnp.asarray(mask, jnp.float32)
    counted = jnp.sum(mask, axis=-1)
    return jnp.where(counted > 0, jnp.sum(values * mask, axis=-1) / jnp.maximum(counted, 1.0), jnp.nan)


def clip_metrics(ratio, advantages, mask, epsilon: float = 0.2, epsilon_high: Optional[float] = None) -> dict:
    """TRL's clip_ratio/*: the share of counted tokens whose ratio the clip held (below 1 - ε with
    a negative advantage: low; above 1 + ε_high with a positive one: high; either: region), and
    the least low share and the greatest high share of one completion."""
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    advantages = jnp.asarray(advantages, jnp.float32)[:, None]
    low = ((ratio < 1.0 - epsilon) & (advantages < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/region_mean": masked_mean(region, mask),
        "clip_ratio/low_min": jnp.nanmin(_sequence_means(low, mask)),
        "clip_ratio/high_max": jnp.nanmax(_sequence_means(high, mask)),
    }


def grpo_loss(
    logps,
    old_logps,
    advantages,
    mask,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    ref_logps=None,
    max_completion_length: Optional[int] = None,
    num_items=None,
) -> tuple:
    """(the loss, TRL's metrics of it: clip_ratio/* and, where `ref_logps` are given, kl) of a
    batch of completions: per_token_losses aggregated by `loss_type` (TRL's defaults: dapo,
    ε = 0.2, β = 0)."""
    losses, ratio, kl = per_token_losses(logps, old_logps, advantages, epsilon, epsilon_high, ref_logps, beta)
    loss = aggregate(losses, mask, loss_type, max_completion_length, num_items)
    metrics = clip_metrics(ratio, advantages, mask, epsilon, epsilon_high)
    if kl is not None:
        metrics["kl"] = masked_mean(kl, mask)
    return loss, metrics


def reward_metrics(
    rewards_per_function,
    names: Sequence[str],
    num_generations: int,
    weights: Optional[Sequence[float]] = None,
    scale_rewards: str = "group",
) -> tuple:
    """(each completion's advantage, TRL's reward metrics: reward, reward_std,
    rewards/<name>/mean and /std per reward function, frac_reward_zero_std) of a generation
    batch's rewards [completions, functions] (NaN where a function does not apply: left out)."""
    rewards_per_function = jnp.asarray(rewards_per_function, jnp.float32)
    rewards = weighted_rewards(rewards_per_function, weights)
    advantages, zero_std = group_advantages(rewards, num_generations, scale_rewards)
    metrics = {"reward": jnp.nanmean(rewards), "reward_std": _std(rewards)}
    for index, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = jnp.nanmean(rewards_per_function[:, index])
        metrics[f"rewards/{name}/std"] = _std(rewards_per_function[:, index])
    metrics["frac_reward_zero_std"] = jnp.mean(zero_std.astype(jnp.float32))
    return advantages, metrics


def completion_metrics(mask, truncated) -> dict:
    """TRL's completions/*: lengths (counted tokens) of every completion and of those that ended
    (not `truncated`: stopped by an end token before max_completion_length; 0 where none did),
    and the share truncated (clipped_ratio)."""
    lengths = jnp.sum(jnp.asarray(mask, jnp.float32), axis=-1)
    ended = ~jnp.asarray(truncated, bool)
    any_ended = jnp.any(ended)
    ended_mean = jnp.sum(jnp.where(ended, lengths, 0.0)) / jnp.maximum(jnp.sum(ended), 1)
    return {
        "completions/mean_length": jnp.mean(lengths),
        "completions/min_length": jnp.min(lengths),
        "completions/max_length": jnp.max(lengths),
        "completions/clipped_ratio": 1.0 - jnp.mean(ended.astype(jnp.float32)),
        "completions/mean_terminated_length": ended_mean,
        "completions/min_terminated_length": jnp.where(any_ended, jnp.min(jnp.where(ended, lengths, jnp.inf)), 0.0),
        "completions/max_terminated_length": jnp.where(any_ended, jnp.max(jnp.where(ended, lengths, -jnp.inf)), 0.0),
    }
