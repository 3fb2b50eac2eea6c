"""GRPO's arithmetic (engine/lm/grpo_math.py) against TRL's formulas written out in numpy, and
against TRL's own GRPOTrainer._compute_loss where torch and trl are installed (the hf extra)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.lm import grpo_math

GROUPS, GENERATIONS, TOKENS, VOCAB = 3, 4, 5, 7


ROWS = GROUPS * GENERATIONS


EPSILON, EPSILON_HIGH, BETA = 0.2, 0.28, 0.05


def _batch(seed: int = 0):
    """Log-probabilities (policy, old, reference) [rows, tokens], rewards [rows], a mask [rows,
    tokens] with rows of different lengths, one of them empty, and one group of equal rewards."""
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.1, 3.0, (ROWS, TOKENS)).astype(np.float32)
    old = (logps + rng.normal(0.0, 0.3, (ROWS, TOKENS))).astype(np.float32)  # ratios beyond both clips
    ref = (logps + rng.normal(0.0, 0.5, (ROWS, TOKENS))).astype(np.float32)
    lengths = rng.integers(1, TOKENS + 1, ROWS)
    lengths[3] = 0  # a completion with no counted token (grpo still counts it as a row)
    mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = rng.integers(0, 3, ROWS).astype(np.float32)
    rewards[GENERATIONS : 2 * GENERATIONS] = 1.0  # group 1: every completion rewarded alike
    return logps, old, ref, mask, rewards


def _numpy_advantages(rewards, scale_rewards):
    """TRL's advantages, written out: the group's mean subtracted, divided by std + 1e-4 (Bessel)."""
    groups = rewards.reshape(-1, GENERATIONS)
    mean = np.repeat(groups.mean(axis=1), GENERATIONS)
    std = np.repeat(groups.std(axis=1, ddof=1), GENERATIONS)
    if scale_rewards == "batch":
        std = np.full_like(rewards, rewards.std(ddof=1))
    advantages = rewards - mean
    return advantages if scale_rewards == "none" else advantages / (std + 1e-4)


def _numpy_loss(logps, old, ref, advantages, mask, loss_type, num_items=None):
    """TRL 1.x's _compute_loss (token-level ratios, no accumulation, one process) in numpy."""
    ratio = np.exp(logps - old)
    a = advantages[:, None]
    per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - EPSILON, 1 + EPSILON_HIGH) * a)
    per_token = per_token + BETA * (np.exp(ref - logps) - (ref - logps) - 1)
    if loss_type == "grpo":
        return np.mean((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0))
    if loss_type == "bnpo":
        return (per_token * mask).sum() / max(mask.sum(), 1.0)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * TOKENS)
    return (per_token * mask).sum() / max(mask.sum() if num_items is None else num_items, 1.0)


@pytest.mark.parametrize("scale_rewards", grpo_math.SCALE_REWARDS)
def test_advantages_sum_to_zero_within_each_group_and_follow_trl(scale_rewards):
    rewards = _batch()[-1]
    advantages, _ = grpo_math.group_advantages(rewards, GENERATIONS, scale_rewards)
    np.testing.assert_allclose(np.asarray(advantages).reshape(GROUPS, GENERATIONS).sum(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(advantages, _numpy_advantages(rewards, scale_rewards), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale_rewards", grpo_math.SCALE_REWARDS)
def test_a_reward_function_that_does_not_apply_is_left_out(scale_rewards):
    """TRL's None (here NaN): a function's None is left out of the weighted sum and of its own
    mean; a completion no function scores is left out of its group's mean and std and gets
    advantage 0."""
    rewards_per_function = np.array(
        [[1, np.nan], [0, 2], [np.nan, np.nan], [1, 1], [np.nan, 3], [0, 0], [2, np.nan], [1, 0]], np.float32
    )
    weights = np.array([1.0, 0.5], np.float32)
    advantages, metrics = grpo_math.reward_metrics(rewards_per_function, ("a", "b"), 4, weights, scale_rewards)
    rewards = np.nansum(rewards_per_function * weights, axis=1)
    rewards[2] = np.nan
    groups = rewards.reshape(2, 4)
    mean = np.repeat(np.nanmean(groups, axis=1), 4)
    std = np.repeat(np.nanstd(groups, axis=1, ddof=1), 4)
    if scale_rewards == "batch":
        std = np.full(8, np.nanstd(rewards, ddof=1))
    expected = rewards - mean if scale_rewards == "none" else (rewards - mean) / (std + 1e-4)
    np.testing.assert_allclose(advantages, np.nan_to_num(expected), rtol=1e-6, atol=1e-6)
    assert float(metrics["reward"]) == pytest.approx(np.nanmean(rewards))
    assert float(metrics["reward_std"]) == pytest.approx(np.nanstd(rewards, ddof=1))
    assert float(metrics["rewards/b/mean"]) == pytest.approx(np.nanmean(rewards_per_function[:, 1]))


def test_groups_must_hold_num_generations():
    with pytest.raises(ValueError, match="num_generations=5"):
        grpo_math.group_advantages(np.zeros(ROWS), 5)
    with pytest.raises(ValueError, match="scale_rewards='mean'"):
        grpo_math.group_advantages(np.zeros(ROWS), GENERATIONS, "mean")


@pytest.mark.parametrize("loss_type", grpo_math.LOSS_TYPES)
def test_an_equal_group_has_no_advantage_no_gradient_and_counts_in_frac_reward_zero_std(loss_type):
    logps, old, _, mask, rewards = _batch()
    rewards_per_function = np.stack([rewards, np.zeros_like(rewards)], axis=1)  # a second function: always 0
    advantages, metrics = grpo_math.reward_metrics(rewards_per_function, ("exact", "never"), GENERATIONS)
    equal = slice(GENERATIONS, 2 * GENERATIONS)
    assert np.all(np.asarray(advantages)[equal] == 0.0)
    # one group of three has equal rewards (group 1), and only it: the others' stds are not zero
    assert float(metrics["frac_reward_zero_std"]) == pytest.approx(1 / GROUPS)
    assert float(metrics["rewards/never/std"]) == 0.0 and float(metrics["reward"]) == pytest.approx(rewards.mean())

    def loss(logps):
        return grpo_math.grpo_loss(logps, old, advantages, mask, loss_type, EPSILON, EPSILON_HIGH)[0]

    grad = np.asarray(jax.grad(loss)(jnp.asarray(logps)))
    assert np.all(grad[equal] == 0.0)
    assert np.any(grad[:GENERATIONS] != 0.0)  # (the other groups do move the policy)


def test_at_the_first_update_the_ratio_is_one_and_the_kl_zero():
    logps, _, _, mask, rewards = _batch()
    advantages, _ = grpo_math.group_advantages(rewards, GENERATIONS)
    losses, ratio, kl = grpo_math.per_token_losses(logps, logps, advantages, EPSILON, EPSILON_HIGH, logps, BETA)
    np.testing.assert_array_equal(ratio, 1.0)
    np.testing.assert_array_equal(kl, 0.0)
    _, metrics = grpo_math.grpo_loss(logps, logps, advantages, mask, "dapo", EPSILON, EPSILON_HIGH, BETA, logps)
    assert float(metrics["kl"]) == 0.0
    assert float(metrics["clip_ratio/region_mean"]) == 0.0
    with pytest.raises(ValueError, match="give ref_logps"):
        grpo_math.per_token_losses(logps, logps, advantages, beta=BETA)


@pytest.mark.parametrize("loss_type", grpo_math.LOSS_TYPES)
def test_one_iteration_gradient_is_reinforce_with_the_group_mean_baseline(loss_type):
    """num_iterations=1: old log-probabilities are the policy's own (stop-gradient) and the
    reference is where the policy starts, so the gradient with respect to a softmax policy's
    logits is REINFORCE's, -Σ w A (onehot - softmax), with A = (r - group mean) / (std + 1e-4)
    computed here by hand and w the loss type's weight of each counted token."""
    _, _, _, mask, rewards = _batch()
    rng = np.random.default_rng(1)
    logits = rng.normal(0.0, 1.0, (ROWS, TOKENS, VOCAB)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, (ROWS, TOKENS))
    advantages, _ = grpo_math.group_advantages(rewards, GENERATIONS, "group")

    def token_logps(logits):
        return jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens)[..., None], axis=-1)[..., 0]

    start = token_logps(jnp.asarray(logits))  # the reference: the policy before the update

    def loss(logits):
        logps = token_logps(logits)
        old = jax.lax.stop_gradient(logps)
        return grpo_math.grpo_loss(logps, old, advantages, mask, loss_type, EPSILON, EPSILON_HIGH, BETA, start)[0]

    grad = np.asarray(jax.grad(loss)(jnp.asarray(logits)))

    groups = rewards.reshape(GROUPS, GENERATIONS)
    baseline = np.repeat(groups.mean(axis=1), GENERATIONS)
    by_hand = (rewards - baseline) / (np.repeat(groups.std(axis=1, ddof=1), GENERATIONS) + 1e-4)
    weight = {
        "grpo": mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) / ROWS,
        "bnpo": mask / mask.sum(),
        "dapo": mask / mask.sum(),
        "dr_grpo": mask / (ROWS * TOKENS),
    }[loss_type]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    score = np.eye(VOCAB, dtype=np.float32)[tokens] - probs  # ∇ log softmax(logits)[token]
    expected = -(weight * by_hand[:, None])[..., None] * score
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", grpo_math.LOSS_TYPES)
def test_each_loss_type_and_its_metrics_follow_trl_formula(loss_type):
    logps, old, ref, mask, rewards = _batch(seed=2)
    advantages = _numpy_advantages(rewards, "group").astype(np.float32)
    loss, metrics = grpo_math.grpo_loss(
        logps, old, advantages, mask, loss_type, EPSILON, EPSILON_HIGH, BETA, ref, TOKENS
    )
    np.testing.assert_allclose(loss, _numpy_loss(logps, old, ref, advantages, mask, loss_type), rtol=1e-5)

    ratio, a = np.exp(logps - old), advantages[:, None]
    low, high = (ratio < 1 - EPSILON) & (a < 0), (ratio > 1 + EPSILON_HIGH) & (a > 0)
    counted = mask.sum(-1)
    with np.errstate(invalid="ignore"):  # (TRL's per-completion means: NaN for the empty one, skipped)
        per_low, per_high = (low * mask).sum(-1) / counted, (high * mask).sum(-1) / counted
    expected = {
        "clip_ratio/low_mean": (low * mask).sum() / mask.sum(),
        "clip_ratio/high_mean": (high * mask).sum() / mask.sum(),
        "clip_ratio/region_mean": ((low | high) * mask).sum() / mask.sum(),
        "clip_ratio/low_min": np.nanmin(per_low),
        "clip_ratio/high_max": np.nanmax(per_high),
        "kl": ((np.exp(ref - logps) - (ref - logps) - 1) * mask).sum() / mask.sum(),
    }
    assert expected["clip_ratio/low_mean"] > 0 and expected["clip_ratio/high_mean"] > 0  # (both clips at work)
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, err_msg=name)


def test_dapo_divides_by_the_whole_generation_batch_tokens():
    logps, old, ref, mask, rewards = _batch(seed=3)
    advantages = _numpy_advantages(rewards, "none").astype(np.float32)
    loss, _ = grpo_math.grpo_loss(logps, old, advantages, mask, "dapo", EPSILON, EPSILON_HIGH, BETA, ref, None, 40.0)
    np.testing.assert_allclose(loss, _numpy_loss(logps, old, ref, advantages, mask, "dapo", 40.0), rtol=1e-5)


@pytest.mark.parametrize("loss_type", grpo_math.LOSS_TYPES)
def test_sums_and_counts_of_micro_batches_add_up_to_the_batch_loss(loss_type):
    """Gradient accumulation adds (sum, count) over micro-batches (rows k, k + n, …, as
    engine/run/step.py splits them): the whole batch's loss for grpo, dr_grpo and dapo, and the
    mean of the micro-batches' losses for bnpo (TRL's accumulated bnpo)."""
    logps, old, ref, mask, rewards = _batch(seed=5)
    advantages = _numpy_advantages(rewards, "group").astype(np.float32)
    losses, _, _ = grpo_math.per_token_losses(logps, old, advantages, EPSILON, EPSILON_HIGH, ref, BETA)
    losses = np.asarray(losses)
    parts = [slice(k, None, 3) for k in range(3)]
    sums, counts = zip(*(grpo_math.loss_sum_and_count(losses[p], mask[p], loss_type, TOKENS) for p in parts))
    if loss_type == "bnpo":
        expected = np.mean([grpo_math.aggregate(losses[p], mask[p], loss_type, TOKENS) for p in parts])
    else:
        expected = grpo_math.aggregate(losses, mask, loss_type, TOKENS)
    np.testing.assert_allclose(sum(sums) / sum(counts), expected, rtol=1e-5)


def test_clip_extremes_skip_a_completion_with_no_counted_token():
    """clip_ratio/low_min and high_max are TRL's nanmin and nanmax over completions: one with no
    counted token (its share 0/0) is left out, not taken as 0."""
    ratio = np.array([[0.5, 1.0], [0.5, 0.5], [0.5, 0.5]], np.float32)
    mask = np.array([[1, 1], [1, 0], [0, 0]], np.float32)
    metrics = grpo_math.clip_metrics(ratio, -np.ones(3, np.float32), mask)
    assert float(metrics["clip_ratio/low_min"]) == 0.5
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(2 / 3)


def test_completion_metrics():
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    metrics = grpo_math.completion_metrics(mask, truncated=np.array([False, True, False]))
    expected = {"mean_length": 7 / 3, "min_length": 1, "max_length": 4, "clipped_ratio": 1 / 3}
    expected.update(mean_terminated_length=1.5, min_terminated_length=1, max_terminated_length=2)
    for name, value in expected.items():
        assert float(metrics[f"completions/{name}"]) == pytest.approx(value), name


@pytest.mark.parametrize("loss_type", grpo_math.LOSS_TYPES)
def test_loss_gradient_and_metrics_equal_trl_grpo_trainer(loss_type):
    """TRL's own GRPOTrainer._compute_loss on the same log-probabilities, advantages and mask
    (its model's forward replaced by them), one process, no accumulation."""
    torch = pytest.importorskip("torch")
    grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
    logps, old, ref, mask, rewards = _batch(seed=4)
    advantages = _numpy_advantages(rewards, "group").astype(np.float32)
    policy = torch.tensor(logps, requires_grad=True)
    metrics: dict = {"train": {}}
    trainer = _trl_trainer(torch, loss_type, policy, metrics)
    inputs = {
        "prompt_ids": torch.zeros((ROWS, 1), dtype=torch.long),
        "prompt_mask": torch.ones((ROWS, 1), dtype=torch.long),
        "completion_ids": torch.zeros((ROWS, TOKENS), dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(advantages),
        "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref),
        "num_items_in_batch": torch.tensor(mask.sum()),
    }
    trl_loss = grpo_trainer.GRPOTrainer._compute_loss(trainer, None, inputs)
    trl_loss.backward()

    def loss(logps):
        return grpo_math.grpo_loss(logps, old, advantages, mask, loss_type, EPSILON, EPSILON_HIGH, BETA, ref, TOKENS)

    (ours, ours_metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logps))
    np.testing.assert_allclose(ours, trl_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(grad, policy.grad.numpy(), rtol=1e-5, atol=1e-8)
    for name, values in metrics["train"].items():
        if name in ours_metrics:
            np.testing.assert_allclose(ours_metrics[name], values[-1], rtol=1e-5, err_msg=name)
    assert set(ours_metrics) <= set(metrics["train"])


def _trl_trainer(torch, loss_type: str, policy, metrics: dict):
    """A stand-in `self` for GRPOTrainer._compute_loss: TRL's defaults of everything but the loss
    type, ε, ε_high and β; the forward pass returns `policy`; the accelerator is one process."""
    from collections import defaultdict

    metrics["train"] = defaultdict(list)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    accelerator = types.SimpleNamespace(
        num_processes=1,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
    )
    return types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (policy, torch.zeros_like(policy), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=BETA,
        args=args,
        loss_type=loss_type,
        epsilon_low=EPSILON,
        epsilon_high=EPSILON_HIGH,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=TOKENS,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        _metrics=metrics,
    )
